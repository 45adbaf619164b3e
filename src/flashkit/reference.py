"""The materialised oracle: every feature of docs/design.md section 1, the whole score matrix
in memory.

It computes in the dtype of its inputs, so the same function gives both the float64 oracle and the
"torch in dtype t" baseline of the tolerance rule (docs/design.md section 5). It is differentiable
by autograd, the sink included, and never produces NaN for a row that sees no key: that row's output
is 0 and its log-sum-exp is -inf.

Entry points:
    attention(q, k, v, ...)            flash-attn's conventions (window -1 = unbounded)
    attention_with_params(q, k, v, p)  the backends' AttentionParams (see flashkit.ops.params)
    kvcache_attention(q, k_cache, ...) attention over each sequence's cached keys (decoding)
"""

from __future__ import annotations

import dataclasses
import math

import torch

from flashkit.ops.params import AttentionParams

__all__ = ["attention", "attention_with_params", "kvcache_attention", "visible",
           "alibi_distance"]


def visible(seqlen_q: int, seqlen_k: int, window_left: int | None, window_right: int | None,
            device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: key j is visible from query i (bottom-right aligned band)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diag = i + (seqlen_k - seqlen_q)  # the key column on query i's diagonal
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_left is not None:
        keep &= j >= diag - window_left
    if window_right is not None:
        keep &= j <= diag + window_right
    return keep


def alibi_distance(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) float: |i + shift - j|, the distance ALiBi's slope multiplies."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return (i + (seqlen_k - seqlen_q) - j).abs().to(torch.float32)


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, sink=None, dropout_p=0.0, dropout_mask=None,
              cu_seqlens_q=None, cu_seqlens_k=None, return_probs=False):
    """Attention with flash-attn's arguments. Returns (out, lse) or (out, lse, probs).

    q (batch, seqlen_q, nheads, d), k/v (batch, seqlen_k, nheads_k, d[_v]); varlen: (total, h, d)
    with int32 cu_seqlens. dropout_mask (batch, nheads, seqlen_q, seqlen_k) bool (True = keep) is
    required when dropout_p > 0: the oracle takes the mask a kernel used, it never draws one.
    probs are the post-dropout attention weights, (batch, nheads, seqlen_q, seqlen_k).
    """
    left, right = window_size
    params = AttentionParams(
        softmax_scale=q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale,
        window_left=None if left < 0 else left,
        window_right=0 if causal else (None if right < 0 else right),
        softcap=softcap, alibi_slopes=alibi_slopes, sink=sink, dropout_p=dropout_p,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return attention_with_params(q, k, v, params, dropout_mask=dropout_mask,
                                 return_probs=return_probs)


def attention_with_params(q, k, v, params: AttentionParams, dropout_mask=None,
                          return_probs=False):
    """Attention as the backends see it. Returns (out, lse) or (out, lse, probs)."""
    if params.dropout_p > 0 and dropout_mask is None:
        raise ValueError("dropout_mask: the oracle needs the keep-mask when dropout_p > 0 "
                         "(flashkit.testing.dropout_keep_mask rebuilds a kernel's)")
    if not params.is_varlen:
        return _dense(q, k, v, params, params.alibi_slopes, dropout_mask, return_probs)

    # Varlen: each sequence is an independent dense problem on its slice of the packed tokens.
    cu_q, cu_k = params.cu_seqlens_q.tolist(), params.cu_seqlens_k.tolist()
    outs, lses, probs = [], [], []
    for b in range(len(cu_q) - 1):
        sl_q, sl_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        slopes = params.alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        mask = None
        if dropout_mask is not None:
            mask = dropout_mask[b:b + 1, :, :sl_q.stop - sl_q.start, :sl_k.stop - sl_k.start]
        res = _dense(q[None, sl_q], k[None, sl_k], v[None, sl_k], params, slopes, mask,
                     return_probs, batch0=b)
        outs.append(res[0][0])
        lses.append(res[1][0])
        if return_probs:
            probs.append(res[2][0])
    out, lse = torch.cat(outs, 0), torch.cat(lses, -1)
    return (out, lse, probs) if return_probs else (out, lse)


def _dense(q, k, v, params: AttentionParams, alibi_slopes, dropout_mask, return_probs,
           batch0=0):
    """batch0: the index of q's first batch entry (a varlen sequence), for user modifiers."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    group = nheads // nheads_k
    qh = q.transpose(1, 2)  # (b, h, sq, d)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)  # (b, h, sk, d): GQA by repetition
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)

    s = (qh @ kh.transpose(-1, -2)) * params.softmax_scale  # (b, h, sq, sk)
    if params.softcap > 0:
        s = params.softcap * torch.tanh(s / params.softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(s.dtype).reshape(-1 if alibi_slopes.dim() == 2 else 1,
                                                   nheads, 1, 1)
        s = s - slopes * alibi_distance(seqlen_q, seqlen_k, s.device).to(s.dtype)
    if params.attn_bias is not None:
        s = s + params.attn_bias.to(s.dtype)
    if params.variant is not None:  # user score_mod, then mask_mod (flashkit.variants)
        s = params.variant.dense(s, batch0)
    keep = visible(seqlen_q, seqlen_k, params.window_left, params.window_right, s.device)
    s = s.masked_fill(~keep, -math.inf)

    # Safe softmax. The max is a constant shift (softmax does not depend on it): detach it, and
    # use 0 for rows where everything is masked so exp(-inf - 0) = 0 instead of NaN.
    m = (s.detach().amax(-1, keepdim=True) if seqlen_k > 0  # amax cannot reduce an empty row
         else s.new_full((*s.shape[:-1], 1), -math.inf))
    sink = None
    if params.sink is not None:
        sink = params.sink.to(s.dtype).reshape(1, nheads, 1, 1)
        m = torch.maximum(m, sink.detach())
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    if sink is not None:
        l = l + torch.exp(sink - m)
    has_mass = l > 0
    l_safe = torch.where(has_mass, l, torch.ones_like(l))
    probs = p / l_safe
    lse = torch.where(has_mass, torch.log(l_safe) + m, torch.full_like(l, -math.inf))

    if params.dropout_p > 0:
        probs = probs * dropout_mask.to(probs.dtype) / (1.0 - params.dropout_p)
    out = (probs @ vh).transpose(1, 2)  # (b, sq, h, dv)
    lse = lse.squeeze(-1)  # (b, h, sq)
    return (out, lse, probs) if return_probs else (out, lse)


def cached_keys(cache, b: int, start: int, end: int, cache_batch_idx, block_table):
    """Slots [start, end) of sequence b of a cache as (1, end - start, hk, d): row
    cache_batch_idx[b] of a contiguous cache (batch_cache, capacity, hk, d), or slot p in page
    block_table[b, p // page_size] of a paged one (num_blocks, page_size, hk, d)."""
    positions = torch.arange(start, end, device=cache.device)
    if block_table is None:
        return cache[int(cache_batch_idx[b])][positions][None]
    page_size = cache.shape[1]
    pages = block_table[b].long()[positions // page_size]
    return cache[pages, positions % page_size][None]


def kvcache_attention(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad,
                      block_table, params: AttentionParams):
    """(out, lse) of q (batch, seqlen_q, h, d) over each sequence's cached keys, the append
    already done: sequence b's keys are its slots [leftpad_b, leftpad_b + seqlens_k[b]).
    seqlens_k, cache_batch_idx, cache_leftpad: int32 (batch,); block_table int32 (batch, pages)
    or None. lse is (batch, h, seqlen_q) in float32 (float64 for float64 inputs)."""
    outs, lses = [], []
    for b, (seqlen_k, leftpad) in enumerate(zip(seqlens_k.tolist(), cache_leftpad.tolist(),
                                                strict=True)):
        k_b, v_b = (cached_keys(c, b, leftpad, leftpad + seqlen_k, cache_batch_idx,
                                block_table) for c in (k_cache, v_cache))
        slopes = params.alibi_slopes
        params_b = params if slopes is None or slopes.dim() == 1 else dataclasses.replace(
            params, alibi_slopes=slopes[b])
        if seqlen_k == 0:  # no key: out 0, lse the sink's logit or -inf (section 1)
            out_b = q.new_zeros(1, *q.shape[1:3], v_cache.shape[-1])
            lse_b = torch.full((1, q.shape[2], q.shape[1]), -math.inf, dtype=q.dtype,
                               device=q.device)
            if params.sink is not None:
                lse_b[:] = params.sink.to(q.dtype)[None, :, None]
        else:
            out_b, lse_b = attention_with_params(q[b:b + 1], k_b, v_b, params_b)
        outs.append(out_b)
        lses.append(lse_b)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.cat(outs), torch.cat(lses).to(lse_dtype)
