"""One device call for the Gluon forward (issues 3 and 4): per cell of the grid (head dim,
seqlen, causal) its candidate schedules next to cuDNN, FA2 and FlexAttention measured in the same
process (forward only: the backward has its own bench), and the feature costs at d128 8k.
Every candidate's output is compared with the Triton kernel's on the cell's inputs.

    PYTHONPATH=src python3 benchmarks/bench_speed.py --out DIR [--seqlens ...] [--head-dims ...]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_triton import anchor_flex_compiled, bench, environment, flops, inputs  # noqa: E402

from flashkit.ops.params import AttentionParams  # noqa: E402
from flashkit.ops.triton.configs import SM90, gluon_forward_tile  # noqa: E402

fwd_mod = importlib.import_module("flashkit.ops.triton.forward")
hop_mod = importlib.import_module("flashkit.ops.triton.forward_hopper")

# (BLOCK_N, NUM_STAGES, CONSUMERS, SPECIALIZED, PINGPONG, PERSISTENT) measured in every cell
# besides the configured one (--candidates persistent: the persistent grid against the
# specialized tiles it would replace).
CANDIDATES = {
    256: [(64, 2, 2, True, True, False), (64, 2, 2, True, False, False),
          (32, 4, 2, True, True, False), (64, 2, 1, False, False, False)],
    128: [(64, 3, 1, False, False, False), (128, 2, 2, True, True, False),
          (64, 2, 1, True, False, False), (64, 3, 1, True, False, False),
          (64, 2, 2, True, True, False)],
    64: [(128, 2, 1, False, False, False), (128, 2, 3, True, True, False),
         (128, 2, 1, True, False, False), (128, 2, 2, True, True, False)],
}
PERSISTENT_CANDIDATES = {
    128: [(128, 2, 2, True, True, False), (128, 2, 2, True, True, True),
          (64, 2, 1, True, False, True)],
    64: [(128, 2, 3, True, True, False), (128, 2, 3, True, True, True),
         (128, 2, 2, True, True, True), (128, 2, 1, True, False, True)],
}


def params_for(head_dim, causal, **features):
    return AttentionParams(head_dim ** -0.5, None, 0 if causal else None, **features)


def anchor_fwd(name, q, k, v, causal):
    """Forward ms of one PyTorch anchor on (b, h, s, d) copies of the inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = anchor_flex_compiled(flex_attention)
        seqlen = qh.shape[2]
        mask = (create_block_mask(lambda b, h, i, j: j <= i, None, None, seqlen, seqlen)
                if causal else None)
        return bench(lambda: flex(qh, kh, vh, block_mask=mask))
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]

    def run():
        with sdpa_kernel(backend):
            return sdpa(qh, kh, vh, is_causal=causal)

    return bench(run)


def _compile_one(job):
    """Run one Gluon forward variant (head_dim, causal, tile) at a small size: its kernel lands
    in Triton's cache (the same specialization as the grid's: lengths multiples of 128)."""
    head_dim, causal, tile = job
    q, k, v = (torch.randn(1, 256, 2048 // head_dim, head_dim, dtype=torch.bfloat16,
                           device="cuda") for _ in range(3))
    try:
        hop_mod.attention_forward(q, k, v, params_for(head_dim, causal), tile=tile)
        fwd_mod.attention_forward(q, k, v, params_for(head_dim, causal),
                                  tile=SM90["forward"][head_dim])
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported again (and logged) by the grid
        return f"{job}: {type(e).__name__}"


def precompile(log, head_dims, seqlens, workers):
    """Compile every variant of the grid in parallel processes first, so the timed grid (one
    process) finds them in the cache instead of compiling ~40 kernels one after another."""
    import multiprocessing

    jobs = {(d, causal, tile) for d in head_dims for causal in (False, True)
            for tile in CANDIDATES[d] + [gluon_forward_tile(d, s, causal) for s in seqlens]}
    start = time.time()
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        failed = [r for r in pool.map(_compile_one, sorted(jobs)) if r]
    log(f"precompiled {len(jobs)} variants in {time.time() - start:.0f} s; failed: {failed}")


