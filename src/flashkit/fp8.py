"""FP8 attention: quantise inputs, and the forward behind `flash_attn_func` for float8 inputs.

    q8, q_descale = flashkit.fp8.quantize(q, hadamard=True)   # q, k: the same rotation
    k8, k_descale = flashkit.fp8.quantize(k, hadamard=True)
    v8, v_descale = flashkit.fp8.quantize(v)
    out = flashkit.flash_attn_func(q8, k8, v8, causal=True, q_descale=q_descale,
                                   k_descale=k_descale, v_descale=v_descale)   # bf16

Inputs are float8_e4m3fn or float8_e5m2 (q, k, v alike) with FA3's descale factors: the real
tensor is x8 * x_descale, x_descale float32 of shape (1,) (per tensor) or (batch, nheads_k) (per
kv head; q_descale may also be (batch, nheads)); None means 1. The output is bf16, lse float32.
Forward only: a call that needs gradients raises NotImplementedError.

Backends: "triton" runs the FP8 kernel (ops/triton/forward_fp8.py; Hopper, or Ada at 8.9);
"torch" and "reference" dequantise (x8 -> float32 resp. float64, times the descale) and run the
tiled backend resp. the oracle on the result: the same math without the kernel's fp8 rounding
of P, for checking and for machines without such a GPU, not for speed.

Incoherent processing (FA3): an outlier channel of q or k sets the whole head's scale, so
every other channel keeps few significant bits. Rotating the head dim of q and k by the same
orthonormal Hadamard matrix H (H H^T = I, so q H . k H = q . k) spreads an outlier over all
channels before quantisation. It must not be applied to v (the output would come out rotated).
"""

from __future__ import annotations

import functools

import torch

from flashkit import reference
from flashkit.ops.params import AttentionParams

__all__ = ["quantize", "dequantize", "hadamard_matrix", "rounded_reference", "FLOAT8_DTYPES"]

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@functools.lru_cache(maxsize=16)
def _hadamard(n: int, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).to(device)


def hadamard_matrix(n: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The orthonormal (n, n) Hadamard matrix (Sylvester's construction); n a power of two."""
    if not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"n: the Hadamard rotation needs a power-of-two head dim, got {n!r}")
    return _hadamard(n, torch.device(device or "cpu")).to(dtype)


def quantize(x: torch.Tensor, per_head: bool = True, hadamard: bool = False,
             dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, descale) with x ~= x8 * descale, for x (batch, seqlen, nheads, headdim).

    per_head: one scale per (batch, head), descale of shape (batch, nheads), else one for the
    tensor, shape (1,). The scale maps the largest magnitude onto the format's largest finite
    value. hadamard: rotate the head dim by the orthonormal Hadamard matrix first (q and k
    only, both alike; head dim a power of two). x is not modified.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError("x: expected a floating tensor (batch, seqlen, nheads, headdim)")
    if dtype not in FLOAT8_DTYPES:
        raise ValueError(f"dtype: expected one of {FLOAT8_DTYPES}, got {dtype}")
    x = x.to(torch.float32)
    if hadamard:
        x = x @ hadamard_matrix(x.shape[-1], x.device)
    amax = x.abs().amax(dim=(1, 3)) if per_head else x.abs().amax().reshape(1)
    descale = torch.where(amax > 0, amax / torch.finfo(dtype).max, torch.ones_like(amax))
    scale = descale[:, None, :, None] if per_head else descale
    return (x / scale).to(dtype), descale


def dequantize(x8: torch.Tensor, descale: torch.Tensor | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x8 (batch, seqlen, nheads, headdim) times its descale ((1,), or (batch, h) with h
    dividing nheads: FA3's per-kv-head q_descale covers each group of query heads), in dtype."""
    x = x8.to(dtype)
    if descale is None:
        return x
    descale = descale.to(dtype)
    if descale.dim() == 2:
        descale = descale.repeat_interleave(x.shape[2] // descale.shape[1], dim=1)
        descale = descale[:, None, :, None]
    return x * descale


def rounded_reference(q8, k8, v8, params: AttentionParams, q_descale=None, k_descale=None,
                      v_descale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out bf16, lse float32): the materialised attention of the dequantised inputs with the
    FP8 kernel's own rounding: each row's P = exp(s - max s) in [0, 1] scaled by P_SCALE and
    rounded to the inputs' fp8 format before P V (the row sum stays unrounded), the output
    rounded to bf16 and lse computed in float32. The baseline of the testing rule
    max|kernel - oracle| <= 2 max|baseline - oracle| + atol for fp8 (the kernel rounds P against
    its running max, which is at most the row max: the same unit roundoff)."""
    from flashkit.ops.triton.forward_fp8 import P_SCALE

    scale = P_SCALE[q8.dtype]
    qf, kf, vf = (dequantize(x, d, torch.float64)
                  for x, d in zip((q8, k8, v8), (q_descale, k_descale, v_descale), strict=True))
    out, lse, probs = reference.attention_with_params(qf, kf, vf, params, return_probs=True)
    row_max = probs.amax(-1, keepdim=True)
    p_rounded = (probs / torch.where(row_max > 0, row_max, 1) * scale).to(q8.dtype)
    groups = qf.shape[2] // vf.shape[2]
    v_heads = vf.repeat_interleave(groups, dim=2).transpose(1, 2)  # (b, h, sk, dv)
    out = (p_rounded.to(torch.float64) @ v_heads) * (row_max / scale)
    _, lse32 = reference.attention_with_params(qf.float(), kf.float(), vf.float(), params)
    return out.transpose(1, 2).to(torch.bfloat16), lse32.to(torch.float32)


def attention(q, k, v, params: AttentionParams, q_descale, k_descale, v_descale, backend: str,
              return_attn_probs: bool):
    """flash_attn_func for float8 q, k, v on a backend ("triton", "torch" or "reference"):
    out in bf16, or (out, lse, probs) with return_attn_probs (probs from the dequantised inputs
    and the returned lse)."""
    descales = (q_descale, k_descale, v_descale)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k, v, params.sink, *descales)):
        raise NotImplementedError("float8 inputs: backward is not implemented (FP8 attention is "
                                  "forward only); call it under torch.no_grad() or pass tensors "
                                  "that do not require grad")
    if params.dropout_p > 0:
        raise NotImplementedError(f"backend {backend!r}: dropout is not supported with float8 "
                                  "inputs (forward only)")
    if backend == "triton":
        from flashkit.ops.triton import forward_fp8

        reason = forward_fp8.eligible(q, k, v, params)
        if reason is not None:
            raise NotImplementedError(f"backend 'triton': {reason}")
        out, lse = forward_fp8.attention_forward(q, k, v, params, *descales)
    else:
        wide = torch.float64 if backend == "reference" else torch.float32
        qf, kf, vf = (dequantize(x, d, wide) for x, d in zip((q, k, v), descales, strict=True))
        if backend == "reference":
            out, lse = reference.attention_with_params(qf, kf, vf, params)
        else:
            from flashkit.ops import custom_op

            out, lse = custom_op.attention(qf, kf, vf, params, backend)
        out, lse = out.to(torch.bfloat16), lse.to(torch.float32)
    if not return_attn_probs:
        return out
    from flashkit.ops.tiled.probs import attention_probs

    qf, kf, vf = (dequantize(x, d) for x, d in zip((q, k, v), descales, strict=True))
    return out, lse, attention_probs(qf, kf, vf, lse, params)
