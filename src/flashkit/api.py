"""The flash-attn style entry points: check the inputs, build AttentionParams, dispatch.

Eager calls go straight to the backend: one torch.autograd.Function (`_Attention`) around the
backend's forward and backward, whose front door picks the kernels (for Triton, from a cached
plan). Under torch.compile the same call goes through the torch.library custom op
(flashkit.ops.custom_op), which the compiler traces without a graph break; in eager mode that
op's dispatch would cost more than the kernels on small problems.

Signatures and return values follow flash-attn 2 (`out`, or `(out, softmax_lse, attn_probs)` with
return_attn_probs=True), plus two keyword-only additions: `sink` (a learnable per-head logit,
docs/design.md section 1) and `backend` (None, "torch", "triton" or "reference").
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import weakref

import torch

from flashkit import checks, fp8, kept, reference
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
    """Exact attention, flash-attn 2's `flash_attn_func` (same arguments, same results).

    out[b, i, h] = sum_j softmax_j(s_ij) v[b, j, h // (nheads // nheads_k)], computed tile by tile
    without materialising the (seqlen_q, seqlen_k) score matrix (docs/design.md section 1).

    Args:
        q: (batch, seqlen_q, nheads, headdim). float16, bfloat16, float32 (or float64 on the
            torch and reference backends; float8 on Hopper GPUs, see q_descale); headdim up to
            256. Note the layout: PyTorch's SDPA uses (batch, nheads, seqlen, headdim) instead
            (see `scaled_dot_product_attention`); a UserWarning is raised when q and k both have
            fewer positions than heads and at least 128 heads, the usual sign of SDPA-layout
            tensors passed here (on the first call of those shapes: later equal calls skip the
            checks they passed).
        k: (batch, seqlen_k, nheads_k, headdim), nheads_k dividing nheads (GQA/MQA: query head
            h reads kv head h // (nheads // nheads_k)).
        v: (batch, seqlen_k, nheads_k, headdim_v); headdim_v may differ from headdim.
        dropout_p: probability in [0, 1) of dropping each attention weight after the softmax
            (the kept ones are scaled by 1 / (1 - p)). The mask's seed is drawn from torch's
            default generator, so `torch.manual_seed` reproduces a call; the backward
            regenerates the mask instead of storing it. 0.0 (the default) at inference.
        softmax_scale: multiplies q . k before the softmax; default 1 / sqrt(headdim). Must be
            finite and positive.
        causal: query i sees keys j <= i + seqlen_k - seqlen_q (aligned bottom-right, as in
            flash-attn >= 2.1, so the last query sees the last key).
        window_size: (left, right): query i sees keys from i + shift - left to i + shift +
            right, shift = seqlen_k - seqlen_q; -1 leaves a side unbounded. (-1, -1), the
            default, is full attention; causal sets right = 0.
        softcap: c > 0 replaces each score s by c * tanh(s / c) (Gemma 2, Grok); 0.0 is off.
        alibi_slopes: float32 (nheads,) or (batch, nheads): subtracts slope * |i + shift - j|
            from each score, after softcap.
        deterministic: flash-attn's request for a reproducible backward. flashkit's backward
            is deterministic on every backend (gradients are accumulated without atomics), so
            this is accepted for compatibility and changes nothing.
        return_attn_probs: also return the log-sum-exp and the attention probabilities. The
            probabilities materialise the whole (seqlen_q, seqlen_k) matrix per head: for tests
            and inspection at small sizes.
        sink: optional (nheads,) tensor, one learnable logit per head that joins every row's
            softmax denominator without a value (attention sinks, as in gpt-oss). Receives a
            gradient when it requires one.
        backend: None (default) runs the Triton kernels for CUDA tensors and the tiled PyTorch
            backend otherwise; "triton", "torch" or "reference" (the materialised float64-able
            oracle) force one. A feature a backend cannot do raises NotImplementedError; there
            is no silent fallback.
        q_descale, k_descale, v_descale: for float8 (e4m3 / e5m2) q, k, v only (forward only,
            bfloat16 out): float32 factors, (1,) or (batch, nheads_k) (q_descale also (batch,
            nheads)), that undo each input's quantisation scale; see flashkit.fp8.
        score_mod, mask_mod, block_mask: a user-defined variant, with FlexAttention's meaning:
            score_mod(score, b, h, q_idx, kv_idx) rewrites each scaled score, mask_mod(b, h,
            q_idx, kv_idx) says which keys a query sees, and a block mask (create_block_mask)
            lets the kernels skip empty tiles; see docs/variants.md.
        return_softmax_lse: return (out, lse) without materialising the probabilities;
            return_attn_probs takes precedence.

    Returns:
        out (batch, seqlen_q, nheads, headdim_v) in q's dtype (bfloat16 for float8 q); with
        return_attn_probs, (out, lse, probs): lse (batch, nheads, seqlen_q) float32, the
        log-sum-exp of each row's scores before dropout (-inf for a row that sees no key, whose
        out is 0), and probs (batch, nheads, seqlen_q, seqlen_k); with return_softmax_lse
        alone, (out, lse).

    Raises:
        ValueError / TypeError naming the argument, before any kernel runs, for a wrong rank,
        shape, dtype or device, a bad scale, window, dropout_p or softcap.
    """
    # the call's tensor facts and scalar arguments, for _DENSE_CALLS (no modifier) or for the
    # kept calls of its modifier objects (variant_mods.kept_params)
    key = any_length_key = None
    modified = score_mod is not None or mask_mod is not None or block_mask is not None
    if (alibi_slopes is None and sink is None and q_descale is None and k_descale is None
            and v_descale is None and type(q) in _PLAIN_TENSORS
            and type(k) in _PLAIN_TENSORS and type(v) in _PLAIN_TENSORS
            and (backend is None or type(backend) is str)):
        scalars = kept.scalar_key(dropout_p, softmax_scale, causal, window_size, deterministic,
                                  softcap)
        if scalars is not None:
            key = (scalars, backend, *_tensor_facts(q), *_tensor_facts(k), *_tensor_facts(v))
            if modified:
                params = variant_mods.kept_params(score_mod, mask_mod, block_mask, key)
                if params is not None:
                    return run_backend(q, k, v, params, backend, return_attn_probs,
                                       return_softmax_lse)
            else:
                kept_call = _DENSE_CALLS.get(key)
                if kept_call is not None:
                    return _run_kept(kept_call, kept_call.params, q, k, v, backend,
                                     return_attn_probs, return_softmax_lse)
                any_length_key = _any_length_key(key, q, k, v, return_attn_probs)
                result = _run_any_length(any_length_key, q, k, v, return_softmax_lse)
                if result is not None:
                    return result
    checks.dense_qkv(q, k, v, checks.DTYPES + checks.FLOAT8_DTYPES)
    checks.warn_if_sdpa_layout(q, k)
    float8 = checks.descales(q, k, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    params = build_params(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                     deterministic, sink, batch=q.shape[0])
    if key is not None and not float8 and not modified:
        kept_call = _KeptCall(params, checks.backend(backend, q.device))
        kept.remember(_DENSE_CALLS, key, kept_call)
        result = _run_kept(kept_call, params, q, k, v, backend, return_attn_probs,
                           return_softmax_lse)
        _keep_any_length(any_length_key, kept_call, q, k, v)
        return result
    params = variant_mods.attach(params, q, score_mod, mask_mod, block_mask, q.shape[0],
                                 q.shape[2], q.shape[1], k.shape[1])
    if key is not None and not float8:  # a call with modifiers whose checks all passed
        variant_mods.keep_params(score_mod, mask_mod, block_mask, key, params)
    if float8:
        if params.variant is not None:
            raise NotImplementedError("score_mod/mask_mod/block_mask: float8 inputs take none")
        if return_softmax_lse:
            raise NotImplementedError("return_softmax_lse: not offered for float8 inputs")
        return fp8.attention(q, k, v, params, q_descale, k_descale, v_descale,
                             checks.backend(backend, q.device), return_attn_probs)
    return run_backend(q, k, v, params, backend, return_attn_probs, return_softmax_lse)


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
    device sync per check); by default CUDA tensors are checked on the device without a sync,
    where a bad entry fails a device-side assertion before any kernel reads it. The values are
    checked once per pair of cu_seqlens tensors: a later equal call (the next layer of a model)
    passing the same two tensors, not written in place since (their version counters), does
    not check them again. A write that torch does not see (through .data, a pointer handed to
    another library) is not noticed: pass new tensors after one.
    """
    # the call's scalars and tensor facts, for _VARLEN_CALLS (no modifier) or for the kept
    # calls of its modifier objects, which keep its params with its cu_seqlens' tensor_states
    key = None
    modified = score_mod is not None or mask_mod is not None or block_mask is not None
    if (alibi_slopes is None and sink is None and all(
            type(t) in _PLAIN_TENSORS for t in (q, k, v, cu_seqlens_q, cu_seqlens_k))
            and type(max_seqlen_q) is int and type(max_seqlen_k) is int
            and type(sync_checks) is bool and (backend is None or type(backend) is str)):
        scalars = kept.scalar_key(dropout_p, softmax_scale, causal, window_size, deterministic,
                                  softcap)
        if scalars is not None:
            key = (scalars, backend, sync_checks, max_seqlen_q, max_seqlen_k,
                   *_tensor_facts(q), *_tensor_facts(k), *_tensor_facts(v),
                   *_tensor_facts(cu_seqlens_q), *_tensor_facts(cu_seqlens_k))
            if modified:
                params, checked = variant_mods.kept_params(score_mod, mask_mod, block_mask,
                                                           key) or (None, None)
                if params is not None and kept.same_tensors(checked, (cu_seqlens_q, cu_seqlens_k)):
                    return run_backend(q, k, v, params, backend, return_attn_probs,
                                       return_softmax_lse)
            else:
                kept_call = _VARLEN_CALLS.get(key)
                if kept_call is not None:
                    params = kept_call.params_for(q, k, cu_seqlens_q, cu_seqlens_k,
                                                  sync_checks)
                    return _run_kept(kept_call, params, q, k, v, backend, return_attn_probs,
                                     return_softmax_lse)
    batch = checks.varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              sync_checks, triton=backend in (None, "triton"))
    params = build_params(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                     deterministic, sink, batch=batch, nheads=q.shape[1],
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k))
    if key is not None and not modified:
        kept_call = _KeptVarlen(params, checks.backend(backend, q.device))
        kept.remember(_VARLEN_CALLS, key, kept_call)
        return _run_kept(kept_call, params, q, k, v, backend, return_attn_probs,
                         return_softmax_lse)
    params = variant_mods.attach(params, q, score_mod, mask_mod, block_mask, batch, q.shape[1],
                                 int(max_seqlen_q), int(max_seqlen_k))
    if key is not None:  # a call with modifiers whose checks all passed
        variant_mods.keep_params(score_mod, mask_mod, block_mask, key,
                                 (params, kept.tensor_states(cu_seqlens_q, cu_seqlens_k)))
    return run_backend(q, k, v, params, backend, return_attn_probs, return_softmax_lse)


