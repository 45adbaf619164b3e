"""Speed and memory of the Triton backend against PyTorch's attention kernels (DESIGN section 6).

    PYTHONPATH=src python3 benchmarks/bench_triton.py --out DIR [--grid main|full|quick]
                                                      [--sweep] [--anchors flash,cudnn,...]

Grid: batch = 16k tokens / seqlen, nheads = 2048 / headdim, causal and not, forward and backward.
Anchors, measured in the same run on the same inputs (contiguous (b, h, s, d) copies for them):
PyTorch SDPA with the FLASH_ATTENTION (FA2), CUDNN_ATTENTION and EFFICIENT_ATTENTION backends,
and FlexAttention under torch.compile. Times are triton.testing.do_bench medians; TFLOP/s count
4 b h sq sk d visible pairs forward (half of it causal) and 2.5x that backward. Backward times
the backward alone: ours is the launcher on saved (out, lse), the anchors are autograd.grad on a
retained graph. --sweep times the candidate tiles of configs.py's HOPPER table instead.
Results go to DIR/triton_*.json with date, device, versions and config.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys
import time

import torch
import triton
from triton.testing import do_bench

from flashkit.ops.params import AttentionParams

fwd_mod = importlib.import_module("flashkit.ops.triton.forward")
bwd_mod = importlib.import_module("flashkit.ops.triton.backward")
dispatch = importlib.import_module("flashkit.ops.triton.dispatch")
hopper_bwd = importlib.import_module("flashkit.ops.triton.backward_hopper")

TOKENS, WIDTH = 16384, 2048


def environment() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cudnn": torch.backends.cudnn.version(),
    }


def flops(batch, nheads, seqlen, head_dim, causal, direction):
    f = 4 * batch * nheads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    return f * (2.5 if direction == "bwd" else 1.0)


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def inputs(seqlen, head_dim, dtype):
    batch, nheads = TOKENS // seqlen, WIDTH // head_dim
    shape = (batch, seqlen, nheads, head_dim)
    q, k, v, dout = (torch.randn(shape, dtype=dtype, device="cuda") for _ in range(4))
    return q, k, v, dout


def ours(q, k, v, dout, causal, atomic_dq=None, fused=None):
    """(fwd ms, bwd ms) of the kernels the dispatcher picks; atomic_dq / fused (not None)
    force the backward's dQ path and whether dK/dV and dQ share one launch."""
    from flashkit.ops.triton.configs import FUSED_BWD

    params = AttentionParams(q.shape[-1] ** -0.5, None, 0 if causal else None)
    out, lse = dispatch.forward_call(q, k, v, params)
    t_fwd = bench(lambda: dispatch.forward_call(q, k, v, params))
    if atomic_dq is None and fused is None:
        t_bwd = bench(lambda: dispatch.backward_call(dout, q, k, v, out, lse, params))
        return t_fwd, t_bwd
    gluon = hopper_bwd.eligible(q, k, v, dout, lse, params, q, k, v, None)
    t_bwd = bench(lambda: bwd_mod.attention_backward(
        dout, q, k, v, out, lse, params, atomic_dq=bool(atomic_dq),
        fused=FUSED_BWD if fused is None else fused, gluon=gluon))
    return t_fwd, t_bwd


