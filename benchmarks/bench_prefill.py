"""Prefill over a KV cache (flash_attn_with_kvcache, query length 128..2k after 4k..16k cached
keys) against the dense forward on the same q, k, v: flashkit's flash_attn_func and cuDNN SDPA.

    PYTHONPATH=src python benchmarks/bench_prefill.py --out results/x.json [--label tree]
        [--no-force] [--host-only | --no-host] [--queries 128,256 --cached 4096 --kv-heads 4,32]
        [--pages 16,64]

bf16, d128, 32 query heads, GQA 8:1 and 1:1, batch 1, causal (bottom-right aligned: the
queries are the sequence's last positions), the whole cache attended (no append; cache_seqlens
a tensor). Per cell, eager ms (triton's do_bench, median, L2 flushed between calls; every call
of the cell timed once per round for ROUNDS rounds in an order rotated by one each round, the
median over rounds; a fixed order made the later calls up to 17% slower):
  dense_ms        flash_attn_func(q, k, v, causal=True), k/v the cache's seqlen_k keys
  dense_full_ms   the same without the mask, and cudnn_full_ms (SDPA, cuDNN backend) on it:
                  SDPA's causal mask is top-left aligned, other work, so it anchors the full one
  <layout>_ms     the public call as configured (prefill.GLUON_PREFILL_*), contiguous and
                  paged (page 16 / 32 / 64 / 256 or --pages, pages shuffled)
  <layout>_route_ms / _decode_ms  the same with the Gluon route forced on / off (unless
                  --no-force; a tree without a paged route runs the decode kernels for both)
and ratio_* = dense_ms / that (>= 0.9: within 10% of the dense forward). host: CPU wall-clock
us per call of back-to-back public calls (no sync), which bounds small cells.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from statistics import median

import torch
import torch.nn.functional as F
from bench_decode import (
    bench,
    bench_rotating,
    environment,
    gluon_prefill_thresholds,
    host_ms,
    paged_copy,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashkit
from flashkit.api import flash_attn_func
from flashkit.kvcache import flash_attn_with_kvcache
from flashkit.ops.triton import prefill

NHEADS, HEAD_DIM, DTYPE = 32, 128, torch.bfloat16
QUERIES, CACHED, KV_HEADS, PAGES = (128, 256, 512, 2048), (4096, 16384), (4, 32), (16, 32, 64, 256)
ROUNDS = 3  # each cell's calls timed in rotating order (bench_decode.bench_rotating)


def route(on: bool | None):
    """kvcache's Gluon prefill route forced on (True) or off (False) in the block; None: as
    configured."""
    if on is None:
        return contextlib.nullcontext()
    threshold = 0 if on else 2**62
    return gluon_prefill_thresholds(threshold, threshold)


def paged(cache, page_size):
    """(pages (n, page_size, hk, d), block_table (1, n)): the batch-1 cache's keys in shuffled
    pages."""
    n = math.ceil(cache.shape[1] / page_size)
    table = torch.randperm(n, device=cache.device, dtype=torch.int32)[None]
    return paged_copy(cache, table, page_size), table


def host_us(call) -> float:
    """CPU wall-clock us per call of back-to-back calls (bench_decode.host_ms)."""
    return 1e3 * host_ms(call)


def cell(seqlen_q, cached, nheads_k, force: bool, pages=PAGES, rounds=ROUNDS) -> dict:
    seqlen_k = cached + seqlen_q
    q = torch.randn(1, seqlen_q, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    k, v = (torch.randn(1, seqlen_k, nheads_k, HEAD_DIM, dtype=DTYPE, device="cuda")
            for _ in range(2))
    row = {"seqlen_q": seqlen_q, "cached": cached, "seqlen_k": seqlen_k, "nheads_k": nheads_k}
    calls = {"dense": lambda: flash_attn_func(q, k, v, causal=True),
             "dense_full": lambda: flash_attn_func(q, k, v)}
    qt, kt, vt = (x.transpose(1, 2).repeat_interleave(NHEADS // x.shape[2], 1)
                  for x in (q, k, v))  # SDPA (b, h, s, d), GQA as repeated heads

    def cudnn_full():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt)

    try:
        cudnn_full()
        calls["cudnn_full"] = cudnn_full
    except RuntimeError as error:  # no cuDNN attention for this shape / build
        row["cudnn_error"] = str(error)[:200]
    lens = torch.full((1,), seqlen_k, dtype=torch.int32, device="cuda")
    layouts = {"contiguous": (k, v, None)}
    for page_size in pages:
        kp, table = paged(k, page_size)
        layouts[f"paged{page_size}"] = (kp, paged_copy(v, table, page_size), table)
    for name, (kc, vc, table) in layouts.items():
        modes = (("", None), ("_route", True), ("_decode", False)) if force else (("", None),)
        for suffix, on in modes:
            def call(kc=kc, vc=vc, table=table, on=on):  # route() costs ~1 us of host time
                with route(on):
                    return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                   block_table=table, causal=True)
            calls[f"{name}{suffix}"] = call
    times = bench_rotating(calls, rounds)
    for name, ms in times.items():
        row[f"{name}_ms"] = median(ms)
        row[f"{name}_rounds_ms"] = ms
    row.setdefault("cudnn_full_ms", None)
    row["ratio_cudnn_full"] = row["cudnn_full_ms"] and row["cudnn_full_ms"] / row["dense_full_ms"]
    for name in calls:
        if name.startswith(("contiguous", "paged")):
            row[f"ratio_{name}"] = row["dense_ms"] / row[f"{name}_ms"]
    print("prefill", " ".join(f"{key.replace('_ms', '')}={value:.3f}" if isinstance(value, float)
                              else f"{key}={value}" for key, value in row.items()
                              if "ratio" in key or not isinstance(value, (float, list))),
          flush=True)
    return row


def host_times() -> dict:
    """us per public call, back to back, on a cell whose GPU time is small (128 queries over 4k
    cached keys, GQA 8:1), the route forced on (contiguous, page 64) and off."""
    q = torch.randn(1, 128, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    k, v = (torch.randn(1, 4096 + 128, 4, HEAD_DIM, dtype=DTYPE, device="cuda")
            for _ in range(2))
    lens = torch.full((1,), 4096 + 128, dtype=torch.int32, device="cuda")
    kp, table = paged(k, 64)
    vp = paged_copy(v, table, 64)
    out = {}
    for name, (kc, vc, tb) in {"contiguous": (k, v, None), "paged64": (kp, vp, table)}.items():
        def call(kc=kc, vc=vc, tb=tb):
            return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=tb,
                                           causal=True)
        for mode, on in (("route", True), ("decode", False)):
            with route(on):
                out[f"{name}_{mode}_us"] = host_us(call)
                out[f"{name}_{mode}_gpu_ms"] = bench(call)
    out["dense_us"] = host_us(lambda: flash_attn_func(q, k, v, causal=True))
    print("host", json.dumps(out), flush=True)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--label", default="")
    parser.add_argument("--no-force", action="store_true")
    parser.add_argument("--host-only", action="store_true")
    parser.add_argument("--no-host", action="store_true")
    parser.add_argument("--queries", default=",".join(map(str, QUERIES)))
    parser.add_argument("--cached", default=",".join(map(str, CACHED)))
    parser.add_argument("--kv-heads", default=",".join(map(str, KV_HEADS)))
    parser.add_argument("--pages", default=",".join(map(str, PAGES)))
    args = parser.parse_args()
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    result = {"env": {
        **environment(), "cudnn": torch.backends.cudnn.version(),
        "flashkit_path": flashkit.__file__, "label": args.label,
        "thresholds": [prefill.GLUON_PREFILL_MIN_QUERIES, prefill.GLUON_PREFILL_MIN_WORK]}}
    if not args.no_host:
        result["host"] = host_times()
    if not args.host_only:
        result["cells"] = [cell(sq, c, hk, not args.no_force, ints(args.pages))
                           for hk in ints(args.kv_heads)
                           for c in ints(args.cached) for sq in ints(args.queries)]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
