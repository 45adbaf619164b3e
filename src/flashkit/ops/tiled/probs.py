"""The attention weights themselves, for return_attn_probs: testing at small sizes only, since
they are the (seqlen_q, seqlen_k) matrix the rest of the backend never builds."""

from __future__ import annotations

import math

import torch

from flashkit.ops.params import AttentionParams, accumulation_dtype
from flashkit.ops.tiled import dropout, layout, tile
from flashkit.ops.tiled.forward import BLOCK_M, BLOCK_N


def attention_probs(q, k, v, lse, params: AttentionParams):
    """exp(s - lse) per tile, times keep / (1 - p) under dropout: (batch, nheads, seqlen_q,
    seqlen_k) in float32 (float64 for float64 inputs); varlen: a list of (nheads, sq, sk)."""
    if not params.is_varlen:
        return _dense_probs(q, k, lse, params, params.alibi_slopes)
    return [_dense_probs(q[None, sq], k[None, sk], lse[None, :, sq], params,
                         layout.sequence_slopes(params, b), batch0=b)[0]
            for b, sq, sk in layout.sequences(params)]


def _dense_probs(q, k, lse, params: AttentionParams, alibi_slopes, batch0=0):
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    shift = seqlen_k - seqlen_q
    acc_dtype = accumulation_dtype(q.dtype)
    q_g, k_g = layout.group_heads(q, nheads_k), layout.group_heads(k, nheads_k)
    slopes = layout.group_slopes(alibi_slopes, nheads_k, acc_dtype)
    bias = layout.group_bias(params.attn_bias, nheads_k)
    lse_g = lse.unflatten(1, (nheads_k, -1)).to(acc_dtype)
    lse_safe = torch.where(lse_g == -math.inf, torch.full_like(lse_g, math.inf), lse_g)

    probs = torch.zeros(batch, nheads, seqlen_q, seqlen_k, dtype=acc_dtype, device=q.device)
    probs_g = probs.unflatten(1, (nheads_k, -1))  # (b, hk, g, sq, sk)
    for i0 in range(0, seqlen_q, BLOCK_M):
        i1 = min(i0 + BLOCK_M, seqlen_q)
        lo, hi = tile.key_range(i0, i1, seqlen_k, shift, params)
        for j0 in range(lo, hi, BLOCK_N):
            j1 = min(j0 + BLOCK_N, hi)
            s, _ = tile.scores(q_g[..., i0:i1, :].to(acc_dtype), k_g[..., j0:j1, :].to(acc_dtype),
                               i0, i1, j0, j1, shift, params, slopes, bias, batch0)
            p = torch.exp(s - lse_safe[..., i0:i1, None])
            drop = dropout.tile_scale(params, batch0, p.shape[:3], i0, i1, j0, j1, acc_dtype,
                                      q.device)
            probs_g[..., i0:i1, j0:j1] = p if drop is None else p * drop
    return probs
