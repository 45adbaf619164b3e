"""decode: flash_attn_with_kvcache as a decoding loop calls it, against cuDNN and the copy rate.

    PYTHONPATH=src python3 benchmarks/suites/decode.py [--stages gate,decode,step,prefill,host]
        [--quick] [--no-fa2] [--out DIR]

bf16, head dim 128, 32 query heads, GQA 8:1 (4 kv heads) and 1:1 (32); every time is the public
call. Stages:
  gate     correctness first (the run stops if it fails): the public call against the float64
           oracle by docs/design.md section 5's rule, contiguous and paged, forced and automatic
           split counts, and an append + rotary checked against the torch backend.
  decode   q length 1, batch 1..64, cache 1k..128k, contiguous and paged (page 256; page 16 at
           one size): achieved K+V read bandwidth as % of the device-to-device copy bandwidth
           measured in the same run, as CUDA-graph replays (the GPU time) and eager calls, with
           auto and num_splits=1, against SDPA (cuDNN and FLASH backends, enable_gqa) on the
           same work in (b, h, s, d).
  step     one decoding step (append one token with rotary, attend causally): back-to-back eager
           calls and graph replays against cuDNN on the same attention, and the read floor (one
           kernel that only reads the same K and V bytes: no one-launch step can beat it).
  prefill  query length 128..2k after 1k..16k cached keys: the call over the cache against
           flash_attn_func on the same q, k, v and cuDNN (full masks only: SDPA's causal mask is
           top-left aligned), TFLOP/s over visible pairs.
  host     CPU wall clock per call of back-to-back calls (no sync): what a decoding loop's host
           thread pays.
Times are triton.testing.do_bench medians; graph replays use do_bench_cudagraph.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from common import (  # noqa: E402
    Result,
    add_out_argument,
    bench,
    graphed,
    log,
    name_list,
    sdpa,
    table,
    tflops,
)

DTYPE, NHEADS, HEAD_DIM = torch.bfloat16, 32, 128
STAGES = ("gate", "decode", "step", "prefill", "host")
MAX_KV_BYTES = 8 << 30


def bench_graph(fn) -> float:
    """Median ms per replay of fn captured in a CUDA graph (no L2 flush). The inputs, made on
    the default stream, must be complete before do_bench_cudagraph's side stream reads them."""
    from triton.testing import do_bench_cudagraph

    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=20, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * 2**30 / (bench(lambda: dst.copy_(src)) * 1e-3)


