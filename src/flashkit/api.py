"""The flash-attn style entry points: check the inputs, build AttentionParams, dispatch.

Eager calls go straight to the backend: one torch.autograd.Function (`_Attention`) around the
backend's forward and backward, whose front door picks the kernels (for Triton, from a cached
plan). Under torch.compile the same call goes through the torch.library custom op
(flashkit.ops.custom_op), which the compiler traces without a graph break; in eager mode that
op's dispatch would cost more than the kernels on small problems.

Signatures and return values follow flash-attn 2 (`out`, or `(out, softmax_lse, attn_probs)` with
return_attn_probs=True), plus two keyword-only additions: `sink` (a learnable per-head logit,
DESIGN section 1) and `backend` (None, "torch", "triton" or "reference").
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from flashkit import checks, fp8, reference
from flashkit.ops import custom_op
from flashkit.ops.params import AttentionParams, accumulation_dtype
from flashkit.variants import autograd as variant_autograd
from flashkit.variants import mods as variant_mods

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_func"]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, sink=None, backend=None, q_descale=None,
                    k_descale=None, v_descale=None, score_mod=None, mask_mod=None,
                    block_mask=None, return_softmax_lse=False):
    """Exact attention of q (batch, seqlen_q, nheads, d) over k, v (batch, seqlen_k, nheads_k, d).

    causal/window_size are bottom-right aligned when seqlen_q != seqlen_k; window_size=(left,
    right) with -1 for unbounded; nheads_k must divide nheads (GQA/MQA); alibi_slopes float32
    (nheads,) or (batch, nheads); softcap > 0 applies cap * tanh(s / cap); sink (nheads,) adds
    one value-less logit to every row's softmax. Returns out (batch, seqlen_q, nheads, d_v), or
    (out, lse (batch, nheads, seqlen_q), probs (batch, nheads, seqlen_q, seqlen_k)) when
    return_attn_probs (probs materialise the whole matrix: for testing at small sizes), or
    (out, lse) with return_softmax_lse alone (nothing materialised).
    float8 q, k, v (forward only, bf16 out) take float32 q/k/v_descale, (1,) or (batch,
    nheads_k): see flashkit.fp8.
    score_mod, mask_mod, block_mask: user variants, FlexAttention's meaning (docs/variants.md).
    """
    checks.dense_qkv(q, k, v, checks.DTYPES + checks.FLOAT8_DTYPES)
    float8 = checks.descales(q, k, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    params = build_params(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                     deterministic, sink, batch=q.shape[0])
    params = variant_mods.attach(params, q, score_mod, mask_mod, block_mask, q.shape[0],
                                 q.shape[2], q.shape[1], k.shape[1])
    if float8:
        if params.variant is not None:
            raise NotImplementedError("score_mod/mask_mod/block_mask: float8 inputs take none")
        if return_softmax_lse:
            raise NotImplementedError("return_softmax_lse: not offered for float8 inputs")
        return fp8.attention(q, k, v, params, q_descale, k_descale, v_descale,
                             checks.backend(backend, q.device), return_attn_probs)
    return _run(q, k, v, params, backend, return_attn_probs, return_softmax_lse)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, sink=None,
                              backend=None, return_softmax_lse=False):
    """flash_attn_func on qkv (batch, seqlen, 3, nheads, headdim); gradients flow to qkv."""
    checks.tensor("qkv", qkv, "(batch, seqlen, 3, nheads, headdim)")
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv: dim 2 must be 3 (q, k, v), got shape {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, sink=sink,
                           backend=backend, return_softmax_lse=return_softmax_lse)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, sink=None,
                             backend=None, return_softmax_lse=False):
    """flash_attn_func on q and kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    checks.tensor("kv", kv, "(batch, seqlen_k, 2, nheads_k, headdim)")
    if kv.shape[2] != 2:
        raise ValueError(f"kv: dim 2 must be 2 (k, v), got shape {tuple(kv.shape)}")
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, sink=sink,
                           backend=backend, return_softmax_lse=return_softmax_lse)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, *, sink=None, backend=None,
                           score_mod=None, mask_mod=None, block_mask=None,
                           return_softmax_lse=False, sync_checks=False):
    """Attention over sequences packed without padding: q (total_q, nheads, d), k/v (total_k,
    nheads_k, d), sequence b spanning rows cu_seqlens[b]:cu_seqlens[b + 1] (int32, batch + 1).
    Masks align per sequence. lse is (nheads, total_q); probs a list of per-sequence matrices.
    max_seqlen_q/k bound the sequence lengths (trusted for the launch, as in flash-attn).
    sync_checks: read cu_seqlens on the host and raise a ValueError naming a bad entry (one
    device sync per call); by default CUDA tensors are checked on the device without a sync,
    where a bad entry fails a device-side assertion before any kernel reads it.
    """
    batch = checks.varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              sync_checks)
    params = build_params(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                     deterministic, sink, batch=batch, nheads=q.shape[1],
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k))
    params = variant_mods.attach(params, q, score_mod, mask_mod, block_mask, batch, q.shape[1],
                                 int(max_seqlen_q), int(max_seqlen_k))
    return _run(q, k, v, params, backend, return_attn_probs, return_softmax_lse)


