"""Device time per kernel (torch.profiler) of a training step through the public API, 10 steps
after 3 warm-up ones, case by case. Needs a GPU:

    PYTHONPATH=src python3 benchmarks/diagnostics/kernel_times.py [--cases masks,packed]
        [--out DIR]

masks   built-in masks against the same masks as block masks, and the variants suite's mask
        examples (bf16, 4 x 4096 tokens, 16 heads, d128: the suite's problem)
packed  the variants suite's packed documents (16,384 tokens) as plain varlen (causal=True)
        against a causal block mask over the packed tokens
Writes DIR/kernel_times.json (case -> kernel -> [launches in the 10 steps, ms per step]) and
DIR/dispatch.log (which kernels each call ran); DIR defaults to $OUT, else the current folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "suites"))

CASES = ("masks", "packed")


def mask_cases() -> tuple:
    """(inputs, {case: flash_attn_func keyword arguments}) of --cases masks."""
    import variants as suite

    p = suite.problem(4096)
    return (p["q"], p["k"], p["v"], p["dout"]), {
        "causal builtin": dict(causal=True),
        "causal blockmask": suite.ours_mods("causal", p),
        "window builtin": dict(causal=True, window_size=(suite.WINDOW, 0)),
        "window blockmask": suite.ours_mods("window", p),
        "document": suite.ours_mods("document", p),
        "prefix_lm": suite.ours_mods("prefix_lm", p),
        "window_globals": suite.ours_mods("window_globals", p),
        "plain": dict(),
    }


def packed_cases() -> tuple:
    """(inputs, {case: flash_attn_varlen_func keyword arguments}) of --cases packed."""
    import torch

    import flashkit
    import variants as suite
    from flashkit import variants

    lengths, cu = suite.packed_documents()
    q, k, v, dout = (torch.randn(suite.TOKENS, suite.NHEADS, suite.HEAD_DIM, dtype=suite.DTYPE,
                                 device="cuda") for _ in range(4))
    mask = flashkit.create_block_mask(variants.causal_mask(), None, None, suite.TOKENS,
                                      suite.TOKENS, device="cuda", cu_seqlens_q=cu,
                                      cu_seqlens_k=cu)
    common = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                  max_seqlen_k=max(lengths))
    return (q, k, v, dout), {"varlen causal": dict(common, causal=True),
                             "varlen blockmask": dict(common, block_mask=mask)}


def kernel_times(call, inputs, kw: dict) -> dict:
    """{kernel: (launches in 10 steps, device ms per step)} of call(q, k, v, **kw) with its
    backward, as torch.profiler sees 10 steps after 3 warm-up ones."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    q, k, v, dout = inputs
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    for _ in range(3):
        call(*leaves, **kw).backward(dout)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            call(*leaves, **kw).backward(dout)
        torch.cuda.synchronize()
    return {e.key[:90]: (e.count, round(e.self_device_time_total / 10 / 1000, 4))
            for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: masks, packed")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import flashkit

    log = logging.getLogger("flashkit.dispatch")
    log.setLevel(logging.DEBUG)
    log.addHandler(logging.StreamHandler(open(os.path.join(args.out, "dispatch.log"), "w")))
    results = {}
    for name in args.cases.split(","):
        inputs, cases = {"masks": mask_cases, "packed": packed_cases}[name]()
        call = flashkit.flash_attn_func if name == "masks" else flashkit.flash_attn_varlen_func
        for case, kw in cases.items():
            log.debug("=== %s", case)
            results[case] = kernel_times(call, inputs, kw)
            print(case)
            for kernel, value in sorted(results[case].items(), key=lambda x: -x[1][1]):
                print("   ", value, kernel)
    with open(os.path.join(args.out, "kernel_times.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
