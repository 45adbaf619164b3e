"""One device call for the speed work of issue 3: correctness of the Gluon forward against the
Triton kernel and an fp32 reference, a sweep of Gluon forward blocks and of dK/dV tiles, then a
grid of forward/backward against cuDNN and FA2 measured in the same process.

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
from bench_triton import anchor, bench, environment, flops, inputs  # noqa: E402

from flashkit.ops.params import AttentionParams  # noqa: E402

fwd_mod = importlib.import_module("flashkit.ops.triton.forward")
bwd_mod = importlib.import_module("flashkit.ops.triton.backward")
hop_mod = importlib.import_module("flashkit.ops.triton.forward_hopper")
from flashkit.ops.triton.configs import HOPPER  # noqa: E402


def params_for(head_dim, causal, fp32_out=False):
    return AttentionParams(head_dim ** -0.5, None, 0 if causal else None, fp32_out=fp32_out)


def reference(q, k, v, causal):
    """fp32 math attention in (b, s, h, d), GQA by repeating kv heads; (out, lse)."""
    group = q.shape[2] // k.shape[2]
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    s = qf @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), -torch.inf)
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1) @ vf).transpose(1, 2), lse


def check(log):
    """Gluon forward vs the Triton kernel: both against the fp32 reference."""
    ok = True
    bf16, fp16 = torch.bfloat16, torch.float16
    cases = [(2, 1024, 16, 16, 128, False, bf16), (2, 1024, 16, 16, 128, True, bf16),
             (1, 2048, 32, 32, 64, True, bf16), (3, 384, 8, 8, 64, False, fp16),
             (2, 512, 8, 2, 128, True, fp16), (1, 128, 4, 4, 128, True, bf16),
             (2, 640, 4, 1, 64, True, bf16)]
    for b, s, h, hk, d, causal, dtype in cases:
        q = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
        k = torch.randn(b, s, hk, d, device="cuda", dtype=dtype)
        v = torch.randn(b, s, hk, d, device="cuda", dtype=dtype)
        for fp32_out in (False, True):
            params = params_for(d, causal, fp32_out)
            assert hop_mod.eligible(q, k, v, params, None, None, None)
            ref_o, ref_l = reference(q, k, v, causal)
            o_g, l_g = fwd_mod.attention_forward(q, k, v, params)  # dispatches to Gluon
            o_t, l_t = fwd_mod.attention_forward(q, k, v, params,
                                                 tile=HOPPER["forward"][d])  # Triton kernel
            err = lambda o, r: (o.float() - r).abs().max().item()
            e_g, e_t = err(o_g, ref_o), err(o_t, ref_o)
            el_g, el_t = err(l_g, ref_l), err(l_t, ref_l)
            good = e_g <= 2 * e_t + 1e-5 and el_g <= 2 * el_t + 1e-5 and torch.isfinite(o_g).all()
            ok &= bool(good)
            log(f"check b{b} s{s} h{h}/{hk} d{d} {'causal' if causal else 'full'} {dtype} "
                f"fp32_out={fp32_out}: out err gluon {e_g:.2e} triton {e_t:.2e}, lse err "
                f"{el_g:.2e} / {el_t:.2e} {'OK' if good else 'FAIL'}")
    return ok


def sweep(log, results):
    for head_dim in (64, 128):
        for causal in (False, True):
            q, k, v, dout = inputs(4096, head_dim, torch.bfloat16)
            params = params_for(head_dim, causal)
            batch, nheads = q.shape[0], q.shape[2]
            f = flops(batch, nheads, 4096, head_dim, causal, "fwd")
            ms = bench(partial(fwd_mod.attention_forward, q, k, v, params,
                               tile=HOPPER["forward"][head_dim]))
            log(f"sweep fwd d{head_dim} {causal} triton {HOPPER['forward'][head_dim]}: "
                f"{f / ms * 1e-9:.1f}")
            results.append(dict(kind="fwd_triton", head_dim=head_dim, causal=causal, ms=ms))
            blocks = {128: [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 4)],
                      64: [(64, 128, 4, 3), (64, 128, 4, 2), (64, 64, 4, 3),
                           (64, 64, 4, 4)]}[head_dim]
            for block in blocks:
                try:
                    ms = bench(partial(hop_mod.attention_forward, q, k, v, params, block=block))
                except Exception as e:  # out of shared memory etc.
                    log(f"sweep fwd gluon {block}: {type(e).__name__} {str(e)[:100]}")
                    continue
                log(f"sweep fwd d{head_dim} {causal} gluon {block}: {f / ms * 1e-9:.1f}")
                results.append(dict(kind="fwd_gluon", block=block, head_dim=head_dim,
                                    causal=causal, ms=ms))
            out, lse = fwd_mod.attention_forward(q, k, v, params)
            fb = flops(batch, nheads, 4096, head_dim, causal, "bwd")
            tiles = {128: [(64, 128, 8, 3)], 64: [(32, 128, 4, 3)]}[head_dim]
            for tile in tiles:
                ms = bench(partial(bwd_mod.attention_backward, dout, q, k, v, out, lse, params,
                                   tiles={"dkdv": tile}))
                log(f"sweep bwd d{head_dim} {causal} dkdv {tile}: {fb / ms * 1e-9:.1f}")
                results.append(dict(kind="bwd_dkdv", tile=tile, head_dim=head_dim,
                                    causal=causal, ms=ms))
            del q, k, v, dout, out, lse
            torch.cuda.empty_cache()


def best(results, kind, key, head_dim, causal, default):
    """The fastest `key` of one sweep kind at (head_dim, causal), else default."""
    rows = [r for r in results if r["kind"] == kind and r["head_dim"] == head_dim
            and r["causal"] == causal]
    return tuple(min(rows, key=lambda r: r["ms"])[key]) if rows else default


def grid(log, rows, seqlens, anchors, results):
    for head_dim in (64, 128):
        for seqlen in seqlens:
            for causal in (False, True):
                q, k, v, dout = inputs(seqlen, head_dim, torch.bfloat16)
                batch, nheads = q.shape[0], q.shape[2]
                params = params_for(head_dim, causal)
                block = best(results, "fwd_gluon", "block", head_dim, causal,
                             hop_mod.HOPPER_FORWARD[head_dim])
                tiles = {"dkdv": best(results, "bwd_dkdv", "tile", head_dim, causal,
                                      HOPPER["dkdv"][head_dim])}
                out, lse = fwd_mod.attention_forward(q, k, v, params)
                t = {"ours": (bench(partial(hop_mod.attention_forward, q, k, v, params,
                                            block=block)),
                              bench(partial(bwd_mod.attention_backward, dout, q, k, v, out, lse,
                                            params, tiles=tiles))),
                     "triton_fwd": (bench(partial(fwd_mod.attention_forward, q, k, v, params,
                                                  tile=HOPPER["forward"][head_dim])), None)}
                for name in anchors:
                    t[name] = anchor(name, q, k, v, dout, causal)
                tf = {n: [flops(batch, nheads, seqlen, head_dim, causal, d) / ms * 1e-9
                          if ms else None for d, ms in zip(("fwd", "bwd"), v_, strict=True)]
                      for n, v_ in t.items()}
                row = dict(head_dim=head_dim, seqlen=seqlen, causal=causal, tflops=tf,
                           gluon_block=block, dkdv_tile=tiles["dkdv"])
                rows.append(row)
                c = tf["cudnn"]
                mask = "causal" if causal else "full  "
                log(f"grid {block} {tiles['dkdv']} d{head_dim} s{seqlen} {mask} "
                    f"ours {tf['ours'][0]:.0f}/{tf['ours'][1]:.0f} (triton fwd "
                    f"{tf['triton_fwd'][0]:.0f}) cudnn {c[0]:.0f}/{c[1]:.0f} -> "
                    f"{tf['ours'][0] / c[0]:.2f}x/{tf['ours'][1] / c[1]:.2f}x; fa2 "
                    f"{tf['flash'][0]:.0f}/{tf['flash'][1]:.0f}")
                del q, k, v, dout, out, lse
                torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--skip-grid", action="store_true")
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--anchors", default="cudnn,flash")
    args = ap.parse_args()
    env = environment()
    stamp = time.strftime("%Y%m%d_%H%M", time.gmtime())
    path = os.path.join(args.out, f"speed_{stamp}.json")
    lines, results, rows = [], [], []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)
        json.dump({"env": env, "log": lines, "sweep": results, "grid": rows}, open(path, "w"),
                  indent=1)

    log(str(env))
    if not check(log):
        log("CHECK FAILED: Gluon forward disagrees with the reference")
        return 1
    if not args.skip_sweep:
        sweep(log, results)
    if not args.skip_grid:
        grid(log, rows, [int(s) for s in args.seqlens.split(",")], args.anchors.split(","),
             results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
