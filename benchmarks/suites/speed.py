"""speed: forward, backward and step TFLOP/s of flash_attn_func against the anchors.

    PYTHONPATH=src python3 benchmarks/suites/speed.py [--grid main|quick|d256|fp16|full]
        [--head-dims 64,128] [--directions fwd,bwd,step] [--anchors cudnn,flash,efficient,flex]
        [--backend triton] [--budget SECONDS] [--out DIR]

The public call as a user makes it, eager: forward under no_grad, backward as autograd.grad on
a retained graph, step as forward with grad + backward. batch = 16k tokens / seqlen,
nheads = 2048 / head_dim, causal and not. The anchors run in the same process on
(b, h, s, d) copies of the same inputs: PyTorch SDPA with the CUDNN, FLASH_ATTENTION (FA2) and
EFFICIENT backends, and FlexAttention compiled. TFLOP/s count 4 b h s^2 d (causal: half),
backward 2.5x, step 3.5x; every number is also a ratio to cuDNN's, and flashkit's a percentage
of the matmul ceiling: the TFLOP/s of one 8192 x 8192 x 8192 torch.matmul in the grid's dtype,
measured in the same run.
"""

from __future__ import annotations

import argparse
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
    inputs,
    log,
    table,
    tflops,
)

GRIDS = {
    "quick": dict(dtypes=["bfloat16"], head_dims=[64, 128], seqlens=[1024, 4096, 16384]),
    "main": dict(dtypes=["bfloat16"], head_dims=[64, 128],
                 seqlens=[1024, 2048, 4096, 8192, 16384]),
    "d256": dict(dtypes=["bfloat16"], head_dims=[256], seqlens=[1024, 4096, 16384]),
    "fp16": dict(dtypes=["float16"], head_dims=[64, 128, 256], seqlens=[1024, 4096, 16384]),
    "full": dict(dtypes=["bfloat16", "float16"], head_dims=[64, 128, 256],
                 seqlens=[1024, 2048, 4096, 8192, 16384]),
}
DIRECTIONS = ("fwd", "bwd", "step")
CEILING_SIZE = 8192


def matmul_ceiling(dtype: str) -> float:
    """TFLOP/s of one CEILING_SIZE-cubed torch.matmul in dtype: the dense tensor-core rate
    this GPU sustains, against which an attention kernel's TFLOP/s are a percentage."""
    a, b = (torch.randn(CEILING_SIZE, CEILING_SIZE, device="cuda", dtype=getattr(torch, dtype))
            for _ in range(2))
    return tflops(2 * CEILING_SIZE ** 3, bench(lambda: a @ b))


