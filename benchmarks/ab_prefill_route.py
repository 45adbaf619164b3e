"""The kvcache prefill route against the dense forward on the same work, kernel by kernel, in
rotating order (issue 5: 2k queries after a long cache, where bench_prefill.py measures the
route 3-17% slower than flash_attn_func while their sm_90 kernels compile to the same per-tile
code, decode_NOTES.md "Prefill route vs dense at 2k").

    PYTHONPATH=src python benchmarks/ab_prefill_route.py --out results/x.json [--rounds 4]

bf16 d128, 32 query heads, batch 1, causal (bottom-right), 2048 queries over 6144 / 18432 keys,
GQA 8:1 and 1:1. Variants, each eager ms (do_bench median, L2 flushed), measured once per round
in an order rotated by one each round, so that a drift of the GPU's clocks within a cell (bench
order) shows as a spread across rounds instead of a gap between variants:
  dense         flash_attn_func(q, k, v, causal=True)
  route         flash_attn_with_kvcache(q, k, v, cache_seqlens=tensor, causal=True), route forced
  dense_kernel  forward_hopper.attention_forward on the dense q, k, v (the one Gluon kernel)
  route_kernel  the same kernel as the route launches it: varlen views, seqused_k, same tile
  varlen_kernel varlen views with cu_seqlens_k = [0, seqlen_k] and no seqused_k
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from bench_decode import bench_rotating, environment, gluon_prefill_thresholds

from flashkit.api import flash_attn_func
from flashkit.kvcache import flash_attn_with_kvcache
from flashkit.ops.params import AttentionParams
from flashkit.ops.triton import forward_hopper
from flashkit.ops.triton.configs import gluon_forward_tile

NHEADS, HEAD_DIM, DTYPE, SEQLEN_Q = 32, 128, torch.bfloat16, 2048


def variants(seqlen_k: int, nheads_k: int) -> dict:
    """name -> a call, all on the same q, k, v."""
    q = torch.randn(1, SEQLEN_Q, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    k, v = (torch.randn(1, seqlen_k, nheads_k, HEAD_DIM, dtype=DTYPE, device="cuda")
            for _ in range(2))
    lens = torch.full((1,), seqlen_k, dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0, SEQLEN_Q], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, seqlen_k], dtype=torch.int32, device="cuda")
    tile = gluon_forward_tile(HEAD_DIM, SEQLEN_Q, True)
    dense = AttentionParams(HEAD_DIM ** -0.5, None, 0)
    varlen = AttentionParams(HEAD_DIM ** -0.5, None, 0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             max_seqlen_q=SEQLEN_Q, max_seqlen_k=seqlen_k)
    packed = [x.view(-1, *x.shape[2:]) for x in (q, k, v)]

    def route():
        with gluon_prefill_thresholds(0, 0):
            return flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True)

    return {
        "dense": lambda: flash_attn_func(q, k, v, causal=True),
        "route": route,
        "dense_kernel": lambda: forward_hopper.attention_forward(q, k, v, dense, tile=tile),
        "route_kernel": lambda: forward_hopper.attention_forward(*packed, varlen, tile=tile,
                                                                 seqused_k=lens),
        "varlen_kernel": lambda: forward_hopper.attention_forward(*packed, varlen, tile=tile),
    }


def cell(seqlen_k: int, nheads_k: int, rounds: int) -> dict:
    times = bench_rotating(variants(seqlen_k, nheads_k), rounds)
    row = {"seqlen_q": SEQLEN_Q, "seqlen_k": seqlen_k, "nheads_k": nheads_k, "ms": times}
    med = {name: statistics.median(t) for name, t in times.items()}
    row["median_ms"] = med
    row["ratio_route"] = med["dense"] / med["route"]
    row["ratio_route_kernel"] = med["dense_kernel"] / med["route_kernel"]
    print("ab", seqlen_k, nheads_k, " ".join(f"{n}={m:.3f}[{min(times[n]):.3f}-"
                                            f"{max(times[n]):.3f}]" for n, m in med.items()),
          f"ratio_route={row['ratio_route']:.3f} ratio_kernel={row['ratio_route_kernel']:.3f}",
          flush=True)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    result = {"env": {**environment(), "label": args.label}, "cells": [
        cell(seqlen_k, nheads_k, args.rounds)
        for nheads_k in (4, 32) for seqlen_k in (6144, 18432)]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
