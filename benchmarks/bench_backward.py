"""Backward speed of the Gluon kernels (ops/triton/backward_hopper.py) against the Triton kernels
and the anchors, in one process (DESIGN section 6): a correctness check of every candidate tile
against an fp32 reference (the Triton kernels' error as the yardstick), a tile sweep at 4k, then
the grid.

    PYTHONPATH=src python3 benchmarks/bench_backward.py --out DIR [--seqlens 1024,4096,16384]
                                                        [--skip-sweep] [--budget SECONDS]
                                                        [--parts check,sweep,grid,varlen]
                                                        [--varlen-sets 2x8k,8x2k,ragged16]

Variants: gluon (the default path: Gluon dK/dV and dQ kernels), gluon_best (each kernel's
fastest tile of this run's sweep), gluon_atomic (dQ by bulk TMA reduce-adds from the dK/dV kernel
into an fp32 accumulator, then a conversion), gluon_atomic_best (its fastest dK/dV tile of
this run's --atomic-sweep over ATOMIC_CANDIDATES), triton
(Gluon off: backward.py's kernels), and the anchors of bench_triton.anchor (cudnn, flash = FA2,
flex = FlexAttention compiled). Times are the backward alone on saved (out, lse), bf16, 16k
tokens, nheads * headdim = 2048. Writes DIR/backward_<date>.json.

varlen (issue 4): packed sequences, bf16, nheads * headdim = 2048, the backward alone on the Triton
forward's saved (out, lse): equal lengths (2 x 8k, 8 x 2k) against the dense call on the same
tokens, and 16 ragged lengths of 1..8k (bench_features' RAGGED draw) as tokens/s against the dense
call on the batch padded to the longest; each beside the Triton varlen kernels (what varlen ran
before) and cuDNN (SDPA) on the dense / padded shape. First a check: the Gluon varlen gradients
against the Triton kernels' (max |difference|, synchronised, so a faulting kernel is named).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_triton import anchor, bench, environment, flops, inputs  # noqa: E402

from flashkit.ops.params import AttentionParams  # noqa: E402
from flashkit.ops.triton.configs import HOPPER  # noqa: E402

fwd_mod = importlib.import_module("flashkit.ops.triton.forward")
bwd_mod = importlib.import_module("flashkit.ops.triton.backward")
hop_mod = importlib.import_module("flashkit.ops.triton.backward_hopper")

# tile overrides per head dim: {"hopper": dK/dV tile} or {"hopper_dq": dQ tile}
CANDIDATES = {64: [{"hopper": (64, 64, 4, 2)}, {"hopper": (128, 64, 4, 2)},
                   {"hopper_dq": (64, 64, 4, 2)}, {"hopper_dq": (128, 64, 8, 2)},
                   {"hopper_dq": (128, 128, 8, 2)}],
              128: [{"hopper_dq": (64, 64, 4, 2)}, {"hopper_dq": (128, 64, 8, 2)}]}
# dK/dV tiles of the reduce-add dQ path (its only kernel besides preprocess and conversion)
ATOMIC_CANDIDATES = {64: [{"hopper": (128, 64, 4, 2)}, {"hopper": (64, 64, 4, 2)},
                          {"hopper": (64, 128, 8, 2)}],
                     128: [{"hopper": (64, 64, 4, 2)}, {"hopper": (64, 128, 8, 2)},
                           {"hopper": (64, 128, 8, 3)}]}


def saved_forward(q, k, v, params):
    """(out, lse) from the Triton forward kernel (tile given: independent of the Gluon one)."""
    return fwd_mod.attention_forward(q, k, v, params, tile=HOPPER["forward"][q.shape[-1]])


def backward(variant, dout, q, k, v, out, lse, params, tiles=None):
    """Gradients of one variant; tiles override backward_hopper's tables."""
    if variant == "triton":
        return bwd_mod.attention_backward(dout, q, k, v, out, lse, params)
    return bwd_mod.attention_backward(dout, q, k, v, out, lse, params, tiles=tiles,
                                      atomic_dq=variant.startswith("gluon_atomic"), gluon=True)


def reference_grads(q, k, v, dout, causal):
    """fp32 autograd of materialised attention, GQA by repeating kv heads."""
    group = q.shape[2] // k.shape[2]
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    qf, kf, vf = (x.transpose(1, 2) for x in leaves)
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    s = qf @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), -torch.inf)
    out = (torch.softmax(s, -1) @ vf).transpose(1, 2)
    return torch.autograd.grad(out, leaves, dout.float())