def anchor(name, q, k, v, dout, causal):
    """(fwd ms, bwd ms) of one PyTorch anchor on (b, h, s, d) copies of the inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    qh, kh, vh, douth = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = anchor_flex_compiled(flex_attention)
        seqlen = qh.shape[2]
        mask = (create_block_mask(lambda b, h, i, j: j <= i, None, None, seqlen, seqlen)
                if causal else None)
        run = lambda *t: flex(*t, block_mask=mask)
    else:
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]

        def run(*t):
            with sdpa_kernel(backend):
                return sdpa(*t, is_causal=causal)

    t_fwd = bench(lambda: run(qh, kh, vh))
    leaves = [x.requires_grad_() for x in (qh, kh, vh)]
    out = run(*leaves)
    t_bwd = bench(lambda: torch.autograd.grad(out, leaves, douth, retain_graph=True))
    return t_fwd, t_bwd


_FLEX = {}


def anchor_flex_compiled(flex_attention):
    """flex_attention compiled once per shape; the grid's shapes exceed dynamo's default
    recompile limit of 8, past which it would silently run the unfused fallback."""
    if "fn" not in _FLEX:
        for name, limit in (("cache_size_limit", 256), ("recompile_limit", 256),
                            ("accumulated_recompile_limit", 4096)):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, limit)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def peak_memory(fn) -> int:
    """Bytes allocated at the peak of fn() above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def memory_row(seqlen, head_dim, dtype):
    """Peak extra memory of forward + backward, ours vs SDPA FLASH, at one size."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    q, k, v, dout = inputs(seqlen, head_dim, dtype)
    params = AttentionParams(head_dim ** -0.5, None, 0)

    def run_ours():
        out, lse = dispatch.forward_call(q, k, v, params)
        dispatch.backward_call(dout, q, k, v, out, lse, params)

    qh, kh, vh, douth = (x.transpose(1, 2).contiguous().requires_grad_() for x in
                         (q, k, v, dout))

    def run_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = sdpa(qh, kh, vh, is_causal=True)
        torch.autograd.grad(out, (qh, kh, vh), douth)

    run_ours(), run_flash()
    return {"seqlen": seqlen, "head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""),
            "ours_bytes": peak_memory(run_ours), "sdpa_flash_bytes": peak_memory(run_flash),
            "inputs_bytes": 4 * q.numel() * q.element_size()}


GRIDS = {
    "quick": dict(dtypes=[torch.bfloat16], head_dims=[64, 128], seqlens=[1024, 4096, 16384]),
    "main": dict(dtypes=[torch.bfloat16], head_dims=[64, 128],
                 seqlens=[1024, 2048, 4096, 8192, 16384]),
    "d256": dict(dtypes=[torch.bfloat16], head_dims=[256], seqlens=[1024, 4096, 16384]),
    "fp16": dict(dtypes=[torch.float16], head_dims=[64, 128, 256], seqlens=[1024, 4096, 16384]),
    "full": dict(dtypes=[torch.bfloat16, torch.float16], head_dims=[64, 128, 256],
                 seqlens=[512, 1024, 2048, 4096, 8192, 16384]),
}


def run_grid(grid, anchors, out_path, env, ours_variants=("ours", "ours_atomic")):
    rows = []
    g = GRIDS[grid]
    for dtype in g["dtypes"]:
        for head_dim in g["head_dims"]:
            for seqlen in g["seqlens"]:
                for causal in (False, True):
                    q, k, v, dout = inputs(seqlen, head_dim, dtype)
                    batch, nheads = q.shape[0], q.shape[2]
                    row = {"dtype": str(dtype).replace("torch.", ""), "head_dim": head_dim,
                           "seqlen": seqlen, "batch": batch, "nheads": nheads,
                           "causal": causal, "ms": {}, "tflops": {}}
                    impls = list(ours_variants) + anchors
                    for impl in impls:
                        try:
                            if impl.startswith("ours"):
                                atomic, fused = {"ours": (None, None), "ours_det": (False, None),
                                                 "ours_atomic": (True, None),
                                                 "ours_split": (None, False)}[impl]
                                times = ours(q, k, v, dout, causal, atomic, fused)
                            else:
                                times = anchor(impl, q, k, v, dout, causal)
                        except Exception as e:  # an anchor that lacks this case is recorded
                            row.setdefault("errors", {})[impl] = f"{type(e).__name__}: {e}"[:200]
                            continue
                        row["ms"][impl] = dict(zip(("fwd", "bwd"), times, strict=True))
                        row["tflops"][impl] = {
                            d: flops(batch, nheads, seqlen, head_dim, causal, d) / t * 1e-9
                            for d, t in zip(("fwd", "bwd"), times, strict=True)}
                    if "cudnn" in row["tflops"]:
                        row["ratio_to_cudnn"] = {
                            impl: {d: row["tflops"][impl][d] / row["tflops"]["cudnn"][d]
                                   for d in ("fwd", "bwd")} for impl in row["tflops"]}
                    rows.append(row)
                    print_row(row, impls)
                    json.dump({"env": env, "grid": grid, "rows": rows}, open(out_path, "w"),
                              indent=1)
                    del q, k, v, dout
                    torch.cuda.empty_cache()
    return rows


def print_row(row, impls):
    cells = []
    for impl in impls:
        t = row["tflops"].get(impl)
        cells.append(f"{impl} {t['fwd']:6.1f}/{t['bwd']:6.1f}" if t else f"{impl} --")
    print(f"{row['dtype']} d{row['head_dim']:<3} s{row['seqlen']:<5} "
          f"{'causal' if row['causal'] else 'full  '} TFLOP/s fwd/bwd: " + " | ".join(cells),
          flush=True)


SWEEP = {  # candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel
    "forward_pointers": [(128, 128, 8, 3), (128, 64, 4, 3)],
    "forward": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2),
                (64, 64, 4, 3), (128, 64, 8, 4), (64, 128, 4, 3)],
    "dkdv": [(32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 3), (64, 128, 8, 2),
             (32, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
    "dkdv_atomic": [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3),
                    (32, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 2), (128, 128, 8, 1),
                    (64, 128, 8, 1)],
    "dq": [(128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2),
           (64, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
}


SWEEP_D256 = {  # head dim 256 needs smaller tiles: shared memory and registers
    "forward": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 2), (64, 64, 8, 2),
                (128, 32, 8, 2)],
    "dkdv": [(32, 64, 8, 2), (16, 64, 4, 2), (32, 64, 4, 2), (32, 32, 4, 3), (64, 64, 8, 2),
             (16, 32, 4, 3), (32, 128, 8, 1)],
    "dq": [(64, 32, 8, 2), (64, 32, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2), (128, 32, 8, 2),
           (64, 16, 4, 3)],
}


def run_sweep(out_path, env, head_dims=(64, 128), seqlen=4096, kernels=tuple(SWEEP)):
    from flashkit.ops.triton.configs import HOPPER, padded_head_dim

    results = []
    for head_dim in head_dims:
        for causal in (False, True):
            q, k, v, dout = inputs(seqlen, head_dim, torch.bfloat16)
            params = AttentionParams(head_dim ** -0.5, None, 0 if causal else None)
            out, lse = fwd_mod.attention_forward(q, k, v, params)
            row = padded_head_dim(head_dim)
            base = {"dkdv": HOPPER["dkdv"][row], "dq": HOPPER["dq"][row]}

            def time_tile(kernel, tile, q=q, k=k, v=v, dout=dout, out=out, lse=lse,
                          params=params, base=base):
                if kernel.startswith("forward"):
                    return bench(lambda: fwd_mod.attention_forward(
                        q, k, v, params, tile=tile, use_tma=kernel == "forward"))
                tiles = dict(base, **{kernel: tile})
                return bench(lambda: bwd_mod.attention_backward(
                    dout, q, k, v, out, lse, params, tiles=tiles,
                    atomic_dq=kernel == "dkdv_atomic"))

            for kernel in kernels:
                candidates = (SWEEP_D256 if head_dim == 256 else SWEEP)[kernel]
                for tile in candidates:
                    try:
                        ms = time_tile(kernel, tile)
                    except Exception as e:  # e.g. out of shared memory
                        ms = None
                        print(f"sweep {kernel} {tile}: {type(e).__name__}: {str(e)[:100]}")
                    results.append({"kernel": kernel, "tile": tile, "head_dim": head_dim,
                                    "causal": causal, "seqlen": seqlen, "ms": ms})
                    print(f"sweep d{head_dim} {'causal' if causal else 'full'} {kernel} "
                          f"{tile}: {ms}", flush=True)
            json.dump({"env": env, "sweep": results}, open(out_path, "w"), indent=1)
    best = {}
    for head_dim in head_dims:
        for kernel in kernels:
            totals = {}
            for r in results:
                if r["kernel"] == kernel and r["head_dim"] == head_dim and r["ms"] is not None:
                    totals.setdefault(tuple(r["tile"]), []).append(r["ms"])
            totals = {t: sum(v) for t, v in totals.items() if len(v) == 2}
            if totals:
                best[f"{kernel}/d{head_dim}"] = min(totals, key=totals.get)
    print("best (sum of causal and full at seqlen", seqlen, "):", best)
    json.dump({"env": env, "sweep": results, "best": {k: list(v) for k, v in best.items()}},
              open(out_path, "w"), indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--grid", choices=sorted(GRIDS), default=None)
    ap.add_argument("--anchors", default="cudnn,flash,flex")
    ap.add_argument("--ours", default="ours,ours_atomic",
                    help="ours (configs.py defaults), ours_det, ours_atomic (dQ path forced), "
                         "ours_split (dK/dV and dQ as two launches)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-head-dims", default="64,128")
    ap.add_argument("--sweep-kernels", default=",".join(SWEEP))
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--tag", default="")
    ap.add_argument("--check", action="store_true",
                    help="first run the gpu tests of tests/ops/test_triton.py (pytest -m gpu)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.check:
        import pytest

        code = pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider",
                            os.path.join(os.path.dirname(__file__), "..", "tests", "ops",
                                         "test_triton.py")])
        if code != 0:
            return int(code)
    env = environment()
    print(env, flush=True)
    stamp = time.strftime("%Y%m%d_%H%M", time.gmtime()) + (f"_{args.tag}" if args.tag else "")
    if args.sweep:
        run_sweep(os.path.join(args.out, f"triton_sweep_{stamp}.json"), env,
                  tuple(int(d) for d in args.sweep_head_dims.split(",")),
                  kernels=tuple(args.sweep_kernels.split(",")))
    if args.grid:
        anchors = [a for a in args.anchors.split(",") if a]
        run_grid(args.grid, anchors, os.path.join(args.out, f"triton_bench_{stamp}.json"), env,
                 tuple(args.ours.split(",")))
    if args.memory:
        rows = [memory_row(s, 128, torch.bfloat16) for s in (4096, 16384)]
        for r in rows:
            print("memory", r, flush=True)
        json.dump({"env": env, "memory": rows},
                  open(os.path.join(args.out, f"triton_memory_{stamp}.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
