"""Decode and prefill speed of the Triton KV-cache kernels (flashkit.ops.triton.decode).

    PYTHONPATH=src python3 benchmarks/bench_decode.py --out DIR [--quick] [--no-fa2]
        [--stages api,profile,study,paging,prefill,graph,splits,decode,sweep]
        [--before OLD_KVCACHE_PY]

First a correctness gate on the GPU (poisoned outputs, bf16 against the float64 oracle by the
DESIGN section 5 rule, contiguous and paged, splits 1 and auto, with an append and rotary through
the public API); the run stops if it fails. Then, bf16, d128, 32 query heads:
  studies  (stage study; they set the settings the rest of the run uses, reported in the
           JSON's "chosen"): split counts at small batches (what auto_num_splits picks for 1, 2
           and 3 programs per SM, plus a curve at two shapes), the merge kernel alone, the merge
           with and without programmatic dependent launch (PDL, also checked under graph
           replay), and candidate prefill tiles against the dense forward kernel.
  decode   q length 1, batch 1..64, cache 1k..128k, GQA 8:1 (4 kv heads) and 1:1 (32),
           contiguous and paged (page 256; page 16 at one size): achieved bandwidth = bytes of K
           and V read / time, as % of the device-to-device copy bandwidth measured in the same run
           (bytes read + written / time); the kernel with auto splits, with num_splits=1, and
           PyTorch SDPA (cuDNN and FLASH backends, enable_gqa) on the same work in (b, h, s, d).
  prefill  query length 128..2k after 1k..16k cached keys, causal and full (batch 1, and batch 4
           at 512 x 4k): the decode kernel (contiguous and page 256) and the Gluon prefill route
           (ops.triton.prefill: the cache as varlen keys with seqused_k) against the dense
           forward kernel (Gluon on sm_90) on the same q, k, v and cuDNN SDPA (full only), in
           TFLOP/s over visible pairs; the public call with the route forced on and off (tensor
           cache_seqlens) and as configured (int cache_seqlens), to set its thresholds.
  graph    the public call as a decoding step (append + rotary + attention) captured in a CUDA
           graph and replayed back to back, against eager calls, cuDNN SDPA (b1/b4, 1k..16k)
           and the read floor (one kernel that only reads the same K and V bytes, replayed).
  splits   (stage splits) the graph step at forced split counts on the short-context cells,
           and with one more pipeline stage: how the step time depends on the key tiles per
           program (it sets nothing).
  sweep    (stage sweep) candidate decode tiles at three shapes, to choose decode.HOPPER.
  paging   (stage paging) page-256 decode with the block-table entry read per key row or per
           key tile, and the paged extra stages; sets decode.PAGE_TILE_LOOKUP and the stages.
  api      the public function per call: host time (CPU wall clock of back-to-back calls, no
           sync inside) and eager time (stage profile: cProfile of the call), with an append
           (and rotary) into a paged or contiguous cache; with --before, the same for the
           kvcache.py at that path (the previous version, loaded as a module), in the same run.
Kernel times are the launchers (flashkit.ops.triton.decode.forward) on validated inputs.
Times are triton.testing.do_bench medians ("graph": CUDA-graph replays, the GPU time alone;
"eager": one launch per call, L2 flushed between calls). Results: DIR/decode_<date>.json with
date, device, versions and config, rewritten after every stage.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.util
import itertools
import json
import math
import os
import platform
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench, do_bench_cudagraph

import flashkit
from flashkit.kvcache import flash_attn_with_kvcache
from flashkit.ops.params import AttentionParams
from flashkit.ops.triton import append, decode, dispatch, prefill
from flashkit.ops.triton.forward import attention_forward
from flashkit.testing import assert_close_to_oracle, poison

NHEADS, HEAD_DIM, DTYPE = 32, 128, torch.bfloat16
MAX_KV_BYTES = 24 * 2**30  # skip cache sizes whose K + V exceed this


def environment() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "flashkit": flashkit.__version__,
    }


def bench(fn) -> float:
    """Median ms of eager calls, L2 flushed between them: host launch overhead counts wherever
    it exceeds the GPU time (small problems)."""
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def bench_rotating(calls: dict, rounds: int) -> dict:
    """name -> [ms per round] of bench() over calls {name: fn}, each timed once per round in an
    order rotated by one each round: the GPU's clock drifts within a cell, and a fixed order
    made whatever ran later look up to 17% slower (decode_NOTES.md, session 8)."""
    names, times = list(calls), {name: [] for name in calls}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(bench(calls[name]))
    return times


def bench_graph(fn) -> float:
    """Median ms per call replayed from a CUDA graph: the GPU time alone, as a decoding loop
    under graphs sees it. No L2 flush: a problem smaller than L2 (60 MB) reads from it.
    do_bench_cudagraph runs fn on a side stream: the inputs, made on the default stream, must be
    complete first (a 2026-11-21 run read unwritten cache_seqlens and faulted)."""
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=20, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * 2**30 / (ms * 1e-3)


@triton.jit
def _read_kernel(K, V, Partial, n, BLOCK: tl.constexpr):
    """Reads K[:n] and V[:n] (BLOCK elements of each per program) and writes one float per
    program: what one kernel must at least do to read a decode step's K and V bytes."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    k = tl.load(K + offs, mask=offs < n, other=0.0).to(tl.float32)
    v = tl.load(V + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(Partial + pid, tl.sum(k + v))


READ_BLOCK = 4096  # elements of K and of V per program of the read floor


def read_floor_fn(k_cache, v_cache, kv_bytes):
    """One launch reading kv_bytes of the caches (half from each, the first elements of their
    storage: the same bytes as the step's keys and values, contiguous or paged)."""
    n = kv_bytes // 2 // k_cache.element_size()
    partial = torch.empty(triton.cdiv(n, READ_BLOCK), dtype=torch.float32, device="cuda")
    return lambda: _read_kernel[(partial.numel(),)](k_cache, v_cache, partial, n, READ_BLOCK)


def make_cache(batch, seqlen_k, nheads_k, page_size):
    """(k_cache, v_cache, block_table or None): seqlen_k keys per sequence, pages shuffled."""
    if page_size is None:
        shape = (batch, seqlen_k, nheads_k, HEAD_DIM)
        table = None
    else:
        pages = math.ceil(seqlen_k / page_size)
        shape = (batch * pages, page_size, nheads_k, HEAD_DIM)
        table = torch.randperm(batch * pages, device="cuda").reshape(batch, pages).int()
    return (torch.randn(shape, dtype=DTYPE, device="cuda"),
            torch.randn(shape, dtype=DTYPE, device="cuda"), table)


def kernel_fn(q, k_cache, v_cache, table, seqlen_k, params, num_splits):
    """The decode launcher on validated inputs, every sequence holding seqlen_k keys."""
    batch = q.shape[0]
    seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
    rows = torch.arange(batch, dtype=torch.int32, device="cuda")
    leftpad = torch.zeros_like(rows)  # made here: an op in the lambda would be timed with it
    return lambda: decode.forward(q, k_cache, v_cache, seqlens, rows, leftpad, table, params,
                                  num_splits, max_seqlen_k=seqlen_k)


def kernel_ms(q, k_cache, v_cache, table, seqlen_k, params, num_splits) -> float:
    return bench(kernel_fn(q, k_cache, v_cache, table, seqlen_k, params, num_splits))


# --- correctness gate ---------------------------------------------------------------------------

def check() -> list[str]:
    """Poisoned outputs against the float64 oracle; returns the cases checked."""
    done = []
    for page_size, causal, seqlen_q, nheads_k, num_splits in [
            (None, True, 1, 4, 0), (256, True, 1, 4, 0), (256, False, 1, 32, 1),
            (16, True, 4, 4, 7), (None, False, 3, 8, 3), (64, True, 37, 4, 0)]:
        batch, capacity = 5, 1024
        k_cache, v_cache, table = make_cache(batch, capacity, nheads_k, page_size)
        seqlens = torch.randint(0, capacity + 1, (batch,), device="cuda", dtype=torch.int32)
        seqlens[0] = capacity
        q = torch.randn(batch, seqlen_q, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        params = AttentionParams(HEAD_DIM ** -0.5, None, 0 if causal else None)
        out = poison(torch.empty_like(q))
        lse = poison(torch.empty(batch, NHEADS, seqlen_q, device="cuda"))
        rows, leftpad = torch.arange(batch, dtype=torch.int32, device="cuda"), seqlens * 0
        decode.forward(q, k_cache, v_cache, seqlens, rows, leftpad, table, params, num_splits,
                       out=out, lse=lse)
        kw = dict(cache_seqlens=seqlens, block_table=table, causal=causal, num_splits=1,
                  return_softmax_lse=True, backend="reference")
        if table is None:
            kw["cache_batch_idx"] = rows
        o64, l64 = flash_attn_with_kvcache(q.double(), k_cache.double(), v_cache.double(), **kw)
        o16, l16 = flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
        name = f"page={page_size} causal={causal} sq={seqlen_q} hk={nheads_k} splits={num_splits}"
        assert_close_to_oracle(f"out [{name}]", out, o64, o16)
        assert_close_to_oracle(f"lse [{name}]", lse, l64, l16)
        done.append(name)
    # The public path: append + rotary, triton against the torch backend on clones of a cache.
    k_cache, v_cache, table = make_cache(4, 512, 4, 256)
    q = torch.randn(4, 1, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    k_new, v_new = (torch.randn(4, 1, 4, HEAD_DIM, dtype=DTYPE, device="cuda") for _ in "kv")
    angles = torch.rand(512, HEAD_DIM // 2, device="cuda") * 6.28
    seqlens = torch.tensor([0, 100, 300, 511], dtype=torch.int32, device="cuda")
    results = []
    for backend in ("triton", "torch"):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, angles.cos().to(DTYPE),
                                      angles.sin().to(DTYPE), seqlens, block_table=table,
                                      causal=True, backend=backend)
        results.append((out, kc, vc))
    (o_t, kc_t, vc_t), (o_r, kc_r, vc_r) = results
    # v is copied bit for bit; k is rotated in float32 by both, the Triton kernel possibly with
    # fused multiply-adds: within one bf16 rounding.
    assert torch.equal(vc_t, vc_r), "append of v differs"
    torch.testing.assert_close(kc_t, kc_r)
    torch.testing.assert_close(o_t, o_r, atol=2e-2, rtol=2e-2)
    done.append("api append+rotary paged256 triton == torch")
    return done


# --- decode -------------------------------------------------------------------------------------

def sdpa_fn(q, k_cache, v_cache, backend_name):
    """SDPA on (b, h, 1, d) q and (b, hk, L, d) copies of a contiguous cache, or None where that
    backend refuses the inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    qh, kh, vh = q.transpose(1, 2), k_cache.transpose(1, 2).contiguous(), \
        v_cache.transpose(1, 2).contiguous()

    def fn():
        with sdpa_kernel([getattr(SDPBackend, backend_name)]):
            return sdpa(qh, kh, vh, enable_gqa=True)
    try:
        fn()
    except RuntimeError:
        return None
    return fn


def decode_grid(quick: bool):
    batches, lengths = ([1, 8, 64], [1024, 32768]) if quick else \
        ([1, 4, 16, 64], [1024, 4096, 16384, 65536, 131072])
    for nheads_k in (4, 32):
        for batch in batches:
            for seqlen_k in lengths:
                if kv_bytes_of(batch, seqlen_k, nheads_k) > MAX_KV_BYTES:
                    continue
                for page_size in (None, 256):
                    yield batch, seqlen_k, nheads_k, page_size
    yield 8, 32768, 4, 16


def kv_bytes_of(batch, seqlen_k, nheads_k) -> int:
    return 2 * batch * seqlen_k * nheads_k * HEAD_DIM * 2


def auto_splits(batch, seqlen_k, nheads_k, page_size) -> int:
    """What num_splits=0 picks for q length 1 (one packed row block per kv head)."""
    q = torch.empty(batch, 1, NHEADS, HEAD_DIM, device="cuda")
    return decode.launch_shape(q, nheads_k, page_size or 0, 0, seqlen_k)[3]


def run_decode(copy_bw: float, quick: bool, fa2: bool) -> list[dict]:
    rows = []
    params = AttentionParams(HEAD_DIM ** -0.5)
    for batch, seqlen_k, nheads_k, page_size in decode_grid(quick):
        rows.append(decode_row(batch, seqlen_k, nheads_k, page_size, params, copy_bw, fa2))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def decode_row(batch, seqlen_k, nheads_k, page_size, params, copy_bw, fa2=True) -> dict:
    k_cache, v_cache, table = make_cache(batch, seqlen_k, nheads_k, page_size)
    q = torch.randn(batch, 1, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    kv_bytes = kv_bytes_of(batch, seqlen_k, nheads_k)
    row = {"batch": batch, "seqlen_k": seqlen_k, "nheads": NHEADS, "nheads_k": nheads_k,
           "page_size": page_size, "kv_bytes": kv_bytes,
           "auto_splits": auto_splits(batch, seqlen_k, nheads_k, page_size),
           "l2_resident": kv_bytes < 60e6}

    def put(label, fn, eager):
        for mode in ("graph", "eager") if eager else ("graph",):
            ms = None if fn is None else (bench_graph if mode == "graph" else bench)(fn)
            row[f"{label}_{mode}_ms"] = ms
            if ms is not None:
                row[f"{label}_{mode}_pct_copy"] = 100 * kv_bytes / (ms * 1e-3) / copy_bw

    put("auto", kernel_fn(q, k_cache, v_cache, table, seqlen_k, params, 0), eager=True)
    put("splits1", kernel_fn(q, k_cache, v_cache, table, seqlen_k, params, 1), eager=False)
    if page_size is None:
        put("sdpa_cudnn", sdpa_fn(q, k_cache, v_cache, "CUDNN_ATTENTION"), eager=False)
        if fa2:
            put("sdpa_flash", sdpa_fn(q, k_cache, v_cache, "FLASH_ATTENTION"), eager=False)
    return row


# --- studies: split counts, the merge, PDL, prefill tiles ---------------------------------------

SPLIT_SHAPES = [  # (batch, seqlen_k, nheads_k, page_size): where splitting decides the speed
    (1, 4096, 4, None), (1, 16384, 4, None), (1, 65536, 4, None), (1, 131072, 4, None),
    (4, 16384, 4, None), (4, 65536, 4, None), (16, 16384, 4, None), (1, 16384, 32, None),
    (1, 65536, 32, None), (4, 4096, 32, None), (1, 65536, 4, 256), (8, 32768, 4, 16),
    (1, 1024, 4, None), (1, 1024, 32, None), (8, 16384, 4, None), (16, 65536, 4, None)]
SPLIT_CURVES = {(1, 4096, 4, None): [1, 4, 8, 16, 32, 64],
                (1, 65536, 4, None): [16, 33, 44, 57, 66, 86, 99, 128],
                (4, 16384, 4, None): [4, 8, 11, 14, 16, 22, 26, 32]}


def set_decode_tile(**changes) -> None:
    decode.HOPPER["decode"] = decode.HOPPER["decode"]._replace(**changes)


def study_splits(copy_bw: float) -> dict:
    """Graph-replay times at the split counts that 1, 2 and 3 programs per SM make auto pick (and
    along SPLIT_CURVES), the merge kernel alone, and the merge without PDL. Chooses per_sm and
    LAUNCH_PDL by the geometric mean over SPLIT_SHAPES."""
    params = AttentionParams(HEAD_DIM ** -0.5)
    default_per_sm, rows = decode.HOPPER["decode"].per_sm, []
    log_ms = {per_sm: 0.0 for per_sm in (1, 2, 3)}
    log_pdl = {True: 0.0, False: 0.0}
    pdl_on = decode.LAUNCH_PDL  # else pdl_check turned it off
    for shape in SPLIT_SHAPES:
        batch, seqlen_k, nheads_k, page_size = shape
        k_cache, v_cache, table = make_cache(batch, seqlen_k, nheads_k, page_size)
        q = torch.randn(batch, 1, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        kv_bytes = kv_bytes_of(batch, seqlen_k, nheads_k)
        choice = {}
        for per_sm in log_ms:
            set_decode_tile(per_sm=per_sm)
            choice[per_sm] = auto_splits(batch, seqlen_k, nheads_k, page_size)
        set_decode_tile(per_sm=default_per_sm)
        times = {}
        for splits in sorted(set(choice.values()) | set(SPLIT_CURVES.get(shape, []))):
            times[splits] = bench_graph(kernel_fn(q, k_cache, v_cache, table, seqlen_k, params,
                                                  splits))
        for per_sm, splits in choice.items():
            log_ms[per_sm] += math.log(times[splits])
        splits = choice[default_per_sm]
        row = {"batch": batch, "seqlen_k": seqlen_k, "nheads_k": nheads_k,
               "page_size": page_size, "choice_by_per_sm": choice, "graph_ms": times,
               "pct_copy": {s: 100 * kv_bytes / (ms * 1e-3) / copy_bw
                            for s, ms in times.items()}}
        if splits > 1:
            row["merge_alone_ms"] = bench_graph(merge_fn(batch, splits))
        if splits > 1 and pdl_on:
            decode.LAUNCH_PDL = False
            row["no_pdl_ms"] = bench_graph(kernel_fn(q, k_cache, v_cache, table, seqlen_k,
                                                     params, splits))
            decode.LAUNCH_PDL = True
            log_pdl[True] += math.log(times[splits])
            log_pdl[False] += math.log(row["no_pdl_ms"])
        rows.append(row)
        print("splits", json.dumps(row), flush=True)
        del k_cache, v_cache
        torch.cuda.empty_cache()
    geomean_ms = {k: math.exp(v / len(SPLIT_SHAPES)) for k, v in log_ms.items()}
    best = pick(geomean_ms, default_per_sm)
    set_decode_tile(per_sm=best)
    pdl_shapes = sum("no_pdl_ms" in row for row in rows)
    geomean_pdl = {k: math.exp(v / max(1, pdl_shapes)) for k, v in log_pdl.items()}
    decode.LAUNCH_PDL = pdl_on and pick(geomean_pdl, True)
    return {"rows": rows, "geomean_ms_by_per_sm": geomean_ms, "chosen_per_sm": best,
            "geomean_ms_by_pdl": geomean_pdl, "chosen_pdl": decode.LAUNCH_PDL}


def pick(cost: dict, default):
    """The key of least cost, unless the default's cost is within 2% of it (noise)."""
    best = min(cost, key=cost.get)
    return default if default in cost and cost[default] <= 1.02 * cost[best] else best


def merge_fn(batch, splits):
    """The merge kernel alone on random partials of a q-length-1 decode."""
    out_part = torch.randn(splits, batch, 1, NHEADS, HEAD_DIM, device="cuda")
    lse_part = torch.randn(splits, batch, NHEADS, 1, device="cuda")
    out = torch.empty(batch, 1, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    lse = torch.empty(batch, NHEADS, 1, device="cuda")
    return lambda: decode.merge(out_part, lse_part, out, lse)


def pdl_check() -> dict:
    """The PDL launch pair gives the eager result when replayed from a CUDA graph; PDL is
    switched off for the rest of the run if it fails or differs."""
    try:
        equal = pdl_replay_equal(AttentionParams(HEAD_DIM ** -0.5))
        error = None
    except Exception as e:  # noqa: BLE001 - any launch or capture failure turns PDL off
        equal, error = False, f"{type(e).__name__}: {e}"
    decode.LAUNCH_PDL = decode.LAUNCH_PDL and equal
    return {"graph_replay_equal": equal, "error": error, "launch_pdl": decode.LAUNCH_PDL}


def pdl_replay_equal(params) -> bool:
    k_cache, v_cache, table = make_cache(2, 8192, 4, 256)
    q = torch.randn(2, 1, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    fn = kernel_fn(q, k_cache, v_cache, table, 8192, params, 24)
    expected = fn()[0].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = fn()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(out, expected))


PREFILL_TILES = [(128, 128, 8, 3, 1, 1), (128, 64, 8, 3, 1, 1), (128, 64, 8, 4, 1, 1),
                 (64, 64, 4, 3, 2, 3)]  # decode.Tile fields


def study_prefill() -> dict:
    """Candidate prefill tiles on four prefill shapes (eager, as the prefill table); chooses the
    one with the least total time."""
    default, rows, total = decode.HOPPER["prefill"], [], {}
    for tile in PREFILL_TILES:
        decode.HOPPER["prefill"] = decode.Tile(*tile)
        for seqlen_q in (512, 2048):
            for nheads_k in (4, 32):
                times = prefill_ms(seqlen_q, 4096 + seqlen_q, nheads_k)
                t_kv, t_dense = times["kvcache_ms"], times["dense_ms"]
                rows.append({"tile": tile, "seqlen_q": seqlen_q, "nheads_k": nheads_k,
                             "kvcache_ms": t_kv, "dense_ms": t_dense})
                total[tile] = total.get(tile, 0.0) + t_kv
                print("prefill tile", json.dumps(rows[-1]), flush=True)
    best = pick(total, tuple(default))
    decode.HOPPER["prefill"] = decode.Tile(*best)
    return {"rows": rows, "total_ms": {str(k): v for k, v in total.items()},
            "chosen": best}


API_CASES = [  # (batch, cached keys, kv heads, page size or None, rotary)
    (8, 8192, 4, 256, True), (1, 4096, 4, None, False), (64, 4096, 32, 16, True)]


def run_api(before_path: str | None) -> list[dict]:
    """The public call appending one token (with rotary or not) and attending: host time per
    call and eager time, this version (default device-side checks, and sync_checks=True) and the
    one at before_path."""
    versions = {"now": flash_attn_with_kvcache,
                "now_sync_checks": functools.partial(flash_attn_with_kvcache, sync_checks=True)}
    if before_path:
        spec = importlib.util.spec_from_file_location("kvcache_before", before_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        versions["before"] = module.flash_attn_with_kvcache
    rows = []
    for batch, seqlen_k, nheads_k, page_size, rotary in API_CASES:
        k_cache, v_cache, table = make_cache(batch, seqlen_k + 256, nheads_k, page_size)
        q = torch.randn(batch, 1, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        k_new, v_new = (torch.randn(batch, 1, nheads_k, HEAD_DIM, dtype=DTYPE, device="cuda")
                        for _ in "kv")
        angles = torch.rand(seqlen_k + 256, HEAD_DIM // 2, device="cuda")
        cos, sin = (angles.cos().to(DTYPE), angles.sin().to(DTYPE)) if rotary else (None, None)
        seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
        row = {"batch": batch, "seqlen_k": seqlen_k, "nheads_k": nheads_k,
               "page_size": page_size, "rotary": rotary}
        for name, fn in versions.items():
            call = functools.partial(fn, q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens,
                                     block_table=table, causal=True)
            row[f"{name}_host_ms"] = host_ms(call)
            row[f"{name}_eager_ms"] = bench(call)
        kernel = kernel_fn(q, k_cache, v_cache, table, seqlen_k, AttentionParams(
            HEAD_DIM ** -0.5, None, 0), 0)
        row["decode_kernels_graph_ms"] = bench_graph(kernel)
        row["decode_launcher_host_ms"] = host_ms(kernel)  # decode.forward alone
        row["append_launcher_host_ms"] = host_ms(functools.partial(
            append.append, q, k_cache, v_cache, k_new, v_new, cos, sin, seqlens, None, None,
            table, 1, True))
        rows.append(row)
        print("api", json.dumps(row), flush=True)
    return rows


def launch_study() -> dict:
    """Host ms per launch of the merge kernel (23 arguments) through Triton's JIT entry (the
    binder specialises every argument and looks the kernel up) and through the compiled kernel
    it returned (no binder), on the same arguments: what a launch cache would save."""
    splits, batch = 8, 4
    out_part = torch.randn(splits, batch, 1, NHEADS, HEAD_DIM, device="cuda")
    lse_part = torch.randn(splits, batch, NHEADS, 1, device="cuda")
    out = torch.empty(batch, 1, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    lse = torch.empty(batch, NHEADS, 1, device="cuda")
    grid = (batch * NHEADS, HEAD_DIM // decode.MERGE_BLOCK_DV, 1)  # the runner takes 3-D
    args = (out_part, lse_part, out, lse, *out_part.stride(), *lse_part.stride(),
            *out.stride(), *lse.stride(), NHEADS, 1, splits)
    consts = dict(HEAD_DIM_V=HEAD_DIM, BLOCK_S=splits, BLOCK_DV=decode.MERGE_BLOCK_DV,
                  USE_PDL=False)
    compiled = decode._merge_kernel[grid](*args, **consts, num_warps=4)
    runner = compiled[grid]
    return {"jit_launch_host_ms": host_ms(
                lambda: decode._merge_kernel[grid](*args, **consts, num_warps=4), 1000),
            "compiled_launch_host_ms": host_ms(
                lambda: runner(*args, *consts.values()), 1000),
            "torch_empty_host_ms": host_ms(
                lambda: torch.empty(batch, dtype=torch.int32, device="cuda"), 1000),
            "assert_async_host_ms": host_ms(
                lambda: torch._assert_async(torch.ones(1, device="cuda")), 1000)}


def profile_api() -> str:
    """cProfile of 200 public calls (API_CASES[0]): where the host time goes."""
    import cProfile
    import io
    import pstats

    batch, seqlen_k, nheads_k, page_size, _ = API_CASES[0]
    k_cache, v_cache, table = make_cache(batch, seqlen_k + 256, nheads_k, page_size)
    q = torch.randn(batch, 1, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    k_new, v_new = (torch.randn(batch, 1, nheads_k, HEAD_DIM, dtype=DTYPE, device="cuda")
                    for _ in "kv")
    angles = torch.rand(seqlen_k + 256, HEAD_DIM // 2, device="cuda")
    seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
    call = functools.partial(flash_attn_with_kvcache, q, k_cache, v_cache, k_new, v_new,
                             angles.cos().to(DTYPE), angles.sin().to(DTYPE), seqlens,
                             block_table=table, causal=True)
    host_ms(call)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(200):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def host_ms(call, calls: int = 200, drain: bool = False) -> float:
    """CPU wall-clock ms per call of `calls` back-to-back calls (no sync inside the loop, the
    GPU drained before): what a decoding loop's host thread pays per call. The appends of
    the timed calls land on the same slots each time (cache_seqlens is fixed). drain: the
    clock stops after the GPU drained too, i.e. the larger of host and GPU time per step."""
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


# --- paging study -------------------------------------------------------------------------------

PAGING_SHAPES = [(1, 4096, 4), (4, 4096, 4), (16, 1024, 4), (1, 65536, 4), (4, 16384, 4),
                 (16, 1024, 32), (64, 1024, 32), (1, 16384, 32)]
PAGING_VARIANTS = [(False, 2), (True, 2), (True, 0), (True, 1)]  # (per tile, extra stages)


def study_paging(copy_bw: float) -> dict:
    """Page-256 decode (graph replays, auto splits) per variant of the block-table lookup; the
    variant of least geometric-mean time is kept for the rest of the run (the default unless
    another is more than 2% faster)."""
    params, rows = AttentionParams(HEAD_DIM ** -0.5), []
    log_ms = dict.fromkeys(PAGING_VARIANTS, 0.0)
    for batch, seqlen_k, nheads_k in PAGING_SHAPES:
        k_cache, v_cache, table = make_cache(batch, seqlen_k, nheads_k, 256)
        q = torch.randn(batch, 1, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        row = {"batch": batch, "seqlen_k": seqlen_k, "nheads_k": nheads_k, "pct_copy": {}}
        for per_tile, extra in PAGING_VARIANTS:
            decode.PAGE_TILE_LOOKUP, decode.PAGE_TILE_EXTRA_STAGES = per_tile, extra
            ms = bench_graph(kernel_fn(q, k_cache, v_cache, table, seqlen_k, params, 0))
            log_ms[(per_tile, extra)] += math.log(ms)
            row["pct_copy"][f"per_tile={per_tile},extra={extra}"] = \
                100 * kv_bytes_of(batch, seqlen_k, nheads_k) / (ms * 1e-3) / copy_bw
        rows.append(row)
        print("paging", json.dumps(row), flush=True)
    geomean = {k: math.exp(v / len(PAGING_SHAPES)) for k, v in log_ms.items()}
    decode.PAGE_TILE_LOOKUP, decode.PAGE_TILE_EXTRA_STAGES = pick(geomean, (False, 2))
    return {"rows": rows, "geomean_ms": {str(k): v for k, v in geomean.items()},
            "chosen": {"page_tile_lookup": decode.PAGE_TILE_LOOKUP,
                       "page_tile_extra_stages": decode.PAGE_TILE_EXTRA_STAGES}}


# --- prefill ------------------------------------------------------------------------------------

PREFILL_QUERIES, PREFILL_CACHED = [128, 256, 512, 2048], [1024, 4096, 16384]


def run_prefill(quick: bool) -> list[dict]:
    """Query length 128..2k after 1k..16k cached keys (seqlen_k = cached + seqlen_q), GQA 8:1:
    the KV-cache kernel (contiguous and page 256) against the dense forward (the Gluon kernel
    on sm_90) on the same q, k, v, causal and full, and cuDNN SDPA on the full case (its causal
    mask is top-left aligned: other work); MHA at 4k cached, causal, contiguous."""
    rows = []
    queries, cached_keys = ([128, 2048], [4096]) if quick else (PREFILL_QUERIES, PREFILL_CACHED)
    cells = [(1, sq, cached, 4, causal) for sq in queries for cached in cached_keys
             for causal in (True, False)]
    cells += [(1, sq, 4096, 32, True) for sq in queries]
    cells += [(4, 512, 4096, 4, causal) for causal in (True, False)]
    for batch, seqlen_q, cached, nheads_k, causal in cells:
        seqlen_k = cached + seqlen_q
        visible = seqlen_q * cached + (seqlen_q * (seqlen_q + 1) / 2 if causal else seqlen_q ** 2)
        tflop = 4 * batch * NHEADS * visible * HEAD_DIM / 1e12
        row = {"batch": batch, "seqlen_q": seqlen_q, "cached": cached, "seqlen_k": seqlen_k,
               "nheads_k": nheads_k, "causal": causal}
        row.update(prefill_ms(batch, seqlen_q, seqlen_k, nheads_k, causal,
                              pages=(None, 256) if nheads_k == 4 and batch == 1 else (None,)))
        for key in [k for k in row if k.endswith("_ms")]:
            if row[key] is not None:
                row[key.replace("_ms", "_tflops")] = tflop / (row[key] * 1e-3)
        row["ratio"] = row["dense_ms"] / row["kvcache_ms"]  # > 1: the cache kernel is faster
        if row.get("kvcache_paged256_ms"):
            row["ratio_paged256"] = row["dense_ms"] / row["kvcache_paged256_ms"]
        if row.get("sdpa_cudnn_ms"):
            row["ratio_cudnn"] = row["sdpa_cudnn_ms"] / row["kvcache_ms"]
        rows.append(row)
        print("prefill", json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    return rows


def prefill_ms(batch, seqlen_q, seqlen_k, nheads_k, causal=True, pages=(None,)) -> dict:
    """Eager ms of the KV-cache launcher (auto splits; per page size), of the Gluon prefill
    route's launcher, of the public call (route forced on / off with a tensor cache_seqlens; as
    configured with an int) and of the dense forward on the same q, k, v (and SDPA cuDNN when
    not causal); auto_splits. Page sizes: batch 1 only."""
    k_cache, v_cache, _ = make_cache(batch, seqlen_k, nheads_k, None)
    q = torch.randn(batch, seqlen_q, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    params = AttentionParams(HEAD_DIM ** -0.5, None, 0 if causal else None)
    times = {"auto_splits": decode.launch_shape(q, nheads_k, 0, 0, seqlen_k)[3],
             "dense_ms": bench(lambda: attention_forward(q, k_cache, v_cache, params))}
    for page_size in pages:
        table = None
        kc, vc = k_cache, v_cache
        if page_size is not None:
            n_pages = math.ceil(seqlen_k / page_size)
            table = torch.randperm(n_pages, device="cuda", dtype=torch.int32)[None]
            kc, vc = (paged_copy(c, table, page_size) for c in (k_cache, v_cache))
        key = "kvcache_ms" if page_size is None else f"kvcache_paged{page_size}_ms"
        times[key] = kernel_ms(q, kc, vc, table, seqlen_k, params, 0)
    seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")
    with gluon_prefill_thresholds(0, 0):
        assert prefill.declines(q, k_cache, None, seqlen_k) is None, \
            "the Gluon prefill route did not take the cell"
        packed = prefill.as_varlen(q, k_cache, v_cache, None, None, None, params)
        route = functools.partial(prefill.forward, q, k_cache, v_cache, seqlens, None, packed)
        times["route_ms"] = bench(route)
    # The public call over the whole cache (no append): the Gluon route forced on and off with a
    # tensor cache_seqlens, and as configured (prefill.GLUON_PREFILL_*) with an int one.
    public = functools.partial(flash_attn_with_kvcache, q, k_cache, v_cache, causal=causal)
    for key, lo in (("public_route_ms", 0), ("public_decode_ms", 2**62)):
        with gluon_prefill_thresholds(lo, lo):
            times[key] = bench(lambda: public(cache_seqlens=seqlens))
    times["public_int_ms"] = bench(lambda: public(cache_seqlens=seqlen_k))
    if not causal:
        fn = sdpa_fn(q, k_cache, v_cache, "CUDNN_ATTENTION")
        times["sdpa_cudnn_ms"] = None if fn is None else bench(fn)
    return times


@contextlib.contextmanager
def gluon_prefill_thresholds(min_queries, min_work):
    """The Gluon prefill route's thresholds set for the block (0: always; huge: never); the
    dispatcher's cached choices are forgotten on the way in and out."""
    saved = prefill.GLUON_PREFILL_MIN_QUERIES, prefill.GLUON_PREFILL_MIN_WORK
    prefill.GLUON_PREFILL_MIN_QUERIES, prefill.GLUON_PREFILL_MIN_WORK = min_queries, min_work
    dispatch.forget_plans()
    try:
        yield
    finally:
        prefill.GLUON_PREFILL_MIN_QUERIES, prefill.GLUON_PREFILL_MIN_WORK = saved
        dispatch.forget_plans()


def paged_copy(cache, table, page_size):
    """A batch-1 contiguous cache (1, L, hk, d) laid out in the pages of table (1, pages)."""
    n_pages = table.shape[1]
    padded = cache.new_zeros(n_pages * page_size, *cache.shape[2:])
    padded[:cache.shape[1]] = cache[0]
    paged = torch.empty_like(padded).unflatten(0, (n_pages, page_size))
    paged[table[0].long()] = padded.unflatten(0, (n_pages, page_size))
    return paged


# --- a decode step replayed from a CUDA graph ----------------------------------------------------

GRAPH_CELLS = [(b, L, hk, page) for hk in (4, 32) for b in (1, 4) for L in (1024, 4096, 16384)
               for page in (None, 256)]
# --graph-cells small: the launch-bound cells of issue 5 (b1 1k/16k and b8 16k, GQA 8:1 and 1:1)
# plus two large cells (a regression check: there the step is the bytes, not the launches)
SMALL_GRAPH_CELLS = [(1, 1024, 4, None), (1, 16384, 4, None), (1, 1024, 32, None),
                     (1, 16384, 32, None), (8, 16384, 4, None), (8, 16384, 32, None),
                     (1, 16384, 4, 256), (4, 4096, 4, None), (16, 1024, 32, 256),
                     (1, 131072, 4, 256), (16, 65536, 4, None)]
# --graph-cells large: the 1-2 GB cells of SMALL_GRAPH_CELLS
LARGE_GRAPH_CELLS = [(8, 16384, 32, None), (16, 65536, 4, None)]


def run_graph_steps(copy_bw: float, quick: bool, cells: str = "grid") -> list[dict]:
    """The public call as one decoding step (append one token with rotary at cache_seqlens = L - 1,
    attend causally over L keys, auto splits): per-step time of back-to-back eager calls and of
    back-to-back replays of the captured step (wall clock, what a decoding loop sees), the
    captured step's GPU time, and cuDNN SDPA on the same attention (no append) eager and
    replayed; bandwidth = K+V bytes / time as % of the copy. The read floor: one kernel that
    only reads the same bytes (_read_kernel), replayed: no step of one launch can beat it, so it
    says how much of the copy's bandwidth a cell's bytes allow at all."""
    rows = []
    cells = {"small": SMALL_GRAPH_CELLS, "large": LARGE_GRAPH_CELLS}.get(
        cells, GRAPH_CELLS[::3] if quick else GRAPH_CELLS)
    for batch, seqlen_k, nheads_k, page_size in cells:
        step, q, k_cache, v_cache = decoding_step(batch, seqlen_k, nheads_k, page_size)
        kv_bytes = kv_bytes_of(batch, seqlen_k, nheads_k)
        row = {"batch": batch, "seqlen_k": seqlen_k, "nheads_k": nheads_k,
               "page_size": page_size, "kv_bytes": kv_bytes,
               "auto_splits": auto_splits(batch, seqlen_k, nheads_k, page_size),
               "nodes": graph_nodes(step), "eager_kernels": eager_kernels(step),
               "eager_loop_ms": loop_ms(step), "graph_loop_ms": loop_ms(captured(step)),
               "graph_gpu_ms": bench_graph(step),
               "read_floor_graph_gpu_ms": bench_graph(read_floor_fn(k_cache, v_cache,
                                                                    kv_bytes))}
        if page_size is None:
            fn = sdpa_fn(q, k_cache, v_cache, "CUDNN_ATTENTION")
            row["cudnn_eager_loop_ms"] = loop_ms(fn)
            row["cudnn_graph_loop_ms"] = loop_ms(captured(fn))
            row["cudnn_graph_gpu_ms"] = bench_graph(fn)
            row["cudnn_nodes"] = graph_nodes(fn)
        for key in [k for k in row if k.endswith("_ms")]:
            row[key.replace("_ms", "_pct_copy")] = 100 * kv_bytes / (row[key] * 1e-3) / copy_bw
        rows.append(row)
        print("graph", json.dumps(row), flush=True)
        del k_cache, v_cache
        torch.cuda.empty_cache()
    return rows


def decoding_step(batch, seqlen_k, nheads_k, page_size):
    """(step, q, k_cache, v_cache): the public call appending one token with rotary at
    cache_seqlens = seqlen_k - 1 and attending causally over seqlen_k keys (auto splits; a
    num_splits keyword to step overrides that)."""
    k_cache, v_cache, table = make_cache(batch, seqlen_k, nheads_k, page_size)
    q = torch.randn(batch, 1, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    k_new, v_new = (torch.randn(batch, 1, nheads_k, HEAD_DIM, dtype=DTYPE, device="cuda")
                    for _ in "kv")
    angles = torch.rand(seqlen_k, HEAD_DIM // 2, device="cuda")
    cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
    seqlens = torch.full((batch,), seqlen_k - 1, dtype=torch.int32, device="cuda")
    step = functools.partial(flash_attn_with_kvcache, q, k_cache, v_cache, k_new, v_new, cos,
                             sin, seqlens, block_table=table, causal=True)
    return step, q, k_cache, v_cache


# stage splits: issue 5's latency-bound cells, and where their split counts lead (b1 4k, b2 16k,
# b1 64k); forced split counts from STEP_SPLITS up to one 64-key tile per split
STEP_SPLIT_CELLS = [(1, 1024, 4, None), (1, 1024, 32, None), (1, 4096, 4, None),
                    (1, 16384, 4, None), (4, 4096, 4, None), (1, 16384, 4, 256),
                    (2, 16384, 4, None), (1, 65536, 4, None)]
STEP_SPLITS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def study_step_splits() -> list[dict]:
    """Graph-replayed decoding step (decoding_step) GPU us at forced num_splits, and at the auto
    and best counts with the decode tile's num_stages + 1 (3 K/V tiles in flight instead of 2;
    104 KB of shared memory, 2 programs per SM): how much of a short-context step is the
    per-program chain of key tiles (decode_NOTES.md, "Where a latency-bound step goes")."""
    rows, default = [], decode.HOPPER["decode"]
    for batch, seqlen_k, nheads_k, page_size in STEP_SPLIT_CELLS:
        auto = auto_splits(batch, seqlen_k, nheads_k, page_size)
        step = decoding_step(batch, seqlen_k, nheads_k, page_size)[0]
        us = {s: round(1e3 * bench_graph(functools.partial(step, num_splits=s)), 2)
              for s in sorted({s for s in STEP_SPLITS if s <= seqlen_k // 64} | {auto})}
        best = min(us, key=us.get)
        set_decode_tile(num_stages=default.num_stages + 1)
        try:
            deeper = {s: round(1e3 * bench_graph(functools.partial(step, num_splits=s)), 2)
                      for s in sorted({auto, best})}
        finally:
            decode.HOPPER["decode"] = default
        rows.append({"batch": batch, "seqlen_k": seqlen_k, "nheads_k": nheads_k,
                     "page_size": page_size, "auto": auto, "best": best, "us": us,
                     "one_more_stage_us": deeper})
        print("step splits", json.dumps(rows[-1]), flush=True)
        del step
        torch.cuda.empty_cache()
    return rows


def captured(fn):
    """fn captured in a CUDA graph (warmed up on a side stream first); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graph_nodes(fn) -> list[str]:
    """The GPU activities of one replay of fn captured in a CUDA graph: its kernel (and memset
    or copy) nodes, by name."""
    return eager_kernels(captured(fn))


def eager_kernels(fn) -> list[str]:
    """Names of the GPU activities (kernels, memsets, copies) of one eager call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def loop_ms(call, calls: int = 300) -> float:
    """Wall-clock ms per call of back-to-back calls, the GPU drained before and after: the
    larger of host and GPU time per step."""
    return host_ms(call, calls, drain=True)


# --- tile sweep ---------------------------------------------------------------------------------

def run_sweep(copy_bw: float) -> list[dict]:
    rows, default = [], decode.HOPPER["decode"]
    params = AttentionParams(HEAD_DIM ** -0.5)
    for batch, seqlen_k, nheads_k in ((1, 32768, 4), (64, 8192, 32), (16, 16384, 4)):
        k_cache, v_cache, _ = make_cache(batch, seqlen_k, nheads_k, None)
        q = torch.randn(batch, 1, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        kv_bytes = 2 * k_cache.numel() * 2
        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
            set_decode_tile(block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                ms = kernel_ms(q, k_cache, v_cache, None, seqlen_k, params, 0)
            except Exception as e:  # noqa: BLE001 - out of shared memory, say
                print("sweep", (block_n, warps, stages), "failed", type(e).__name__)
                continue
            rows.append({"batch": batch, "seqlen_k": seqlen_k, "nheads_k": nheads_k,
                         "block_n": block_n, "warps": warps, "stages": stages, "ms": ms,
                         "pct_copy": 100 * kv_bytes / (ms * 1e-3) / copy_bw})
            print(json.dumps(rows[-1]), flush=True)
        decode.HOPPER["decode"] = default
    return rows


STAGES = ["api", "profile", "study", "paging", "prefill", "graph", "splits", "decode", "sweep"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--stages", default="api,study,prefill,graph,decode",
                        help=f"comma-separated, in this order: {','.join(STAGES)} (the gate "
                             "and the copy bandwidth always run)")
    parser.add_argument("--no-fa2", action="store_true", help="skip SDPA's FLASH backend")
    parser.add_argument("--before", help="a previous kvcache.py to time in the api stage")
    parser.add_argument("--no-gate", action="store_true",
                        help="skip the correctness gate (an A/B run of a tree tested elsewhere)")
    parser.add_argument("--graph-cells", choices=["grid", "small", "large"], default="grid",
                        help="graph stage: the b1/b4 grid, issue 5's launch-bound cells, or "
                             "their 1-2 GB ones")
    args = parser.parse_args()
    stages = set(args.stages.split(","))
    if stages - set(STAGES):
        parser.error(f"--stages: unknown {sorted(stages - set(STAGES))}")
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    path = os.path.join(args.out, f"decode_{stamp}.json")
    result = {"env": environment(),
              "config": {"dtype": str(DTYPE), "nheads": NHEADS, "head_dim": HEAD_DIM,
                         "quick": args.quick, "stages": sorted(stages), "tiles": tiles(),
                         "max_splits": decode.MAX_SPLITS,
                         "short_split_tiles": decode.SHORT_SPLIT_TILES,
                         "paged_extra_stages": decode.PAGED_EXTRA_STAGES,
                         "launch_pdl": decode.LAUNCH_PDL,
                         "step_max_new": getattr(decode, "STEP_MAX_NEW", None)}}

    def save(key, value):
        result[key] = value
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    if not args.no_gate:
        save("pdl_check", pdl_check())
        print("pdl", result["pdl_check"], flush=True)
        save("checked", check())
        print("correctness gate passed:", result["checked"], flush=True)
    save("copy_bandwidth_bytes_per_s", copy_bandwidth())
    copy_bw = result["copy_bandwidth_bytes_per_s"]
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    if "sweep" in stages:
        save("sweep", run_sweep(copy_bw))
    if "api" in stages:
        save("api", run_api(args.before))
    if "profile" in stages:
        try:
            save("launch_study", launch_study())
        except Exception as e:  # noqa: BLE001 - a study of Triton internals; the run goes on
            save("launch_study", {"error": f"{type(e).__name__}: {e}"})
        print("launch study", json.dumps(result["launch_study"]), flush=True)
        save("api_profile", profile_api())
        print(result["api_profile"], flush=True)
    if "study" in stages:
        save("split_study", study_splits(copy_bw))
        save("prefill_study", study_prefill())
    if "paging" in stages:
        save("paging_study", study_paging(copy_bw))
    save("chosen", {"tiles": tiles(), "launch_pdl": decode.LAUNCH_PDL,
                    "page_tile_lookup": decode.PAGE_TILE_LOOKUP,
                    "page_tile_extra_stages": decode.PAGE_TILE_EXTRA_STAGES})
    print("chosen", json.dumps(result["chosen"]), flush=True)
    if "prefill" in stages:
        save("prefill", run_prefill(args.quick))
    if "graph" in stages:
        save("graph", run_graph_steps(copy_bw, args.quick, args.graph_cells))
    if "splits" in stages:
        save("step_splits", study_step_splits())
    if "decode" in stages:
        save("decode", run_decode(copy_bw, args.quick, not args.no_fa2))
    print_summary(result)
    print("wrote", path)


def print_summary(result: dict) -> None:
    """The tables of decode_NOTES.md, compactly: % of copy bandwidth (graph replays), the
    prefill ratios to the dense forward and cuDNN, the captured step against eager calls."""
    pct = lambda row, key: f"{row[key]:.0f}" if row.get(key) is not None else "-"  # noqa: E731
    if result.get("decode"):
        print("batch seqlen_k hk page splits | auto splits1 cudnn fa2 | auto_eager")
    for r in result.get("decode", []):
        print(r["batch"], r["seqlen_k"], r["nheads_k"], r["page_size"] or "-", r["auto_splits"],
              "|", *(pct(r, f"{k}_graph_pct_copy") for k in
                     ("auto", "splits1", "sdpa_cudnn", "sdpa_flash")),
              "|", pct(r, "auto_eager_pct_copy"), "L2" if r["l2_resident"] else "")
    if result.get("prefill"):
        print("prefill b sq cached hk mask | dense TFLOP/s | x dense: decode paged256 route "
              "public_route public_decode public_int | decode x cudnn")
    for r in result.get("prefill", []):
        print("prefill", r["batch"], r["seqlen_q"], r["cached"], r["nheads_k"],
              "causal" if r["causal"] else "full", f"| {r['dense_tflops']:.0f} |",
              *(f"{r['dense_ms'] / r[key]:.2f}" if r.get(key) else "-" for key in (
                  "kvcache_ms", "kvcache_paged256_ms", "route_ms", "public_route_ms",
                  "public_decode_ms", "public_int_ms")),
              f"| {r.get('ratio_cudnn') or 0:.2f}")
    if result.get("graph"):
        print("graph: b L hk page splits | % copy: eager_loop graph_loop graph_gpu | cudnn "
              "eager_loop graph_loop graph_gpu | us per step eager graph")
    for r in result.get("graph", []):
        print(r["batch"], r["seqlen_k"], r["nheads_k"], r["page_size"] or "-", r["auto_splits"],
              "nodes", len(r.get("nodes", [])),
              "|", *(pct(r, f"{k}_pct_copy") for k in ("eager_loop", "graph_loop", "graph_gpu")),
              "|", *(pct(r, f"cudnn_{k}_pct_copy") for k in
                     ("eager_loop", "graph_loop", "graph_gpu")),
              "|", f"{1e3 * r['eager_loop_ms']:.1f} {1e3 * r['graph_loop_ms']:.1f}")


def tiles() -> dict:
    return {name: tile._asdict() for name, tile in decode.HOPPER.items()}


if __name__ == "__main__":
    main()
