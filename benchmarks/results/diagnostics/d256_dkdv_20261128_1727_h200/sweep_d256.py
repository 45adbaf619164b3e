"""Tile sweep of the head dim 256 Gluon dK/dV kernel: the whole backward (Gluon dQ, then dK/dV)
through backward.attention_backward, bf16, batch 4, 8 heads, 4096 tokens, full and causal; and
the whole portable backward (gluon=False) for comparison.

    PYTHONPATH=src python3 sweep_d256.py OUT.json
"""

import functools
import importlib
import json
import sys

import torch
import triton

from flashkit.ops import triton as triton_backend
from flashkit.ops.params import AttentionParams

backward = importlib.import_module("flashkit.ops.triton.backward")
TILES = [(64, 64, 8, 2), (64, 64, 8, 1), (128, 64, 8, 1), (32, 64, 8, 2), (32, 64, 8, 3)]


def tflops(fn, flops: float) -> float:
    return round(flops / triton.testing.do_bench(fn, warmup=10, rep=100) / 1e9, 1)


def main(path: str) -> None:
    results = {}
    batch, seqlen, nheads, head_dim = 4, 4096, 8, 256
    for causal in (False, True):
        q, k, v, dout = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda",
                                     dtype=torch.bfloat16) for _ in range(4))
        params = AttentionParams(head_dim ** -0.5, None, 0 if causal else None)
        out, lse = triton_backend.forward(q, k, v, params)
        flops = 2.5 * 4 * batch * nheads * seqlen ** 2 * head_dim / (2 if causal else 1)
        run = functools.partial(backward.attention_backward, dout, q, k, v, out, lse, params)
        for tile in TILES:
            key = f"{causal} {tile}"
            try:
                results[key] = tflops(functools.partial(run, gluon=True, tiles={"hopper": tile}),
                                      flops)
            except Exception as exc:  # a tile that does not compile: report, keep sweeping
                results[key] = f"ERR {type(exc).__name__}: {str(exc)[:200]}"
            print(key, results[key], flush=True)
        results[f"{causal} portable"] = tflops(functools.partial(run, gluon=False), flops)
        print(causal, "portable", results[f"{causal} portable"], flush=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