# Kept calls (flashkit.kept): calls with no tensor argument besides q, k, v (and cu_seqlens)
# repeat what an equal earlier call's checks found.
# _SCALAR_CALLS (build_params, every entry point): scalar arguments -> AttentionParams.
# _DENSE_CALLS (flash_attn_func, whose tensor checks it skips too): those and q's, k's and v's
# facts (_tensor_facts) -> _KeptCall.
# _ANY_LENGTH_CALLS (flash_attn_func without grad, on the Triton backend): the scalars, q's
# facts and k's and v's but for their length (kept.length_free) -> a _KeptCall whose forward
# runs every key length (the backend's any_length_forward): a decoding step over a cache one
# key longer each call finds it where every _DENSE_CALLS key misses.
# _VARLEN_CALLS (flash_attn_varlen_func): those, max_seqlen_q/k and the cu_seqlens' facts ->
# _KeptVarlen (a call with modifiers: its params, reused while it passes the same cu_seqlens
# unchanged, kept by the modifier objects).
_SCALAR_CALLS: dict = {}
_DENSE_CALLS: dict = {}
_ANY_LENGTH_CALLS: dict = {}
_VARLEN_CALLS: dict = {}


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # kept calls take no tensor subclass


def _tensor_facts(t) -> tuple:
    """What the checks and a kept forward plan read of q, k or v: type, shape, dtype, device,
    strides and whether its address is 16-byte aligned (TMA)."""
    return type(t), t.shape, t.dtype, t.device, t.stride(), t.data_ptr() % 16 == 0