def timings(run, q, k, v, dout, directions) -> dict:
    """{direction: ms} of run(q, k, v) -> out."""
    ms = {}
    if "fwd" in directions:
        with torch.no_grad():
            ms["fwd"] = bench(lambda: run(q, k, v))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    if "bwd" in directions:
        out = run(*leaves)
        ms["bwd"] = bench(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
        del out
    if "step" in directions:
        ms["step"] = bench(lambda: torch.autograd.grad(run(*leaves), leaves, dout))
    return ms


def cell(dtype, head_dim, seqlen, causal, anchors, directions, backend) -> dict:
    import flashkit

    q, k, v, dout = inputs(seqlen, head_dim, getattr(torch, dtype))
    batch, nheads = q.shape[0], q.shape[2]
    row = dict(dtype=dtype, head_dim=head_dim, seqlen=seqlen, batch=batch, nheads=nheads,
               causal=causal, ms={}, tflops={}, errors={})
    impls = {"flashkit": lambda *t: flashkit.flash_attn_func(*t, causal=causal,
                                                              backend=backend)}
    impls.update({name: anchor_call(name, causal) for name in anchors})
    for name, run in impls.items():
        args = (q, k, v, dout) if name == "flashkit" else tuple(
            x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
        try:
            row["ms"][name] = timings(run, *args, directions)
        except Exception as e:  # an anchor that lacks this case is recorded, not timed
            row["errors"][name] = f"{type(e).__name__}: {e}"[:200]
            continue
        row["tflops"][name] = {d: tflops(flops(batch, nheads, seqlen, head_dim, causal, d), t)
                               for d, t in row["ms"][name].items()}
    if "cudnn" in row["tflops"]:
        row["ratio_to_cudnn"] = {n: {d: t / row["tflops"]["cudnn"][d] for d, t in tf.items()}
                                 for n, tf in row["tflops"].items()}
    return row


def summary(rows, directions, ceilings: dict) -> str:
    flat = []
    for r in rows:
        for d in directions:
            line = {"dtype": r["dtype"], "d": r["head_dim"], "seqlen": r["seqlen"],
                    "mask": "causal" if r["causal"] else "full", "dir": d}
            for name, tf in r["tflops"].items():
                line[name] = tf.get(d)
            ratio = r.get("ratio_to_cudnn", {}).get("flashkit", {}).get(d)
            line["flashkit/cudnn"] = ratio
            mine = r["tflops"].get("flashkit", {}).get(d)
            line["flashkit % of matmul"] = (None if mine is None else
                                            100 * mine / ceilings[r["dtype"]])
            flat.append(line)
    names = sorted({n for r in rows for n in r["tflops"]}, key=lambda n: n != "flashkit")
    ceiling = ", ".join(f"{dtype} {tf:.0f}" for dtype, tf in ceilings.items())
    return ("TFLOP/s (flashkit.flash_attn_func and the anchors, same process); the matmul "
            f"ceiling ({CEILING_SIZE}^3 torch.matmul, same run): {ceiling} TFLOP/s\n\n"
            + table(flat, ["dtype", "d", "seqlen", "mask", "dir", *names, "flashkit/cudnn",
                           "flashkit % of matmul"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--grid", choices=sorted(GRIDS), default="main")
    ap.add_argument("--head-dims", default=None,
                    type=lambda text: {int(d) for d in text.split(",")},
                    help="comma-separated: only these of the grid's head dims")
    ap.add_argument("--directions", default=",".join(DIRECTIONS))
    ap.add_argument("--anchors", default="cudnn,flash,flex",
                    help=f"comma-separated, of {','.join(ANCHORS)} (empty: none)")
    ap.add_argument("--backend", default=None, help="flash_attn_func's backend= (default: auto)")
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds after which no new cell starts")
    ap.add_argument("--tag", default="")
    add_out_argument(ap, "speed")
    args = ap.parse_args(argv)
    directions = [d for d in args.directions.split(",") if d]
    anchors = [a for a in args.anchors.split(",") if a]
    bad = set(directions) - set(DIRECTIONS) or set(anchors) - set(ANCHORS)
    if bad:
        ap.error(f"unknown direction or anchor: {sorted(bad)}")
    grid = dict(GRIDS[args.grid])
    if args.head_dims:
        if not args.head_dims <= set(grid["head_dims"]):
            ap.error(f"--head-dims: the {args.grid} grid has {grid['head_dims']}")
        grid["head_dims"] = [d for d in grid["head_dims"] if d in args.head_dims]
    result = Result("speed", args.out, args.tag,
                    dict(grid=args.grid, **grid, directions=directions, anchors=anchors,
                         backend=args.backend))
    log(str(result.data["env"]))
    ceilings = {dtype: matmul_ceiling(dtype) for dtype in grid["dtypes"]}
    result.save("matmul_ceiling_tflops", ceilings)
    log(f"matmul ceiling: {ceilings}")
    rows, deadline = [], time.time() + args.budget
    for dtype in grid["dtypes"]:
        for head_dim in grid["head_dims"]:
            for seqlen in grid["seqlens"]:
                for causal in (False, True):
                    if time.time() > deadline:
                        log("budget spent: the grid stops here")
                        break
                    rows.append(cell(dtype, head_dim, seqlen, causal, anchors, directions,
                                     args.backend))
                    r = rows[-1]
                    log(f"{dtype} d{head_dim} s{seqlen} {'causal' if causal else 'full'}: "
                        + " | ".join(f"{n} " + "/".join(f"{t:.0f}" for t in tf.values())
                                     for n, tf in r["tflops"].items()))
                    result.save("rows", rows)
                    torch.cuda.empty_cache()
    result.markdown(summary(rows, directions, ceilings))
    log(f"wrote {result.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
