"""Growing-cache decoding steps through flash_attn_func from 1024 keys (the Gluon forward's
range) and from 5000 (the decode kernel's), against SDPA FA2 and flashkit at a fixed length:
python3 host_rows_decode_range.py TREE_ROOT (with that tree's src on PYTHONPATH)."""
import json
import os
import sys

sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks", "suites"))
import overhead as o  # noqa: E402
import torch  # noqa: E402

import flashkit  # noqa: E402

HEADS_K, D = o.DECODE_KV_HEADS, o.DECODE_D


def growing(start: int, calls: int) -> dict:
    q = torch.randn(1, o.DECODE_Q_HEADS, 1, D, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(2, HEADS_K * (start + calls + 64) * D, device="cuda",
                        dtype=torch.bfloat16)

    def keys(length):  # (1, heads_k, length, d) contiguous, as torch.cat leaves a DynamicCache
        return (cache[i, :HEADS_K * length * D].view(1, HEADS_K, length, D) for i in range(2))

    def counted(step):
        lengths = iter(range(start, start + calls + 64))
        return lambda: step(next(lengths))

    def ours(length):
        k, v = keys(length)
        return flashkit.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                        causal=True)

    fa2 = o.sdpa("flash")
    return {"flashkit": counted(ours),
            "flash": counted(lambda length: fa2(q, *keys(length), enable_gqa=True)),
            "flashkit, fixed length": lambda: ours(start)}


rows = {}
with torch.no_grad():
    for start in (1024, 5000):
        rows[f"from {start}"] = o.interleaved(growing(start, 300 * 6), 300, 5)
print("JSON" + json.dumps(rows))