def _errors(ref, grads) -> list[float]:
    return [(g.float() - r).abs().max().item() for g, r in zip(grads, ref, strict=True)]


def check(log, variants, candidates=CANDIDATES) -> dict:
    """Every candidate block, both dQ paths, against the fp32 reference: its error may be at
    most twice the Triton kernels' + 1e-5. Returns {(head_dim, block): ok}."""
    verdict = {}
    for head_dim, blocks in candidates.items():
        for causal in (False, True):
            q, k, v, dout = (torch.randn(2, 768, h, head_dim, device="cuda",
                                         dtype=torch.bfloat16) for h in (8, 2, 2, 8))
            params = AttentionParams(head_dim ** -0.5, None, 0 if causal else None)
            out, lse = saved_forward(q, k, v, params)
            ref = reference_grads(q, k, v, dout, causal)
            base = _errors(ref, backward("triton", dout, q, k, v, out, lse, params)[:3])
            for block in blocks:
                for variant in variants:
                    try:
                        got = _errors(ref, backward(variant, dout, q, k, v, out, lse, params,
                                                    block)[:3])
                    except Exception as e:  # out of shared memory etc.
                        log(f"check d{head_dim} {block} {variant}: {type(e).__name__} "
                            f"{str(e)[:150]}")
                        verdict[(head_dim, str(block))] = False
                        continue
                    ok = all(g <= 2 * b + 1e-5 for g, b in zip(got, base, strict=True))
                    key = (head_dim, str(block))
                    verdict[key] = verdict.get(key, True) and ok
                    log(f"check d{head_dim} {'causal' if causal else 'full'} {block} {variant}:"
                        f" dq/dk/dv err {' '.join(f'{g:.2e}' for g in got)} (triton "
                        f"{' '.join(f'{b:.2e}' for b in base)}) {'OK' if ok else 'FAIL'}")
    return verdict


def sweep(log, verdict, rows, seqlen=4096, candidates=CANDIDATES, variant="gluon"):
    for head_dim, blocks in candidates.items():
        for causal in (False, True):
            q, k, v, dout = inputs(seqlen, head_dim, torch.bfloat16)
            params = AttentionParams(head_dim ** -0.5, None, 0 if causal else None)
            out, lse = saved_forward(q, k, v, params)
            f = flops(q.shape[0], q.shape[2], seqlen, head_dim, causal, "bwd")
            for block in blocks:
                if not verdict.get((head_dim, str(block))):
                    continue
                ms = bench(partial(backward, variant, dout, q, k, v, out, lse, params, block))
                rows.append(dict(head_dim=head_dim, causal=causal, seqlen=seqlen,
                                 block=block, variant=variant, ms=ms,
                                 tflops=f / ms * 1e-9))
                log(f"sweep d{head_dim} {'causal' if causal else 'full'} {block} {variant}: "
                    f"{ms:.3f} ms {f / ms * 1e-9:.0f} TFLOP/s")


def best_tiles(sweep_rows) -> dict:
    """{head_dim: tiles}: per kernel, the candidate with the least full + causal time."""
    total = {}
    for r in sweep_rows:
        key = (r["head_dim"], str(r["block"]))
        total[key] = (total.get(key, (0.0, r["block"]))[0] + r["ms"], r["block"])
    best = {}
    for (head_dim, _), (ms, tiles) in total.items():
        (kernel, tile), = tiles.items()
        if ms < best.get((head_dim, kernel), (float("inf"), None))[0]:
            best[(head_dim, kernel)] = (ms, tile)
    out = {}
    for (head_dim, kernel), (_, tile) in best.items():
        out.setdefault(head_dim, {})[kernel] = tile
    return out