def grid(log, rows, head_dims, seqlens, anchors, modes=(False, True)):
    for head_dim in head_dims:
        for seqlen in seqlens:
            for causal in modes:
                q, k, v, _ = inputs(seqlen, head_dim, torch.bfloat16)
                params = params_for(head_dim, causal)
                f = flops(q.shape[0], q.shape[2], seqlen, head_dim, causal, "fwd")
                ref, _ = fwd_mod.attention_forward(q, k, v, params,
                                                   tile=SM90["forward"][head_dim])
                configured = gluon_forward_tile(head_dim, seqlen, causal)
                variants = {"ours": configured}
                for tile in CANDIDATES[head_dim]:
                    if tile != configured:
                        variants[str(tile)] = tile
                ms, errs = {}, {}
                for name, tile in variants.items():
                    run = partial(hop_mod.attention_forward, q, k, v, params, tile=tile)
                    try:
                        errs[name] = (run()[0].float() - ref.float()).abs().max().item()
                        ms[name] = bench(run)
                    except Exception as e:  # out of shared memory etc.
                        log(f"{name}: {type(e).__name__} {str(e)[:120]}")
                for name in anchors:
                    ms[name] = anchor_fwd(name, q, k, v, causal)
                tf = {n: f / t * 1e-9 for n, t in ms.items()}
                ratios = {n: tf["ours"] / tf[n] for n in anchors}
                best = max((n for n in tf if n not in anchors), key=tf.get)
                rows.append(dict(head_dim=head_dim, seqlen=seqlen, causal=causal,
                                 tile=configured, tflops=tf, ours_over=ratios, best=best,
                                 max_diff_vs_triton=errs))
                log(f"grid d{head_dim} s{seqlen} {'causal' if causal else 'full  '} "
                    f"ours {configured} {tf['ours']:.0f} "
                    + " ".join(f"{n} {tf[n]:.0f} -> {ratios[n]:.2f}x" for n in anchors)
                    + f" | best {best} {tf[best]:.0f} | "
                    + " ".join(f"{n} {tf[n]:.0f}" for n in variants if n != "ours" and n in tf)
                    + f" | max err {max(errs.values()):.1e}")
                del q, k, v, ref
                torch.cuda.empty_cache()


def features(log, rows, seqlen=8192, head_dim=128):
    """Issue 4: each feature's forward time over the plain kernel's (d128, 8k, bf16); causal
    ones over the causal kernel's. The window does less work: its time only. dropout_triton:
    forward.py's kernel (a tile forces it), the path dropout took before."""
    q, k, v, _ = inputs(seqlen, head_dim, torch.bfloat16)
    nheads = q.shape[2]
    slopes = torch.rand(nheads, device="cuda") * 0.3
    sink = torch.randn(nheads, device="cuda")
    drop = dict(dropout_p=0.1, dropout_seed=1234)
    cases = [("plain", {}, None), ("causal", dict(window_right=0), None),
             ("alibi", dict(alibi_slopes=slopes), "plain"),
             ("alibi_causal", dict(window_right=0, alibi_slopes=slopes), "causal"),
             ("softcap", dict(softcap=30.0), "plain"), ("sink", dict(sink=sink), "plain"),
             ("dropout", drop, "plain"), ("dropout_causal", dict(window_right=0, **drop), "causal"),
             ("dropout_one_warpgroup", drop, "plain"), ("dropout_triton", drop, "plain"),
             ("causal_alibi_softcap_sink",
              dict(window_right=0, alibi_slopes=slopes, softcap=30.0, sink=sink), "causal"),
             ("window_1024_0", dict(window_left=1024, window_right=0), None)]
    ms = {}
    for name, extra, base in cases:
        params = AttentionParams(head_dim ** -0.5, **extra)
        if name.endswith("_triton"):
            run = partial(fwd_mod.attention_forward, q, k, v, params,
                          tile=SM90["forward"][head_dim])
        else:
            assert hop_mod.eligible(q, k, v, params, None, None, None), name
            tile = (64, 3, 1, False, False, False) if name.endswith("_one_warpgroup") else None
            run = partial(hop_mod.attention_forward, q, k, v, params, tile=tile)
        ms[name] = bench(run)
        cost = ms[name] / ms[base] if base else None
        rows.append(dict(feature=name, seqlen=seqlen, head_dim=head_dim, ms=ms[name], cost=cost,
                         tile=gluon_forward_tile(head_dim, seqlen, "window_right" in extra)))
        log(f"feature {name}: {ms[name]:.3f} ms" + (f", {cost:.2f}x of {base}" if cost else ""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--skip-grid", action="store_true")
    ap.add_argument("--skip-features", action="store_true")
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--anchors", default="cudnn,flash,flex")
    ap.add_argument("--precompile", type=int, default=0, help="processes compiling the grid's "
                    "variants first (0: none)")
    ap.add_argument("--tag", default="", help="appended to the result file's name")
    ap.add_argument("--modes", default="full,causal", help="comma-separated: full, causal")
    ap.add_argument("--candidates", choices=("tiles", "persistent"), default="tiles")
    args = ap.parse_args()
    if args.candidates == "persistent":
        CANDIDATES.update(PERSISTENT_CANDIDATES)
    env = environment()
    stamp = time.strftime("%Y%m%d_%H%M", time.gmtime())
    path = os.path.join(args.out, f"speed_{stamp}{args.tag}.json")
    lines, rows, feature_rows = [], [], []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)
        json.dump({"env": env, "log": lines, "grid": rows, "features": feature_rows,
                   "candidates": {str(d): c for d, c in CANDIDATES.items()}},
                  open(path, "w"), indent=1)

    log(str(env))
    if not args.skip_features:
        features(log, feature_rows)
    head_dims = [int(d) for d in args.head_dims.split(",")]
    seqlens = [int(s) for s in args.seqlens.split(",")]
    if args.precompile:
        precompile(log, head_dims, seqlens, args.precompile)
    if not args.skip_grid:
        grid(log, rows, head_dims, seqlens, args.anchors.split(","),
             [mode == "causal" for mode in args.modes.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
