"""Device time per kernel (torch.profiler) of a training step over causal documents packed
without padding (the variants suite's packed row: 10 documents of 100-3000 tokens in 16,384,
16 heads, d128, bf16): flash_attn_varlen_func with causal=True against a causal block mask over
the packed tokens. Run from the repository root:

    PYTHONPATH=src python3 benchmarks/results/diagnostics/<this folder>/packed.py

Writes packed.json and dispatch.log under $OUT, or /tmp."""

import json
import logging
import os

import torch
from torch.profiler import ProfilerActivity, profile

import flashkit
from flashkit import variants

out = os.environ.get("OUT", "/tmp")
log = logging.getLogger("flashkit.dispatch")
log.setLevel(logging.DEBUG)
log.addHandler(logging.StreamHandler(open(f"{out}/dispatch.log", "w")))
TOKENS, NH, D = 16384, 16, 128
gen = torch.Generator().manual_seed(0)
lengths = []
while sum(lengths) < TOKENS:
    lengths.append(min(int(torch.randint(100, 3001, (1,), generator=gen)), TOKENS - sum(lengths)))
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                  device="cuda")
longest = max(lengths)
q, k, v, dout = (torch.randn(TOKENS, NH, D, dtype=torch.bfloat16, device="cuda")
                 for _ in range(4))
mask = flashkit.create_block_mask(variants.causal_mask(), None, None, TOKENS, TOKENS,
                                  device="cuda", cu_seqlens_q=cu, cu_seqlens_k=cu)
print("lengths", lengths)
print("partial / full blocks", mask.kv_num_blocks.sum().item(),
      mask.full_kv_num_blocks.sum().item())
cases = {"varlen causal": dict(causal=True), "varlen blockmask": dict(block_mask=mask)}


def step(leaves, kw):
    flashkit.flash_attn_varlen_func(*leaves, cu, cu, longest, longest, **kw).backward(dout)


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
json.dump(results, open(f"{out}/packed.json", "w"), indent=1)
