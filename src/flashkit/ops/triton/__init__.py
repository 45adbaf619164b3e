"""The Triton backend: fused FlashAttention-2 kernels (dense or varlen, any band given by a window).

    forward(q, k, v, params)                    -> (out, lse)
    backward(dout, q, k, v, out, lse, params)   -> (dq, dk, dv, dsink)
    kvcache_attention(q, k_cache, v_cache, cache, params) -> (out, lse)

Which kernels run is chosen in one place, flashkit.ops.triton.dispatch (FLASHKIT_LOG_DISPATCH=1
logs each choice and why the other kernels declined).

Layouts and the meaning of params: flashkit.ops.params. Supported: dense and varlen (packed)
inputs, fp16 / bf16 / fp32, head dims 1..256 (q/k and v may differ), GQA/MQA, any
softmax_scale, any window (full, causal, sliding, bottom-right aligned), softcap, ALiBi,
learnable sinks, dropout (Philox keep-mask regenerated in backward, see dropout.py),
deterministic gradients (by default: the measured-faster dQ path has no atomics). An SDPA
attn_mask (attn_bias) raises NotImplementedError before a kernel launches.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from flashkit.ops.params import AttentionParams, KVCacheArgs
from flashkit.ops.tiled.probs import attention_probs as tiled_probs
from flashkit.ops.triton import dispatch, dropout, interpreter

__all__ = ["forward", "backward", "planned_forward", "kvcache_attention", "kvcache_step",
           "attention_probs"]

interpreter.patch_for_numpy()
interpreter.patch_bfloat16()


def _check_supported(params: AttentionParams, dtype: torch.dtype) -> None:
    """NotImplementedError naming the backend and the feature, before any launch."""
    if dtype == torch.float64:
        raise NotImplementedError("triton backend: float64 is not supported (fp16, bf16, "
                                  "fp32); use backend='torch' or 'reference'")
    if params.attn_bias is not None:
        raise NotImplementedError("triton backend: attn_bias is not supported yet")


def _on_device_of(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it t's (multi-GPU). Nothing to do when
    it already is, the usual case (entering and leaving torch.cuda.device costs a few
    microseconds of host time per call)."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams, *,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """(out, lse): out like q with v's head dim, lse float32 (batch, nheads, seqlen_q); out
    and lse may be given preallocated."""
    _check_supported(params, q.dtype)
    with _on_device_of(q):
        return dispatch.forward_call(q, k, v, params, out=out, lse=lse)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, params: AttentionParams, *,
             dq: torch.Tensor | None = None, dk: torch.Tensor | None = None,
             dv: torch.Tensor | None = None, dlse: torch.Tensor | None = None,
             own_lse: bool = True, grad_dtype: torch.dtype | None = None):
    """(dq, dk, dv, dsink): gradients in the inputs' dtypes, or grad_dtype (ring attention
    sums its steps' gradients in the accumulation dtype; the kernels round to it as they
    store), where dq, dk, dv are not given; dsink None without a sink.
    own_lse=False: lse is not this call's own but one over more keys (ring attention's merged
    lse), so a row that sees one key here is not a row whose softmax is 1."""
    _check_supported(params, q.dtype)
    if grad_dtype is not None:
        dq, dk, dv = (torch.empty_like(x, dtype=grad_dtype) if given is None else given
                      for x, given in ((q, dq), (k, dk), (v, dv)))
    # out.sum()'s gradient is an expanded view (stride 0), which the TMA kernels cannot read:
    # one copy (a no-op for a contiguous dout), as SDPA makes
    dout = dout.contiguous()
    with _on_device_of(q):
        return dispatch.backward_call(dout, q, k, v, out, lse, params, dq=dq, dk=dk, dv=dv,
                                      dlse=dlse, own_lse=own_lse)


def planned_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    params: AttentionParams):
    """The forward plan that runs every call equal to this one (dispatch.planned_forward:
    calling it with (params, q, k, v) gives forward's (out, lse), or None where it declines)."""
    return dispatch.planned_forward(q, k, v, params)


def any_length_forward(planned, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       params: AttentionParams, kept=None):
    """The forward plans that run every call equal to this one but for its key length
    (dispatch.any_length_forward: a decoding step over a growing cache), called as
    planned_forward's: kept (this function's earlier result for the class) or a new one, with
    the call's own plan (planned, planned_forward's) for its range of key lengths; None (or
    kept as it was) where the call's kernel or features depend on the key length."""
    return dispatch.any_length_forward(planned, q, k, v, params, kept)


def kvcache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cache: KVCacheArgs, params: AttentionParams):
    """(out, lse) of flash_attn_with_kvcache (appends in place); lse (batch, nheads, seqlen_q)
    contiguous."""
    with _on_device_of(q):
        out, lse = dispatch.kvcache_call(q, k_cache, v_cache, cache, params)
    return out, lse.contiguous()


def kvcache_step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cache: KVCacheArgs, params: AttentionParams):
    """The planned decoding step that runs every call equal to this one (dispatch.kvcache_step:
    calling it with the call's tensors gives kvcache_attention's result, on the current CUDA
    device, which must be q's), or None where the call takes other kernels."""
    return dispatch.kvcache_step(q, k_cache, v_cache, cache, params)


def attention_probs(q, k, v, lse, params: AttentionParams):
    """The attention weights for return_attn_probs (testing at small sizes), as the tiled
    backend returns them: exp(s - lse), which its torch code computes from this backend's lse on
    any device, times keep / (1 - p) with this backend's own keep-mask under dropout. Dense:
    (batch, nheads, seqlen_q, seqlen_k); varlen: a list of (nheads, seqlen_q, seqlen_k)."""
    _check_supported(params, q.dtype)
    probs = tiled_probs(q, k, v, lse, dataclasses.replace(params, dropout_p=0.0))
    if params.dropout_p == 0:
        return probs
    batch = len(probs) if params.is_varlen else q.shape[0]
    seqlen_q, seqlen_k = (params.max_seqlen_q, params.max_seqlen_k) if params.is_varlen else (
        q.shape[1], k.shape[1])
    keep = dropout.keep_mask(params.dropout_seed, params.dropout_p, batch, lse.shape[-2],
                             seqlen_q, seqlen_k, q.device)
    scale = 1.0 / (1.0 - params.dropout_p)
    if not params.is_varlen:
        return probs * keep * scale
    return [p * keep[b, :, :p.shape[1], :p.shape[2]] * scale for b, p in enumerate(probs)]