class _KeptCall:
    """A kept call: its AttentionParams, the backend name its arguments give, and, once an
    equal call ran on the Triton backend, that forward's plan (the backend's planned_forward),
    which later equal calls run directly, and whose backward plans their gradients run
    (_Attention)."""
    __slots__ = ("params", "backend", "forward")

    def __init__(self, params: AttentionParams, backend: str):
        self.params, self.backend, self.forward = params, backend, None


class _KeptVarlen(_KeptCall):
    """A kept flash_attn_varlen_func call, whose params (cu_seqlens_q/k left out) take each
    call's own cu_seqlens. It remembers, by weak reference, the last two cu_seqlens whose
    values it checked, with their version counters then (every in-place write through torch
    bumps them): a call passing the same two tensors, unchanged since, checks nothing again
    (the layers of a model share one packed batch's cu_seqlens). The last params made are
    kept by weak reference too, and reused while they live (while an autograd node holds
    them: through a training step's forward)."""
    __slots__ = ("checked", "last")

    def __init__(self, params: AttentionParams, backend: str):
        super().__init__(dataclasses.replace(params, cu_seqlens_q=None, cu_seqlens_k=None),
                         backend)
        self.checked = kept.tensor_states(params.cu_seqlens_q, params.cu_seqlens_k)
        self.last = weakref.ref(params)

    def params_for(self, q, k, cu_seqlens_q, cu_seqlens_k, sync_checks) -> AttentionParams:
        """The call's params, its cu_seqlens' values checked unless they were the last ones
        checked, unchanged since."""
        if not kept.same_tensors(self.checked, (cu_seqlens_q, cu_seqlens_k)):
            template = self.params
            checks.varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, template.max_seqlen_q,
                                 template.max_seqlen_k, sync_checks,
                                 triton=self.backend == "triton")
            self.checked = kept.tensor_states(cu_seqlens_q, cu_seqlens_k)
        last = self.last()
        if (last is not None and last.cu_seqlens_q is cu_seqlens_q
                and last.cu_seqlens_k is cu_seqlens_k):
            return last
        params = dataclasses.replace(self.params, cu_seqlens_q=cu_seqlens_q,
                                     cu_seqlens_k=cu_seqlens_k)
        self.last = weakref.ref(params)
        return params


