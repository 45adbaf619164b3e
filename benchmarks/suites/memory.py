"""memory: what one attention layer holds after forward, and the backward's peak.

Against PyTorch SDPA (cuDNN and FA2) in the same process.

    PYTHONPATH=src python3 benchmarks/suites/memory.py --out DIR

b1, h16, d128, bf16, causal, 32k and 128k tokens, through the public APIs with q, k, v
requiring grad:
  held_mib   memory allocated after the forward above what the inputs (q, k, v, dout) hold:
             the output plus what autograd saved for backward;
  peak_mib   the peak allocation during forward + backward above the same base (the
             gradients included).
FlashAttention saves out and the float32 log-sum-exp, so held = out + lse (b h s 4 bytes).
flashkit's calls with a sink and 16-bit inputs keep O in float32 besides (docs/design.md): the
"flashkit, sink" row.
Writes DIR/<date>_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from common import (  # noqa: E402
    Result,
    add_out_argument,
    anchor_call,
    log,
    table,
)

import flashkit  # noqa: E402

B, H, D = 1, 16, 128
TOKENS = (32768, 131072)
MIB = 2**20


def measure(attention, q, k, v, dout) -> dict:
    """{"held_mib", "peak_mib"} of out = attention(q, k, v); out.backward(dout)."""
    for x in (q, k, v):
        x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = attention(q, k, v)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    out.backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    for x in (q, k, v):
        x.grad = None
    return {"held_mib": held / MIB, "peak_mib": peak / MIB}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(ap, "memory")
    args = ap.parse_args(argv)
    result = Result("memory", args.out, config={"batch": B, "nheads": H, "head_dim": D})
    log(str(result.data["env"]))
    rows = []
    for seqlen in TOKENS:
        q, k, v, dout = (torch.randn(B, seqlen, H, D, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        qh, kh, vh = (x.detach().transpose(1, 2).contiguous().requires_grad_()
                      for x in (q, k, v))
        douth = dout.transpose(1, 2).contiguous()
        lse_mib = B * H * seqlen * 4 / MIB
        out_mib = q.numel() * q.element_size() / MIB
        sink = torch.zeros(H, device="cuda", requires_grad=True)
        runs = {"flashkit": (lambda *t: flashkit.flash_attn_func(*t, causal=True), (q, k, v),
                             dout),
                # a sink keeps what any call keeps (its gradient reads the backward's tiles)
                "flashkit, sink": (lambda *t, s=sink: flashkit.flash_attn_func(
                    *t, causal=True, sink=s), (q, k, v), dout)}
        for name in ("cudnn", "flash"):
            runs[name] = (anchor_call(name, True), (qh, kh, vh), douth)
        for name, (attention, leaves, grad_out) in runs.items():
            try:
                measure(attention, *leaves, grad_out)  # warm-up: kernels compiled, caches made
                row = measure(attention, *leaves, grad_out)
            except Exception as e:
                log(f"{name} {seqlen}: {type(e).__name__}: {e}")
                row = {"held_mib": None, "peak_mib": None}
            rows.append({"tokens": seqlen, "impl": name, **row, "out_mib": out_mib,
                         "lse_mib": lse_mib})
        del q, k, v, dout, qh, kh, vh, douth
        torch.cuda.empty_cache()
    notes = (f"b{B} h{H} d{D} bf16 causal. held: allocated after forward above the inputs; "
             "peak: the highest allocation during forward + backward above the inputs.")
    result.save("rows", rows)
    result.markdown(f"# memory\n\n{notes}\n\n"
                    + table(rows, ["tokens", "impl", "held_mib", "peak_mib", "out_mib", "lse_mib"]))
    log(f"wrote {result.path}")


if __name__ == "__main__":
    main()
