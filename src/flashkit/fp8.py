"""FP8 attention: quantise inputs, and the forward behind `flash_attn_func` for float8 inputs.

    q8, q_descale = flashkit.fp8.quantize(q, hadamard=True)   # q, k: the same rotation
    k8, k_descale = flashkit.fp8.quantize(k, hadamard=True)
    v8, v_descale = flashkit.fp8.quantize(v, key_major=True)         # the kernel's layout
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
from dataclasses import replace

import torch

from flashkit import reference
from flashkit.ops.params import AttentionParams

__all__ = ["quantize", "dequantize", "key_major_empty", "hadamard_matrix", "rounded_reference",
           "tensor_core_matmul", "FLOAT8_DTYPES"]

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


def key_major_empty(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised (batch, seqlen, nheads, headdim) tensor whose seqlen axis is contiguous
    (stride 1): the layout in which the FP8 kernel reads v, whose P V product on Hopper takes
    its fp8 operand key-major. Stored as (batch, nheads, headdim, seqlen) with seqlen padded to a
    multiple of 16, so every row of a V^T tile starts 16-byte aligned (the padding is never
    read: key tails are masked)."""
    batch, seqlen, nheads, head_dim = shape
    store = torch.empty((batch, nheads, head_dim, -(-seqlen // 16) * 16), dtype=dtype,
                        device=device)
    return store[..., :seqlen].permute(0, 3, 1, 2)


def quantize(x: torch.Tensor, per_head: bool = True, hadamard: bool = False,
             dtype: torch.dtype = torch.float8_e4m3fn,
             key_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, descale) with x ~= x8 * descale, for x (batch, seqlen, nheads, headdim).

    per_head: one scale per (batch, head), descale of shape (batch, nheads), else one for the
    tensor, shape (1,). The scale maps the largest magnitude onto the format's largest finite
    value. hadamard: rotate the head dim by the orthonormal Hadamard matrix first (q and k
    only, both alike; head dim a power of two). key_major: write x8 with its seqlen axis
    contiguous (key_major_empty), the layout the FP8 forward reads v in: pass it for v, and
    the forward reads v8 in place instead of copying it every call (values and shape are the
    same). x is not modified.
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
    if not key_major:
        return (x / scale).to(dtype), descale
    x8 = key_major_empty(x.shape, dtype, x.device)
    x8.copy_(x / scale)  # the cast and the transpose in one pass
    return x8, descale


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


# The FP8 tensor cores' accumulator (Hopper wgmma with fp8 operands and an fp32 result): it keeps
# about 14 significant bits, not fp32's 24 (the DeepSeek-V3 Technical Report, DeepSeek-AI 2024,
# section 3.3.2: "limited to retaining around 14 bits" on the H800), modelled here as 13 explicit
# mantissa bits, truncated toward zero, after every instruction's reduction step of 32 products
# (wgmma's K for 8-bit operands). Triton 3.6 on sm_90 accumulates fp8 dots this way throughout
# (max_num_imprecise_acc defaults to 2^30, so it never promotes to a full fp32 sum): within the
# head dim for Q K^T and across the whole key loop for P V. The model is close, not exact: on an
# H200 it gives the hardware's own sum for 72% of 32-product e4m3 dots (86% e5m2), and no
# alignment-and-truncation variant tried did better, so the testing baseline takes the scores
# from the tensor cores themselves where there is a GPU (rounded_reference).
ACCUMULATOR_MANTISSA_BITS = 13
ACCUMULATOR_STEP = 32


def accumulator_round(x: torch.Tensor) -> torch.Tensor:
    """x (float64) truncated toward zero to ACCUMULATOR_MANTISSA_BITS explicit mantissa bits."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, |mantissa| in [0.5, 1)
    bits = ACCUMULATOR_MANTISSA_BITS + 1
    return torch.ldexp(torch.trunc(mantissa * 2.0 ** bits), exponent - bits)


def tensor_core_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for float64 a (..., m, k), b (..., k, n) holding fp8 values, as the FP8 tensor
    cores sum it: exact products, the running sum rounded by accumulator_round after every
    ACCUMULATOR_STEP of the reduction axis, in order."""
    acc = a.new_zeros((*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2],
                       b.shape[-1]))
    for start in range(0, a.shape[-1], ACCUMULATOR_STEP):
        step = slice(start, start + ACCUMULATOR_STEP)
        acc = accumulator_round(acc + a[..., step] @ b[..., step, :])
    return acc


def _per_query_head(descale: torch.Tensor | None, nheads: int) -> torch.Tensor:
    """A descale ((1,), (batch, h) with h dividing nheads, or None) as float64 (b, nheads, 1, 1)."""
    if descale is None:
        return torch.ones(1, 1, 1, 1, dtype=torch.float64)
    descale = descale.to(torch.float64)
    if descale.dim() == 1:
        return descale.reshape(1, 1, 1, 1)
    return descale.repeat_interleave(nheads // descale.shape[1], dim=1)[:, :, None, None]


def rounded_reference(q8, k8, v8, params: AttentionParams, q_descale=None, k_descale=None,
                      v_descale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out bf16, lse float32): the materialised attention of the dequantised inputs with the
    roundings of the FP8 kernel on a Hopper GPU. The baseline of the testing rule
    max|kernel - oracle| <= 2 max|baseline - oracle| + atol for fp8.

    - Scores: q8 . k8 as the FP8 tensor cores sum it (the dominant error of lse), then scaled
      by softmax_scale * q_descale * k_descale. On a GPU the scores come from the tensor cores
      themselves, through the kernel's own dot (forward_fp8.tensor_core_scores); elsewhere from
      tensor_core_matmul's model of their accumulator.
    - P: each row's exp(s - max s) in [0, 1], scaled by P_SCALE and rounded to the inputs' fp8
      format (the dominant error of out); the row sum stays unrounded. The kernel rounds P
      against its running max, at most the row max: the same unit roundoff.
    - P V: P8 . v8 summed by tensor_core_matmul over the keys in order, then scaled by
      v_descale; the output rounded to bf16, lse computed in float32.
    On the CPU (Triton's interpreter sums fp8 products exactly) the kernel's error is below this
    baseline's; the bound is meant for the GPU.
    """
    from flashkit.ops.triton.forward_fp8 import P_SCALE

    nheads, nheads_k = q8.shape[2], k8.shape[2]
    groups = nheads // nheads_k
    qh = q8.to(torch.float64).transpose(1, 2)  # (b, h, sq, d)
    kh = k8.to(torch.float64).transpose(1, 2).repeat_interleave(groups, dim=1)  # (b, h, sk, d)
    vh = v8.to(torch.float64).transpose(1, 2).repeat_interleave(groups, dim=1)  # (b, h, sk, dv)
    qk_descale = _per_query_head(q_descale, nheads) * _per_query_head(k_descale, nheads)
    score_scale = params.softmax_scale * qk_descale
    s_exact = (qh @ kh.transpose(-1, -2)) * score_scale  # (b, h, sq, sk)
    if q8.is_cuda:
        from flashkit.ops.triton.forward_fp8 import tensor_core_scores
        summed = tensor_core_scores(q8, k8).to(torch.float64)
    else:
        summed = tensor_core_matmul(qh, kh.transpose(-1, -2))
    s_model = summed * score_scale
    if params.softcap > 0:
        s_exact, s_model = (params.softcap * torch.tanh(s / params.softcap)
                            for s in (s_exact, s_model))
    # The oracle's own pipeline (softcap, ALiBi, sink, window) on the dequantised inputs, with
    # the accumulator's score error added as a bias.
    modelled = replace(params, attn_bias=s_model - s_exact)
    qf, kf, vf = (dequantize(x, d, torch.float64)
                  for x, d in zip((q8, k8, v8), (q_descale, k_descale, v_descale), strict=True))
    _, _, probs = reference.attention_with_params(qf, kf, vf, modelled, return_probs=True)
    scale = P_SCALE[q8.dtype]
    row_max = probs.amax(-1, keepdim=True)
    p_rounded = (probs / torch.where(row_max > 0, row_max, 1) * scale).to(q8.dtype)
    out = (tensor_core_matmul(p_rounded.to(torch.float64), vh) * (row_max / scale)
           * _per_query_head(v_descale, nheads))
    lse_modelled = replace(params, attn_bias=modelled.attn_bias.float())
    _, lse32 = reference.attention_with_params(qf.float(), kf.float(), vf.float(), lse_modelled)
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
