"""Forward time of the band-masked (causal, sliding window) Gluon builds through the public API,
with SDPA cuDNN in the same process: run it once per source tree to compare two versions.

    PYTHONPATH=src python3 benchmarks/diagnostics/forward_band_ab.py TAG OUT.json

bf16, batch x seqlen = 16k tokens, heads x head_dim = 2048; causal at 1k and 4k (16k at d128),
window (255, 0) at 4k. Times are triton.testing.do_bench medians in ms.
"""

import argparse
import json

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashkit


def main(tag: str, path: str) -> None:
    rows = []
    for d in (64, 128, 256):
        h = 2048 // d
        for s in (1024, 4096, 16384):
            if s == 16384 and d != 128:
                continue
            b = 16384 // s
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            for mask, kw in (("causal", dict(causal=True)), ("window", dict(window_size=(255, 0)))):
                if mask == "window" and s != 4096:
                    continue
                row = dict(tag=tag, d=d, seqlen=s, mask=mask, flashkit_ms=triton.testing.do_bench(
                    lambda q=q, k=k, v=v, kw=kw: flashkit.flash_attn_func(q, k, v, **kw),
                    warmup=50, rep=200))
                if mask == "causal":
                    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        row["cudnn_ms"] = triton.testing.do_bench(
                            lambda qh=qh, kh=kh, vh=vh: F.scaled_dot_product_attention(
                                qh, kh, vh, is_causal=True),
                            warmup=50, rep=200)
                rows.append(row)
                print(row, flush=True)
    with open(path, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tag", help="a name for this source tree's rows")
    parser.add_argument("out", help="the JSON file to write")
    args = parser.parse_args()
    main(args.tag, args.out)
