"""The overhead suite's growing-DynamicCache decode row, and the same call at a fixed length,
for one tree: python3 host_rows.py TREE_ROOT (with that tree's src on PYTHONPATH)."""
import json
import os
import sys

sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks", "suites"))
import overhead as o  # noqa: E402
import torch  # noqa: E402

import flashkit  # noqa: E402


def fixed_calls():
    """flash_attn_func over a heads-major cache of 1024 keys every call, and SDPA cuDNN's."""
    q = torch.randn(1, o.DECODE_Q_HEADS, 1, o.DECODE_D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, o.DECODE_KV_HEADS, 1024, o.DECODE_D, device="cuda",
                        dtype=torch.bfloat16) for _ in range(2))
    cudnn = o.sdpa("cudnn")
    return {"flashkit": lambda: flashkit.flash_attn_func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True),
            "cudnn": lambda: cudnn(q, k, v, enable_gqa=True)}


rows = {}
with torch.no_grad():
    for rep in range(2):
        rows[f"growing{rep}"] = o.interleaved(o.growing_cache_calls(300 * 6), 300, 5)
        rows[f"fixed1024_{rep}"] = o.interleaved(fixed_calls(), 300, 5)
print(json.dumps(rows, indent=1, default=str))