def build_params(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
            deterministic, sink, batch, nheads=None, **varlen) -> AttentionParams:
    """Check the scalar and per-head arguments and gather them for the backends."""
    nheads = q.shape[2] if nheads is None else nheads
    window_left, window_right = checks.window_size(window_size, causal)
    checks.alibi_slopes(alibi_slopes, batch, nheads, q.device)
    checks.sink(sink, nheads, q.device)
    dropout_p = checks.dropout_p(dropout_p)
    return AttentionParams(
        softmax_scale=checks.softmax_scale(softmax_scale, q.shape[-1]),
        window_left=window_left, window_right=window_right, softcap=checks.softcap(softcap),
        alibi_slopes=alibi_slopes, sink=sink, dropout_p=dropout_p,
        dropout_seed=draw_dropout_seed() if dropout_p > 0 else 0,
        deterministic=bool(deterministic), **varlen)


def draw_dropout_seed() -> int:
    """A dropout seed from torch's default generator, so torch.manual_seed reproduces a call."""
    return int(torch.randint(0, 2**62, (), device="cpu"))


def _run(q, k, v, params: AttentionParams, backend, return_attn_probs, return_softmax_lse):
    """Dispatch to a backend; returns out, (out, lse, probs), or (out, lse) with
    return_softmax_lse alone."""
    name = checks.backend(backend, q.device)
    if name == "reference":  # the oracle: materialised, differentiated by autograd
        if params.dropout_p > 0:
            raise NotImplementedError(
                "backend 'reference': dropout needs the keep-mask; call "
                "flashkit.reference.attention(..., dropout_mask=...) directly")
        out, lse, *probs = reference.attention_with_params(q, k, v, params,
                                                           return_probs=return_attn_probs)
        lse = lse.to(accumulation_dtype(q.dtype))
        if return_attn_probs:
            return out, lse, probs[0]
        return (out, lse) if return_softmax_lse else out
    for arg, t in (("attn_mask", params.attn_bias), ("alibi_slopes", params.alibi_slopes)):
        if t is not None and t.requires_grad:
            raise NotImplementedError(f"{arg}: backend {name!r} computes no gradient for it; "
                                      "pass a tensor that does not require grad")
    require_available(name, q.device)
    if params.variant is not None:  # Python modifiers: not custom-op arguments
        out, lse = variant_autograd.attention(q, k, v, params, name)
    elif torch.compiler.is_compiling():
        out, lse = custom_op.attention(q, k, v, params, name)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
            params.sink is not None and params.sink.requires_grad)):
        out, lse = _Attention.apply(q, k, v, params.sink, params, name)
    else:
        out, lse = custom_op.backend_module(name).forward(q, k, v, params)
    if not return_attn_probs:
        return (out, lse) if return_softmax_lse else out
    probs = custom_op.backend_module(name).attention_probs(q, k, v, lse, params)
    return out, lse, probs


class _Attention(torch.autograd.Function):
    """(out, lse) of a backend, differentiable in q, k, v and the sink. Saves the inputs, out
    (in q's dtype) and the float32 lse, nothing else; the backward reads D = rowsum(dO * O)
    from that out, as every FlashAttention does."""

    @staticmethod
    def forward(ctx, q, k, v, sink, params: AttentionParams, backend: str):
        out, lse = custom_op.backend_module(backend).forward(q, k, v, params)
        # The sink too, so autograd sees it modified in place before the backward (it is an
        # input: no extra memory); params' other tensors take no gradient.
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.params, ctx.backend = params, backend
        ctx.set_materialize_grads(False)  # an unused lse passes None, not a tensor of zeros
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, _ = ctx.saved_tensors
        params = ctx.params
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv, dsink = custom_op.backend_module(ctx.backend).backward(
            dout, q, k, v, out, lse, params, dlse=dlse)
        return dq, dk, dv, dsink, None, None


def require_available(name: str, device: torch.device) -> None:
    """Raise a clear error if the named backend cannot run on `device` here."""
    if name != "triton":
        return
    if not _triton_installed():
        raise ImportError("backend 'triton' needs the triton package: pip install "
                          "'flashkit[gpu]', or pass backend='torch'")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend 'triton' runs on CUDA tensors (got {device}); set "
                         "TRITON_INTERPRET=1 to run its kernels in the interpreter, or pass "
                         "backend='torch'")


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None