def read_floor_fn(k_cache, v_cache, kv_bytes):
    """One launch reading kv_bytes of the caches (half from each): a step's bytes, nothing else."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(K, V, Partial, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        k = tl.load(K + offs, mask=offs < n, other=0.0).to(tl.float32)
        v = tl.load(V + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(Partial + tl.program_id(0), tl.sum(k + v))

    n, block = kv_bytes // 2 // k_cache.element_size(), 4096
    partial = torch.empty(triton.cdiv(n, block), dtype=torch.float32, device="cuda")
    return lambda: read_kernel[(partial.numel(),)](k_cache, v_cache, partial, n, block)


def make_cache(batch, seqlen_k, nheads_k, page_size):
    """(k_cache, v_cache, block_table or None): seqlen_k keys per sequence, pages shuffled."""
    if page_size is None:
        shape, table_ = (batch, seqlen_k, nheads_k, HEAD_DIM), None
    else:
        pages = math.ceil(seqlen_k / page_size)
        shape = (batch * pages, page_size, nheads_k, HEAD_DIM)
        table_ = torch.randperm(batch * pages, device="cuda").reshape(batch, pages).int()
    return (torch.randn(shape, dtype=DTYPE, device="cuda"),
            torch.randn(shape, dtype=DTYPE, device="cuda"), table_)


def kv_bytes_of(batch, seqlen_k, nheads_k) -> int:
    return 2 * batch * seqlen_k * nheads_k * HEAD_DIM * 2


def sdpa_fn(q, k_cache, v_cache, backend, causal=False):
    """SDPA on (b, h, sq, d) q and (b, hk, L, d) copies of a contiguous cache, or None where
    that backend refuses the inputs."""
    run = sdpa(backend)
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k_cache, v_cache))
    fn = functools.partial(run, qh, kh, vh, causal, enable_gqa=True)
    try:
        fn()
    except RuntimeError:
        return None
    return fn


def gate() -> list[str]:
    """The public call against the float64 oracle (and an append + rotary against torch)."""
    from flashkit import flash_attn_with_kvcache
    from flashkit.testing import assert_close_to_oracle

    done = []
    for page_size, causal, seqlen_q, nheads_k, num_splits in [
            (None, True, 1, 4, 0), (256, True, 1, 4, 0), (256, False, 1, 32, 1),
            (16, True, 4, 4, 7), (None, False, 3, 8, 3), (64, True, 37, 4, 0)]:
        batch, capacity = 5, 1024
        k_cache, v_cache, table_ = make_cache(batch, capacity, nheads_k, page_size)
        seqlens = torch.randint(0, capacity + 1, (batch,), device="cuda", dtype=torch.int32)
        seqlens[0] = capacity
        q = torch.randn(batch, seqlen_q, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        kw = dict(cache_seqlens=seqlens, block_table=table_, causal=causal,
                  return_softmax_lse=True)
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=num_splits, **kw)
        ref = dict(kw, num_splits=1, backend="reference")
        o64, l64 = flash_attn_with_kvcache(q.double(), k_cache.double(), v_cache.double(), **ref)
        o16, l16 = flash_attn_with_kvcache(q, k_cache, v_cache, **ref)
        name = f"page={page_size} causal={causal} sq={seqlen_q} hk={nheads_k} splits={num_splits}"
        assert_close_to_oracle(f"out [{name}]", out, o64, o16)
        assert_close_to_oracle(f"lse [{name}]", lse, l64, l16)
        done.append(name)
    k_cache, v_cache, table_ = make_cache(4, 512, 4, 256)
    q = torch.randn(4, 1, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    k_new, v_new = (torch.randn(4, 1, 4, HEAD_DIM, dtype=DTYPE, device="cuda") for _ in "kv")
    angles = torch.rand(512, HEAD_DIM // 2, device="cuda") * 6.28
    seqlens = torch.tensor([0, 100, 300, 511], dtype=torch.int32, device="cuda")
    got = []
    for backend in ("triton", "torch"):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, angles.cos().to(DTYPE),
                                      angles.sin().to(DTYPE), seqlens, block_table=table_,
                                      causal=True, backend=backend)
        got.append((out, kc, vc))
    (o_t, kc_t, vc_t), (o_r, kc_r, vc_r) = got
    # v is copied bit for bit; k is rotated in float32 by both (fused multiply-adds possible)
    assert torch.equal(vc_t, vc_r), "append of v differs"
    torch.testing.assert_close(kc_t, kc_r)
    torch.testing.assert_close(o_t, o_r, atol=2e-2, rtol=2e-2)
    done.append("append+rotary paged256 triton == torch")
    return done


def decode_cells(quick):
    batches, lengths = ([1, 8, 64], [1024, 32768]) if quick else \
        ([1, 4, 16, 64], [1024, 4096, 16384, 65536, 131072])
    for nheads_k in (4, 32):
        for batch in batches:
            for seqlen_k in lengths:
                if kv_bytes_of(batch, seqlen_k, nheads_k) <= MAX_KV_BYTES:
                    for page_size in (None, 256):
                        yield batch, seqlen_k, nheads_k, page_size
    yield 8, 32768, 4, 16


def decode_row(batch, seqlen_k, nheads_k, page_size, copy_bw, fa2) -> dict:
    from flashkit import flash_attn_with_kvcache

    k_cache, v_cache, table_ = make_cache(batch, seqlen_k, nheads_k, page_size)
    q = torch.randn(batch, 1, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
    kv_bytes = kv_bytes_of(batch, seqlen_k, nheads_k)
    row = dict(batch=batch, seqlen_k=seqlen_k, nheads_k=nheads_k, page_size=page_size,
               kv_bytes=kv_bytes)

    def put(label, fn, modes):
        for mode in modes:
            ms = None if fn is None else (bench_graph if mode == "graph" else bench)(fn)
            row[f"{label}_{mode}_ms"] = ms
            row[f"{label}_{mode}_pct_copy"] = ms and 100 * kv_bytes / (ms * 1e-3) / copy_bw

    call = functools.partial(flash_attn_with_kvcache, q, k_cache, v_cache, cache_seqlens=seqlens,
                             block_table=table_)
    put("auto", call, ("graph", "eager"))
    put("splits1", functools.partial(call, num_splits=1), ("graph",))
    if page_size is None:
        put("cudnn", sdpa_fn(q, k_cache, v_cache, "cudnn"), ("graph", "eager"))
        if fa2:
            put("fa2", sdpa_fn(q, k_cache, v_cache, "flash"), ("graph",))
    return row


def host_ms(call, calls: int = 200, drain: bool = False) -> float:
    """CPU wall-clock ms per call of back-to-back calls (no sync inside the loop, the GPU drained
    before); drain: the clock stops after the GPU drained too (the larger of host and GPU)."""
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    if drain:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e3 * elapsed / calls


def decoding_step(batch, seqlen_k, nheads_k, page_size):
    """(step, q, k_cache, v_cache): append one token with rotary at cache_seqlens = L - 1 and
    attend causally over L keys."""
    from flashkit import flash_attn_with_kvcache

    k_cache, v_cache, table_ = make_cache(batch, seqlen_k, nheads_k, page_size)
    q = torch.randn(batch, 1, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    k_new, v_new = (torch.randn(batch, 1, nheads_k, HEAD_DIM, dtype=DTYPE, device="cuda")
                    for _ in "kv")
    angles = torch.rand(seqlen_k, HEAD_DIM // 2, device="cuda")
    seqlens = torch.full((batch,), seqlen_k - 1, dtype=torch.int32, device="cuda")
    step = functools.partial(flash_attn_with_kvcache, q, k_cache, v_cache, k_new, v_new,
                             angles.cos().to(DTYPE), angles.sin().to(DTYPE), seqlens,
                             block_table=table_, causal=True)
    return step, q, k_cache, v_cache


STEP_CELLS = [(b, L, hk, page) for hk in (4, 32) for b in (1, 4) for L in (1024, 4096, 16384)
              for page in (None, 256)]


def step_row(batch, seqlen_k, nheads_k, page_size, copy_bw) -> dict:
    step, q, k_cache, v_cache = decoding_step(batch, seqlen_k, nheads_k, page_size)
    kv_bytes = kv_bytes_of(batch, seqlen_k, nheads_k)
    row = dict(batch=batch, seqlen_k=seqlen_k, nheads_k=nheads_k, page_size=page_size,
               kv_bytes=kv_bytes, eager_loop_ms=host_ms(step, 300, drain=True),
               graph_loop_ms=host_ms(graphed(step, warmups=1), 300, drain=True),
               graph_gpu_ms=bench_graph(step),
               read_floor_gpu_ms=bench_graph(read_floor_fn(k_cache, v_cache, kv_bytes)))
    if page_size is None:
        fn = sdpa_fn(q, k_cache, v_cache, "cudnn")
        if fn is not None:
            row.update(cudnn_eager_loop_ms=host_ms(fn, 300, drain=True),
                       cudnn_graph_loop_ms=host_ms(graphed(fn, warmups=1), 300, drain=True),
                       cudnn_graph_gpu_ms=bench_graph(fn))
    for key in [k for k in row if k.endswith("_ms")]:
        row[key.replace("_ms", "_pct_copy")] = 100 * kv_bytes / (row[key] * 1e-3) / copy_bw
    return row


def prefill_row(batch, seqlen_q, cached, nheads_k, causal) -> dict:
    from flashkit import flash_attn_func, flash_attn_with_kvcache

    seqlen_k = cached + seqlen_q
    k_cache, v_cache, _ = make_cache(batch, seqlen_k, nheads_k, None)
    q = torch.randn(batch, seqlen_q, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
    visible = seqlen_q * cached + (seqlen_q * (seqlen_q + 1) / 2 if causal else seqlen_q ** 2)
    flop = 4 * batch * NHEADS * visible * HEAD_DIM
    row = dict(batch=batch, seqlen_q=seqlen_q, cached=cached, nheads_k=nheads_k, causal=causal,
               kvcache_ms=bench(lambda: flash_attn_with_kvcache(
                   q, k_cache, v_cache, cache_seqlens=seqlens, causal=causal)),
               dense_ms=bench(lambda: flash_attn_func(q, k_cache, v_cache, causal=causal)))
    if not causal:
        fn = sdpa_fn(q, k_cache, v_cache, "cudnn")
        row["cudnn_ms"] = fn and bench(fn)
    for key in [k for k in row if k.endswith("_ms") and row[k]]:
        row[key.replace("_ms", "_tflops")] = tflops(flop, row[key])
    row["kvcache_over_dense"] = row["dense_ms"] / row["kvcache_ms"]
    return row


def prefill_cells(quick):
    queries, cached = ([128, 2048], [4096]) if quick else ([128, 512, 2048], [1024, 4096, 16384])
    cells = [(1, sq, c, 4, causal) for sq in queries for c in cached for causal in (True, False)]
    return cells + [(1, sq, 4096, 32, True) for sq in queries] + [(4, 512, 4096, 4, True)]


HOST_CASES = [(1, 1024, 4, None, False), (1, 1024, 4, None, True), (8, 4096, 4, 256, True)]


def host_row(batch, seqlen_k, nheads_k, page_size, rotary) -> dict:
    step, *_ = decoding_step(batch, seqlen_k, nheads_k, page_size)
    if not rotary:
        step = functools.partial(step.func, *step.args[:5], None, None, *step.args[7:],
                                 **step.keywords)
    return dict(batch=batch, seqlen_k=seqlen_k, nheads_k=nheads_k, page_size=page_size,
                rotary=rotary, host_us=1e3 * host_ms(step), eager_ms=bench(step))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--quick", action="store_true", help="fewer cells (a smoke run)")
    ap.add_argument("--no-fa2", action="store_true", help="skip SDPA's FLASH backend")
    ap.add_argument("--tag", default="")
    add_out_argument(ap, "decode")
    args = ap.parse_args(argv)
    stages = name_list(ap, "--stages", args.stages, STAGES)
    torch.manual_seed(0)
    result = Result("decode", args.out, args.tag,
                    dict(dtype="bfloat16", nheads=NHEADS, head_dim=HEAD_DIM, quick=args.quick,
                         stages=stages))
    log(str(result.data["env"]))
    if "gate" in stages:
        result.save("gate", gate())
        log(f"gate passed: {result.data['gate']}")
    copy_bw = copy_bandwidth()
    result.save("copy_bandwidth_bytes_per_s", copy_bw)
    log(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    md = [f"Copy bandwidth {copy_bw / 1e12:.2f} TB/s.\n"]
    plans = {
        "decode": (lambda: decode_cells(args.quick),
                   lambda c: decode_row(*c, copy_bw, not args.no_fa2),
                   "q length 1: % of the copy bandwidth (graph replays; eager for auto/cudnn)",
                   ["batch", "seqlen_k", "nheads_k", "page_size", "auto_graph_pct_copy",
                    "splits1_graph_pct_copy", "cudnn_graph_pct_copy", "fa2_graph_pct_copy",
                    "auto_eager_pct_copy", "cudnn_eager_pct_copy"]),
        "step": (lambda: STEP_CELLS[::3] if args.quick else STEP_CELLS,
                 lambda c: step_row(*c, copy_bw),
                 "decoding step (append + rotary + attention): ms per step",
                 ["batch", "seqlen_k", "nheads_k", "page_size", "eager_loop_ms", "graph_loop_ms",
                  "graph_gpu_ms", "read_floor_gpu_ms", "cudnn_eager_loop_ms",
                  "cudnn_graph_gpu_ms"]),
        "prefill": (lambda: prefill_cells(args.quick), lambda c: prefill_row(*c),
                    "prefill over a cache: TFLOP/s",
                    ["batch", "seqlen_q", "cached", "nheads_k", "causal", "kvcache_tflops",
                     "dense_tflops", "cudnn_tflops", "kvcache_over_dense"]),
        "host": (lambda: HOST_CASES, lambda c: host_row(*c), "host time per call",
                 ["batch", "seqlen_k", "nheads_k", "page_size", "rotary", "host_us",
                  "eager_ms"]),
    }
    for stage in stages:
        if stage not in plans:
            continue
        cells, measure, title, columns = plans[stage]
        rows = []
        for c in cells():
            rows.append(measure(c))
            log(f"{stage} {rows[-1]}")
            result.save(stage, rows)
            torch.cuda.empty_cache()
        md.append(f"### {stage}: {title}\n\n" + table(rows, columns))
        result.markdown("\n".join(md))
    log(f"wrote {result.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