def _run_kept(kept_call: _KeptCall, params: AttentionParams, q, k, v, backend,
              return_attn_probs, return_softmax_lse):
    """run_backend for a kept call with its params: through the forward plan kept with it,
    where there is one (under autograd when q, k or v needs a gradient), unless it asks for
    the probabilities."""
    if return_attn_probs:
        return run_backend(q, k, v, params, backend, True, return_softmax_lse)
    planned = kept_call.forward
    result = None
    if planned is not None and planned.live:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            result = _Attention.apply(q, k, v, None, params, kept_call.backend, planned)
        else:
            result = planned(params, q, k, v)
    if result is None:  # no plan yet, or it declined (forgotten, another device)
        result = run_backend(q, k, v, params, backend, False, True)
        if kept_call.backend == "triton" and not (planned and planned.live):
            kept_call.forward = custom_op.backend_module("triton").planned_forward(q, k, v,
                                                                                  params)
    return result if return_softmax_lse else result[0]


def _any_length_key(key: tuple, q, k, v, return_attn_probs) -> tuple | None:
    """The _ANY_LENGTH_CALLS key of a call whose _DENSE_CALLS key is `key`, or None for a call
    that takes no plan for every length: one that needs gradients or the probabilities, k and
    v of two lengths (refused by the checks), a layout that is not length_free's, or at least
    128 query heads (whether the checks warn of SDPA's layout then depends on the length)."""
    if (return_attn_probs or k.dim() != 4 or v.dim() != 4 or k.shape[1] != v.shape[1]
            or q.dim() != 4 or q.shape[2] >= 128 or (torch.is_grad_enabled() and (
                q.requires_grad or k.requires_grad or v.requires_grad))):
        return None
    layouts = kept.length_free(k), kept.length_free(v)
    return None if None in layouts else (*key[:8], *layouts)