def grid(log, seqlens, rows, deadline, variants, best):
    for seqlen in seqlens:
        for head_dim in (64, 128):
            for causal in (False, True):
                if time.time() > deadline:
                    log(f"budget spent: grid stops before s{seqlen} d{head_dim}")
                    return
                q, k, v, dout = inputs(seqlen, head_dim, torch.bfloat16)
                batch, nheads = q.shape[0], q.shape[2]
                params = AttentionParams(head_dim ** -0.5, None, 0 if causal else None)
                out, lse = saved_forward(q, k, v, params)
                f = flops(batch, nheads, seqlen, head_dim, causal, "bwd")
                row = dict(seqlen=seqlen, head_dim=head_dim, causal=causal, batch=batch,
                           nheads=nheads, dtype="bfloat16", ms={}, tflops={})
                for variant in variants:
                    try:
                        if variant in ("cudnn", "flash", "flex"):
                            ms = anchor(variant, q, k, v, dout, causal)[1]
                        else:
                            tiles = best.get(variant, {}).get(head_dim)
                            ms = bench(partial(backward, variant, dout, q, k, v, out, lse,
                                               params, tiles))
                    except Exception as e:  # an anchor that lacks this case is recorded
                        row.setdefault("errors", {})[variant] = f"{type(e).__name__}: {e}"[:200]
                        continue
                    row["ms"][variant] = ms
                    row["tflops"][variant] = f / ms * 1e-9
                if "cudnn" in row["ms"]:
                    row["vs_cudnn"] = {n: row["ms"]["cudnn"] / t for n, t in row["ms"].items()}
                for name in ("flash", "flex", "triton"):
                    if name in row["ms"] and "gluon" in row["ms"]:
                        row[f"gluon_vs_{name}"] = row["ms"][name] / row["ms"]["gluon"]
                for name in ("gluon_atomic", "gluon_atomic_best"):
                    if name in row["ms"] and "gluon" in row["ms"]:
                        row[f"{name}_vs_gluon"] = row["ms"]["gluon"] / row["ms"][name]
                rows.append(row)
                log(f"grid s{seqlen} d{head_dim} {'causal' if causal else 'full'}: "
                    + " ".join(f"{n} {t:.0f}" for n, t in row["tflops"].items())
                    + " | vs cudnn " + " ".join(f"{n} {r:.2f}" for n, r in
                                                row.get("vs_cudnn", {}).items()))
                del q, k, v, dout, out, lse
                torch.cuda.empty_cache()


RAGGED = [int(x) for x in torch.randint(1, 8193, (16,),
                                        generator=torch.Generator().manual_seed(0))]
VARLEN_SETS = {"2x8k": [8192] * 2, "8x2k": [2048] * 8, "ragged16": RAGGED}


