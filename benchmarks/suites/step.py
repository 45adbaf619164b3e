"""step: the training step (forward with grad + backward) of flash_attn_func, eager and graphed.

The public call, eager, and the same step captured in a CUDA graph, against PyTorch SDPA (cuDNN,
FA2, efficient) and compiled FlexAttention in the same process.

    PYTHONPATH=src python3 benchmarks/suites/step.py --out DIR [--quick] [--no-flex]
        [--budget SECONDS]

Grid: bf16 and fp16, head dim 64/128/256, 1k/4k/16k tokens per sequence, batch x seqlen = 16k,
heads x head dim = 2048, causal and not (--quick: bf16, d64/d128, 1k and 16k). TFLOP/s count the
step as 3.5x the forward's 4 b h s^2 d (half of it causal); every column is also given as a ratio
to SDPA cuDNN's eager step. Writes DIR/<date>_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from common import (  # noqa: E402
    ANCHORS,
    Result,
    add_out_argument,
    anchor_call,
    bench,
    flops,
    graphed,
    log,
    table,
    tflops,
)

import flashkit  # noqa: E402

FULL = dict(dtypes=(torch.bfloat16, torch.float16), head_dims=(64, 128, 256),
            seqlens=(1024, 4096, 16384))
QUICK = dict(dtypes=(torch.bfloat16,), head_dims=(64, 128), seqlens=(1024, 16384))
TOKENS, WIDTH = 16384, 2048


def step_fn(attention, q, k, v, dout):
    """A step: out = attention(q, k, v) with grad, then the gradients of q, k, v."""
    leaves = (q, k, v)

    def step():
        out = attention(q, k, v)
        return torch.autograd.grad(out, leaves, dout)

    return step


def cell(dtype, head_dim, seqlen, causal, with_flex: bool) -> dict:
    batch, nheads = TOKENS // seqlen, WIDTH // head_dim
    shape = (batch, seqlen, nheads, head_dim)
    q, k, v, dout = (torch.randn(shape, dtype=dtype, device="cuda") for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    qh, kh, vh, douth = (x.detach().transpose(1, 2).contiguous() for x in (q, k, v, dout))
    qh, kh, vh = (x.requires_grad_() for x in (qh, kh, vh))
    ours = step_fn(lambda *t: flashkit.flash_attn_func(*t, causal=causal), q, k, v, dout)
    calls = {"flashkit": ours}
    anchors = {name: anchor_call(name, causal) for name in ANCHORS
               if with_flex or name != "flex"}
    for name, attention in anchors.items():
        calls[name] = step_fn(attention, qh, kh, vh, douth)
    ms = {}
    for name, call in calls.items():
        try:
            ms[name] = bench(call)
        except Exception as e:  # an anchor without this shape or dtype: recorded, not fatal
            ms[name] = None
            log(f"{name} d{head_dim} s{seqlen}: {type(e).__name__}: {e}")
    for name in ("flashkit", "cudnn"):
        try:
            ms[f"{name}_graph"] = bench(graphed(calls[name]))
        except Exception as e:
            ms[f"{name}_graph"] = None
            log(f"{name} graph d{head_dim} s{seqlen}: {type(e).__name__}: {e}")
    step_flops = flops(batch, nheads, seqlen, head_dim, causal, "step")
    row = {"dtype": str(dtype).replace("torch.", ""), "head_dim": head_dim, "seqlen": seqlen,
           "batch": batch, "nheads": nheads, "causal": causal}
    for name, t in ms.items():
        row[f"{name}_ms"] = t
        row[f"{name}_tflops"] = None if t is None else tflops(step_flops, t)
    base = ms.get("cudnn")
    for name, t in ms.items():
        row[f"{name}_x_cudnn"] = None if t is None or base is None else base / t
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="bf16, d64/d128, 1k and 16k only")
    ap.add_argument("--no-flex", action="store_true", help="leave out compiled FlexAttention")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default=None,
                    help="one dtype of the grid only (the whole grid takes ~10 minutes)")
    ap.add_argument("--budget", type=float, default=300.0,
                    help="seconds after which no new cell starts")
    add_out_argument(ap, "step")
    args = ap.parse_args(argv)
    grid = dict(QUICK if args.quick else FULL)
    if args.dtype is not None:
        grid["dtypes"] = (torch.bfloat16 if args.dtype == "bf16" else torch.float16,)
    result = Result("step", args.out, config={
        "grid": {k: [str(x) for x in v] for k, v in grid.items()}, "flex": not args.no_flex})
    log(str(result.data["env"]))
    rows, deadline = [], time.time() + args.budget
    for dtype, head_dim, seqlen, causal in itertools.product(
            grid["dtypes"], grid["head_dims"], grid["seqlens"], (False, True)):
        if time.time() > deadline:
            log("budget spent: the grid stops here")
            break
        rows.append(cell(dtype, head_dim, seqlen, causal, not args.no_flex))
        result.save("rows", rows)
        torch.cuda.empty_cache()
    impls = ["flashkit", "flashkit_graph", "cudnn", "cudnn_graph", "flash", "efficient"] + (
        [] if args.no_flex else ["flex"])
    columns = ["dtype", "head_dim", "seqlen", "causal", "flashkit_tflops"] + [
        f"{name}_x_cudnn" for name in impls]
    notes = ("Step = forward with grad + backward, public API, eager; *_graph: the same step "
             "replayed from a CUDA graph. Ratios are the cuDNN eager step's time over each.")
    result.markdown(f"# step\n\n{notes}\n\n" + table(rows, columns))
    log(f"wrote {result.path}")


if __name__ == "__main__":
    main()
