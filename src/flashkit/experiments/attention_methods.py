"""The attention implementations the experiments compare, behind one call signature.

Every method takes q, k, v in flash-attn layout (batch, seqlen, nheads, headdim) and returns out
in the same layout:

    naive    flashkit.reference: the whole (seqlen x seqlen) score matrix, materialised
    tiled    flashkit's pure-PyTorch tiled backend (backend="torch"): any device
    triton   flashkit's Triton kernels (backend="triton"): CUDA only
    sdpa     torch.nn.functional.scaled_dot_product_attention, whichever kernel torch picks
"""

from __future__ import annotations

import importlib.util

import torch

import flashkit
from flashkit import reference

METHODS = ("naive", "tiled", "triton", "sdpa")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


def attend(method: str, q, k, v, causal: bool = False):
    """Run one method's forward (differentiable where the method is)."""
    if method == "naive":
        return reference.attention(q, k, v, causal=causal)[0]
    if method in ("tiled", "triton"):
        backend = "torch" if method == "tiled" else "triton"
        return flashkit.flash_attn_func(q, k, v, causal=causal, backend=backend)
    if method == "sdpa":
        # SDPA wants (batch, nheads, seqlen, headdim); for seqlen_q == seqlen_k its top-left
        # causal mask is the same as flash-attn's bottom-right one.
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)
    raise ValueError(f"method: expected one of {METHODS}, got {method!r}")


def unavailable(method: str, device: str) -> str | None:
    """Why a method cannot run on this device, or None when it can."""
    if method != "triton":
        return None
    if not device.startswith("cuda"):
        return "Triton kernels need a CUDA device"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'flashkit-attn[gpu]')"
    return None


def random_qkv(batch: int, seqlen: int, nheads: int, headdim: int, dtype: torch.dtype,
               device: str):
    """Three random (batch, seqlen, nheads, headdim) tensors from torch's global generator."""
    shape = (batch, seqlen, nheads, headdim)
    return [torch.randn(shape, device=device, dtype=dtype) for _ in range(3)]
