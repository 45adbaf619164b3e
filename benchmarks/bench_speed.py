"""One device call for the Gluon forward (issue 3): a sweep of its tiles/schedules at one seqlen,
then a grid of forward TFLOP/s against cuDNN, FA2 and FlexAttention measured in the same process
(forward only: the backward has its own bench) and the feature costs of issue 4 at d128 8k,
both with the configured tiles (configs.GLUON_FORWARD_TILES).

    PYTHONPATH=src python3 benchmarks/bench_speed.py --out DIR [--skip-sweep] [--seqlens ...]
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
from flashkit.ops.triton.configs import GLUON_FORWARD_TILES, HOPPER  # noqa: E402

fwd_mod = importlib.import_module("flashkit.ops.triton.forward")
hop_mod = importlib.import_module("flashkit.ops.triton.forward_hopper")

# (BLOCK_N, NUM_STAGES, CONSUMERS, SPECIALIZED, PINGPONG); the first is session 2's kernel.
SWEEP = {
    128: [(64, 3, 1, False, False), (128, 2, 1, False, False), (64, 3, 1, True, False),
          (128, 2, 2, True, False), (128, 2, 2, True, True), (64, 3, 2, True, True),
          (64, 4, 2, True, True), (128, 3, 2, True, True)],
    64: [(128, 2, 1, False, False), (128, 3, 1, False, False), (128, 2, 1, True, False),
         (128, 2, 2, True, False), (128, 2, 2, True, True), (128, 3, 2, True, True),
         (128, 4, 2, True, True)],
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


def sweep(log, results, seqlen, head_dims):
    for head_dim in head_dims:
        for causal in (False, True):
            q, k, v, _ = inputs(seqlen, head_dim, torch.bfloat16)
            params = params_for(head_dim, causal)
            f = flops(q.shape[0], q.shape[2], seqlen, head_dim, causal, "fwd")
            ref, _ = fwd_mod.attention_forward(q, k, v, params, tile=HOPPER["forward"][head_dim])
            cudnn = f / anchor_fwd("cudnn", q, k, v, causal) * 1e-9
            line = [f"sweep d{head_dim} s{seqlen} {'causal' if causal else 'full'} "
                    f"cudnn {cudnn:.0f}:"]
            for tile in SWEEP[head_dim]:
                try:
                    out, _ = hop_mod.attention_forward(q, k, v, params, tile=tile)
                    err = (out.float() - ref.float()).abs().max().item()
                    ms = bench(partial(hop_mod.attention_forward, q, k, v, params, tile=tile))
                except Exception as e:  # out of shared memory etc.
                    log(f"sweep {tile}: {type(e).__name__} {str(e)[:120]}")
                    continue
                tf = f / ms * 1e-9
                line.append(f"{tile} {tf:.0f} ({tf / cudnn:.2f}x, err {err:.1e})")
                results.append(dict(head_dim=head_dim, seqlen=seqlen, causal=causal,
                                    tile=tile, ms=ms, tflops=tf, cudnn_tflops=cudnn,
                                    max_diff_vs_triton=err))
            log(" | ".join(line))
            del q, k, v
            torch.cuda.empty_cache()


def grid(log, rows, seqlens, anchors):
    for head_dim in (128, 64):
        tile = GLUON_FORWARD_TILES[head_dim]
        for seqlen in seqlens:
            for causal in (False, True):
                q, k, v, _ = inputs(seqlen, head_dim, torch.bfloat16)
                params = params_for(head_dim, causal)
                f = flops(q.shape[0], q.shape[2], seqlen, head_dim, causal, "fwd")
                ms = {"ours": bench(partial(hop_mod.attention_forward, q, k, v, params,
                                            tile=tile)),
                      "triton_fwd": bench(partial(fwd_mod.attention_forward, q, k, v, params,
                                                  tile=HOPPER["forward"][head_dim]))}
                for name in anchors:
                    ms[name] = anchor_fwd(name, q, k, v, causal)
                tf = {n: f / t * 1e-9 for n, t in ms.items()}
                ratios = {n: tf["ours"] / tf[n] for n in anchors}
                rows.append(dict(head_dim=head_dim, seqlen=seqlen, causal=causal, tile=tile,
                                 tflops=tf, ours_over=ratios))
                log(f"grid {tile} d{head_dim} s{seqlen} {'causal' if causal else 'full  '} "
                    f"ours {tf['ours']:.0f} (triton {tf['triton_fwd']:.0f}) "
                    + " ".join(f"{n} {tf[n]:.0f} -> {ratios[n]:.2f}x" for n in anchors))
                del q, k, v
                torch.cuda.empty_cache()


def features(log, rows, tile, seqlen=8192, head_dim=128):
    """Issue 4: each feature's forward time over the plain kernel's (d128, 8k, bf16); causal
    ones over the causal kernel's. The window does less work: its time only."""
    q, k, v, _ = inputs(seqlen, head_dim, torch.bfloat16)
    nheads = q.shape[2]
    slopes = torch.rand(nheads, device="cuda") * 0.3
    sink = torch.randn(nheads, device="cuda")
    cases = [("plain", {}, None), ("causal", dict(window_right=0), None),
             ("alibi", dict(alibi_slopes=slopes), "plain"),
             ("softcap", dict(softcap=30.0), "plain"), ("sink", dict(sink=sink), "plain"),
             ("causal_alibi_softcap_sink",
              dict(window_right=0, alibi_slopes=slopes, softcap=30.0, sink=sink), "causal"),
             ("window_1024_0", dict(window_left=1024, window_right=0), None)]
    ms = {}
    for name, extra, base in cases:
        params = AttentionParams(head_dim ** -0.5, **extra)
        assert hop_mod.eligible(q, k, v, params, None, None, None), name
        ms[name] = bench(partial(hop_mod.attention_forward, q, k, v, params, tile=tile))
        cost = ms[name] / ms[base] if base else None
        rows.append(dict(feature=name, seqlen=seqlen, head_dim=head_dim, tile=tile,
                         ms=ms[name], cost=cost))
        log(f"feature {name} {tile}: {ms[name]:.3f} ms"
            + (f", {cost:.2f}x of {base}" if cost else ""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--skip-grid", action="store_true")
    ap.add_argument("--skip-features", action="store_true")
    ap.add_argument("--sweep-seqlen", type=int, default=4096)
    ap.add_argument("--sweep-head-dims", default="128,64")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--anchors", default="cudnn,flash,flex")
    args = ap.parse_args()
    env = environment()
    stamp = time.strftime("%Y%m%d_%H%M", time.gmtime())
    path = os.path.join(args.out, f"speed_{stamp}.json")
    lines, results, rows, feature_rows = [], [], [], []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)
        json.dump({"env": env, "log": lines, "sweep": results, "grid": rows,
                   "features": feature_rows}, open(path, "w"), indent=1)

    log(str(env))
    if not args.skip_sweep:
        sweep(log, results, args.sweep_seqlen,
              [int(d) for d in args.sweep_head_dims.split(",")])
    if not args.skip_features:
        features(log, feature_rows, GLUON_FORWARD_TILES[128])
    if not args.skip_grid:
        grid(log, rows, [int(s) for s in args.seqlens.split(",")], args.anchors.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