def _run_any_length(key: tuple | None, q, k, v, return_softmax_lse):
    """The call through the plan for every key length kept under key, or None where there is
    none or it declines (the call then takes the checks and the dispatch)."""
    kept_call = None if key is None else _ANY_LENGTH_CALLS.get(key)
    if kept_call is None:
        return None
    result = kept_call.forward(kept_call.params, q, k, v)
    if result is None or return_softmax_lse:
        return result
    return result[0]


def _keep_any_length(key: tuple | None, kept_call: _KeptCall, q, k, v) -> None:
    """Keep, under key, the plans for every key length of a call that just ran with its checks
    passed (kept_call: its params and forward plan), where the Triton backend offers them: the
    call's plan joins those of its class for the call's range of key lengths."""
    if key is None or kept_call.backend != "triton" or kept_call.forward is None:
        return
    any_length = _ANY_LENGTH_CALLS.get(key)  # the class's plans, for other lengths
    forward = custom_op.backend_module("triton").any_length_forward(
        kept_call.forward, q, k, v, kept_call.params,
        None if any_length is None else any_length.forward)
    if forward is not None and any_length is None:
        any_length = _KeptCall(kept_call.params, "triton")
        any_length.forward = forward
        kept.remember(_ANY_LENGTH_CALLS, key, any_length)


def build_params(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
            deterministic, sink, batch, nheads=None, **varlen) -> AttentionParams:
    """Check the scalar and per-head arguments and gather them for the backends (an equal
    earlier call's AttentionParams, an immutable value, when it had no tensor argument among
    them: see _SCALAR_CALLS)."""
    key = None
    if alibi_slopes is None and sink is None and not varlen:
        key = kept.scalar_key(dropout_p, softmax_scale, causal, window_size, deterministic,
                              softcap)
        key = None if key is None else (q.shape[-1], key)
        params = None if key is None else _SCALAR_CALLS.get(key)
        if params is not None:
            return params
    params = _checked_params(q, dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, deterministic, sink, batch, nheads, **varlen)
    if key is not None:
        kept.remember(_SCALAR_CALLS, key, params)
    return params


def _checked_params(q, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    deterministic, sink, batch, nheads=None, **varlen) -> AttentionParams:
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


def run_backend(q, k, v, params: AttentionParams, backend, return_attn_probs, return_softmax_lse):
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
    from that out, as every FlashAttention does (and the sink's gradient sums rowsum(P * dP)
    from the backward's float32 tiles). planned: a kept call's forward plan (the Triton
    backend's planned_forward), which runs the forward and finds the backward's plan, or None
    (the backend's forward and backward choose; so do they where the plan declines)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, params: AttentionParams, backend: str, planned=None):
        result = None if planned is None else planned(params, q, k, v)
        out, lse = (custom_op.backend_module(backend).forward(q, k, v, params) if result is None
                    else result)
        # The sink too, so autograd sees it modified in place before the backward (it is an
        # input: no extra memory); params' other tensors take no gradient.
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.params, ctx.backend, ctx.planned = params, backend, planned
        ctx.set_materialize_grads(False)  # an unused lse passes None, not a tensor of zeros
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, _ = ctx.saved_tensors
        params = ctx.params
        dout = torch.zeros_like(out, dtype=q.dtype) if dout is None else dout
        grads = (None if ctx.planned is None else
                 ctx.planned.backward(dout, q, k, v, out, lse, params, dlse=dlse))
        if grads is None:
            grads = custom_op.backend_module(ctx.backend).backward(dout, q, k, v, out, lse,
                                                                   params, dlse=dlse)
        dq, dk, dv, dsink = grads
        return dq, dk, dv, dsink, None, None, None


def require_available(name: str, device: torch.device) -> None:
    """Raise a clear error if the named backend cannot run on `device` here."""
    if name != "triton":
        return
    if not _TRITON_INSTALLED:
        raise ImportError("backend 'triton' needs the triton package: pip install "
                          "'flashkit-attn[gpu]', or pass backend='torch'")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend 'triton' runs on CUDA tensors (got {device}); set "
                         "TRITON_INTERPRET=1 to run its kernels in the interpreter, or pass "
                         "backend='torch'")


# Looked up once, at import: torch.compile cannot trace importlib's finder.
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
