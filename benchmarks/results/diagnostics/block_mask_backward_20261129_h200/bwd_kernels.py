"""Device time per kernel (torch.profiler) of a training step, built-in masks against the same
masks as block masks, and the variants suite's mask examples (bf16, 4 x 4096, 16 heads, d128).
Run from the repository root:

    PYTHONPATH=src python3 benchmarks/results/diagnostics/<this folder>/bwd_kernels.py

Writes bwd_kernels.json and dispatch.log (the kernels each call ran) under $OUT, or /tmp."""

import json
import logging
import os
import sys

sys.path.insert(0, "benchmarks/suites")
sys.path.insert(0, "benchmarks")
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import flashkit  # noqa: E402
import variants as vs  # noqa: E402

out_dir = os.environ.get("OUT", "/tmp")
log = logging.getLogger("flashkit.dispatch")
log.setLevel(logging.DEBUG)
log.addHandler(logging.StreamHandler(open(f"{out_dir}/dispatch.log", "w")))
p = vs.problem(4096)
q, k, v, dout = p["q"], p["k"], p["v"], p["dout"]
cases = {
    "causal builtin": dict(causal=True),
    "causal blockmask": vs.ours_mods("causal", p),
    "window builtin": dict(causal=True, window_size=(1024, 0)),
    "window blockmask": vs.ours_mods("window", p),
    "document": vs.ours_mods("document", p),
    "prefix_lm": vs.ours_mods("prefix_lm", p),
    "window_globals": vs.ours_mods("window_globals", p),
    "plain": dict(),
}


def step(leaves, kw):
    flashkit.flash_attn_func(*leaves, **kw).backward(dout)


results = {}
for name, kw in cases.items():
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    for _ in range(3):
        step(leaves, kw)
    torch.cuda.synchronize()
    log.debug("=== %s", name)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step(leaves, kw)
        torch.cuda.synchronize()
    kernels = {e.key[:90]: (e.count, round(e.self_device_time_total / 10 / 1000, 4))
               for e in prof.key_averages() if e.device_type.name == "CUDA" and e.count}
    results[name] = kernels
    print(name)
    for key, value in sorted(kernels.items(), key=lambda x: -x[1][1]):
        print("   ", value, key)
json.dump(results, open(f"{out_dir}/bwd_kernels.json", "w"), indent=1)
