"""The float8 Gluon forward against the portable float8 kernel, e4m3, batch 1, 16384 tokens,
heads = 2048 / d, per-head descales, forward only, do_bench medians in TFLOP/s:

    PYTHONPATH=src python3 fp8_time.py
"""

import json

import torch
from triton.testing import do_bench

from flashkit import fp8
from flashkit.ops.params import AttentionParams
from flashkit.ops.triton import forward_fp8, forward_hopper


def quantized(seqlen, nheads, head_dim):
    x = torch.randn(1, seqlen, nheads, head_dim, device="cuda")
    return fp8.quantize(x, per_head=True, dtype=torch.float8_e4m3fn)


def main():
    seqlen = 16384
    for head_dim in (64, 128, 256):
        nheads = 2048 // head_dim
        for causal in (False, True):
            (q8, qd), (k8, kd), (v8, vd) = (quantized(seqlen, nheads, head_dim)
                                            for _ in range(3))
            params = AttentionParams(softmax_scale=head_dim ** -0.5,
                                     window_right=0 if causal else None)
            descale = forward_fp8.descale_pairs(q8, v8, qd, kd, vd)
            flops = 4 * seqlen * seqlen * nheads * head_dim / (2 if causal else 1)
            gluon = (q8, k8, v8, params, descale)
            portable = (q8, k8, v8, params, qd, kd, vd)
            gluon_ms = do_bench(lambda a=gluon: forward_hopper.attention_forward_fp8(*a),
                                warmup=50, rep=300)
            portable_ms = do_bench(lambda a=portable: forward_fp8.attention_forward(*a),
                                   warmup=50, rep=300)
            print(json.dumps(dict(d=head_dim, causal=causal,
                                  gluon_tflops=flops / gluon_ms / 1e9,
                                  portable_tflops=flops / portable_ms / 1e9)), flush=True)


if __name__ == "__main__":
    main()