def _packed(lengths, head_dim, causal):
    """Packed bf16 q, k, v, dout (tokens, nheads, d) of `lengths` and their varlen params."""
    nheads, tokens = 2048 // head_dim, sum(lengths)
    q, k, v, dout = (torch.randn(tokens, nheads, head_dim, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    params = AttentionParams(head_dim ** -0.5, None, 0 if causal else None, cu_seqlens_q=cu,
                             cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                             max_seqlen_k=max(lengths))
    return q, k, v, dout, params


def varlen(log, rows, head_dims, sets=tuple(VARLEN_SETS)):
    """Gluon varlen backward against dense / padded and the Triton varlen kernels, cuDNN as
    the anchor (see the module docstring), for the VARLEN_SETS named in `sets`."""
    for head_dim in head_dims:
        for label in sets:
            lengths = VARLEN_SETS[label]
            for causal in (False, True):
                q, k, v, dout, params = _packed(lengths, head_dim, causal)
                out, lse = saved_forward(q, k, v, params)
                tokens, longest = sum(lengths), max(lengths)
                row = dict(set=label, lengths=lengths, head_dim=head_dim, causal=causal,
                           tokens=tokens, ms={})
                try:
                    gluon = backward("gluon", dout, q, k, v, out, lse, params)
                    torch.cuda.synchronize()
                    triton_ = backward("triton", dout, q, k, v, out, lse, params)
                    row["max_diff_vs_triton"] = [(a.float() - b.float()).abs().max().item()
                                                 for a, b in zip(gluon[:3], triton_[:3],
                                                                 strict=True)]
                    row["ms"]["varlen_gluon"] = bench(partial(backward, "gluon", dout, q, k, v,
                                                              out, lse, params))
                    row["ms"]["varlen_triton"] = bench(partial(backward, "triton", dout, q, k,
                                                               v, out, lse, params))
                except Exception as e:
                    log(f"varlen {label} d{head_dim} causal={causal}: {type(e).__name__} "
                        f"{str(e)[:300]}")
                    raise
                dense = [torch.zeros(len(lengths), longest, *x.shape[1:], dtype=x.dtype,
                                     device="cuda") for x in (q, k, v, dout)]
                starts = params.cu_seqlens_q.tolist()[:-1]
                for b, (start, n) in enumerate(zip(starts, lengths, strict=True)):
                    for d, x in zip(dense, (q, k, v, dout), strict=True):
                        d[b, :n] = x[start:start + n]
                dense_params = AttentionParams(head_dim ** -0.5, None, 0 if causal else None)
                out_d, lse_d = saved_forward(*dense[:3], dense_params)
                row["ms"]["dense_gluon"] = bench(partial(backward, "gluon", dense[3], *dense[:3],
                                                         out_d, lse_d, dense_params))
                row["ms"]["cudnn_dense"] = anchor("cudnn", *dense[:3], dense[3], causal)[1]
                row["bwd_tokens_per_s"] = {n: tokens / ms * 1e3 for n, ms in row["ms"].items()}
                row["varlen_gluon_over_dense"] = row["ms"]["varlen_gluon"] / row["ms"][
                    "dense_gluon"]
                row["cudnn_over_varlen_gluon"] = row["ms"]["cudnn_dense"] / row["ms"][
                    "varlen_gluon"]
                rows.append(row)
                log(f"varlen {label} d{head_dim} {'causal' if causal else 'full'}: "
                    + " ".join(f"{n} {ms:.3f}ms" for n, ms in row["ms"].items())
                    + f" | varlen/dense {row['varlen_gluon_over_dense']:.3f}"
                    + " | diff vs triton "
                    + " ".join(f"{x:.1e}" for x in row["max_diff_vs_triton"]))
                del q, k, v, dout, out, lse, dense, out_d, lse_d
                torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--variants", default="gluon,triton,cudnn,flash,flex")
    ap.add_argument("--check-variants", default="gluon,gluon_atomic")
    ap.add_argument("--atomic-sweep", action="store_true",
                    help="check and sweep ATOMIC_CANDIDATES on the reduce-add dQ path")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds before the grid stops")
    ap.add_argument("--parts", default="check,sweep,grid")
    ap.add_argument("--varlen-head-dims", default="128")
    ap.add_argument("--varlen-sets", default=",".join(VARLEN_SETS))
    args = ap.parse_args()
    parts = args.parts.split(",")
    start = time.time()
    os.makedirs(args.out, exist_ok=True)

    def log(msg):
        print(f"[{time.time() - start:6.1f}s] {msg}", flush=True)

    result = dict(env=environment(), hopper_backward=hop_mod.HOPPER_BACKWARD,
                  hopper_backward_dq=hop_mod.HOPPER_BACKWARD_DQ, sweep=[], grid=[], varlen=[])
    verdict = (check(log, args.check_variants.split(","))
               if "check" in parts and args.check_variants else {})
    result["check"] = [dict(head_dim=d, block=b, ok=ok) for (d, b), ok in verdict.items()]
    if "sweep" in parts and not args.skip_sweep:
        sweep(log, verdict, result["sweep"])
    best = {"gluon_best": best_tiles(result["sweep"])}
    if args.atomic_sweep:
        atomic_verdict = check(log, ["gluon_atomic"], ATOMIC_CANDIDATES)
        result["check"] += [dict(head_dim=d, block=b, ok=ok, variant="gluon_atomic")
                            for (d, b), ok in atomic_verdict.items()]
        atomic_rows = []
        sweep(log, atomic_verdict, atomic_rows, candidates=ATOMIC_CANDIDATES,
              variant="gluon_atomic")
        result["sweep"] += atomic_rows
        best["gluon_atomic_best"] = best_tiles(atomic_rows)
    result["best_tiles"] = {v: {str(d): t for d, t in b.items()} for v, b in best.items()}
    if "grid" in parts:
        log(f"best tiles {best}")
        grid(log, [int(s) for s in args.seqlens.split(",")], result["grid"],
             start + args.budget, args.variants.split(","), best)
    if "varlen" in parts:
        varlen(log, result["varlen"], [int(d) for d in args.varlen_head_dims.split(",")],
               args.varlen_sets.split(","))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")
    path = os.path.join(args.out, f"backward_{stamp}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
