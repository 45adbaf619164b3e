"""The document example's forward four ways, device time per call (triton.testing.do_bench
medians, no grad): the block mask of `variants.document_mask` (two loads of the document ids
per tile), the same mask written as arithmetic on the positions (documents of 1000 tokens:
integer divisions, no loads; the same block lists and outputs), the same documents as varlen
sequences with `causal=True` (the built-in band on each document, no mask_mod), and causal
as a block mask against causal=True for scale. Needs a GPU:

    PYTHONPATH=src python3 benchmarks/diagnostics/document_forward.py

bf16, batch 4 x 4096 tokens, 16 heads, d128, causal documents of 1000 tokens (the variants
suite's document example).
"""

import argparse

import torch
import triton

import flashkit
from flashkit import variants

BATCH, SEQLEN, NHEADS, HEAD_DIM, DOCUMENT = 4, 4096, 16, 128, 1000


@triton.jit
def _document_arithmetic(b, h, q_idx, kv_idx, size):
    return ((q_idx // size) == (kv_idx // size)) & (q_idx >= kv_idx)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    shape = (BATCH, SEQLEN, NHEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    doc = (torch.arange(SEQLEN, device="cuda") // DOCUMENT).to(torch.int32)
    doc = doc.expand(BATCH, SEQLEN).contiguous()
    masks = {name: flashkit.create_block_mask(mod, BATCH, None, SEQLEN, SEQLEN, device="cuda")
             for name, mod in (("loads", variants.document_mask(doc, causal=True)),
                               ("arithmetic", variants.MaskMod(_document_arithmetic, DOCUMENT)),
                               ("causal", variants.causal_mask()))}
    # each batch entry's documents as varlen sequences: 4 x 1000 tokens and the 96 left over
    starts = list(range(0, SEQLEN, DOCUMENT))
    cu = torch.tensor([b * SEQLEN + s for b in range(BATCH) for s in starts] + [BATCH * SEQLEN],
                      dtype=torch.int32, device="cuda")
    packed = [x.view(BATCH * SEQLEN, NHEADS, HEAD_DIM) for x in (q, k, v)]
    calls = {
        "document block mask (loads)": lambda: flashkit.flash_attn_func(
            q, k, v, block_mask=masks["loads"]),
        "document block mask (arithmetic)": lambda: flashkit.flash_attn_func(
            q, k, v, block_mask=masks["arithmetic"]),
        "documents as varlen, causal=True": lambda: flashkit.flash_attn_varlen_func(
            *packed, cu, cu, DOCUMENT, DOCUMENT, causal=True).view(shape),
        "causal block mask": lambda: flashkit.flash_attn_func(q, k, v,
                                                              block_mask=masks["causal"]),
        "causal=True": lambda: flashkit.flash_attn_func(q, k, v, causal=True),
    }
    with torch.no_grad():
        reference = calls["document block mask (loads)"]()
        for name, call in calls.items():
            if name.startswith("document"):
                diff = (call().float() - reference.float()).abs().max().item()
                print(f"{name}: max |diff| against the block mask with loads {diff:.4f}")
        for name, call in calls.items():
            print(f"{name:36s} {triton.testing.do_bench(call, rep=300):.4f} ms", flush=True)


if __name__ == "__main__":
    main()
