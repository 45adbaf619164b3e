"""Tiled forward pass, FA2 loop order: Q tiles outer, KV tiles inner, running (m, l, acc) per row.

No tensor larger than one (BLOCK_M, BLOCK_N) tile of scores per head ever exists, so memory grows
linearly with sequence length. Arithmetic and lse are float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import math

import torch

from flashkit.ops.params import AttentionParams, accumulation_dtype, lse_shape
from flashkit.ops.tiled import dropout, layout, tile

BLOCK_M = 128
BLOCK_N = 128


def forward(q, k, v, params: AttentionParams, block_m: int = BLOCK_M, block_n: int = BLOCK_N):
    """(out, lse) for dense or varlen inputs; see flashkit.ops.params for the layouts."""
    if not params.is_varlen:
        return forward_dense(q, k, v, params, params.alibi_slopes, block_m, block_n)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = torch.empty(lse_shape(q, params), dtype=accumulation_dtype(q.dtype), device=q.device)
    for b, sq, sk in layout.sequences(params):
        out_b, lse_b = forward_dense(q[None, sq], k[None, sk], v[None, sk], params,
                                     layout.sequence_slopes(params, b), block_m, block_n,
                                     batch0=b)
        out[sq], lse[:, sq] = out_b[0], lse_b[0]
    return out, lse


def forward_dense(q, k, v, params: AttentionParams, alibi_slopes, block_m=BLOCK_M,
                  block_n=BLOCK_N, batch0=0):
    """One dense batch; batch0 is the index of its first sequence (for the dropout mask)."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k, head_dim_v = k.shape[1], k.shape[2], v.shape[-1]
    shift = seqlen_k - seqlen_q
    acc_dtype = accumulation_dtype(q.dtype)

    q_g = layout.group_heads(q, nheads_k)  # (b, hk, g, sq, d)
    k_g = layout.group_heads(k, nheads_k)  # (b, hk, 1, sk, d)
    v_g = layout.group_heads(v, nheads_k)
    slopes = layout.group_slopes(alibi_slopes, nheads_k, acc_dtype)
    bias = layout.group_bias(params.attn_bias, nheads_k)

    out = q.new_empty(batch, seqlen_q, nheads, head_dim_v)
    lse = torch.empty(batch, nheads, seqlen_q, dtype=acc_dtype, device=q.device)
    out_g = layout.group_heads(out, nheads_k)  # views we write through
    lse_g = lse.unflatten(1, (nheads_k, -1))  # (b, hk, g, sq)

    state_shape = (batch, nheads_k, nheads // nheads_k)
    for i0 in range(0, seqlen_q, block_m):
        i1 = min(i0 + block_m, seqlen_q)
        q_t = q_g[..., i0:i1, :].to(acc_dtype)
        # The sink is a logit with no value: start every row's state from it (l = exp(0) = 1).
        if params.sink is None:
            m = torch.full((*state_shape, i1 - i0), -math.inf, dtype=acc_dtype, device=q.device)
            l = torch.zeros_like(m)
        else:
            m = params.sink.to(acc_dtype).reshape(1, *state_shape[1:], 1).expand(
                *state_shape, i1 - i0)
            l = torch.ones_like(m)
        acc = torch.zeros(*state_shape, i1 - i0, head_dim_v, dtype=acc_dtype, device=q.device)

        lo, hi = tile.key_range(i0, i1, seqlen_k, shift, params)
        for j0 in range(lo, hi, block_n):
            j1 = min(j0 + block_n, hi)
            s, _ = tile.scores(q_t, k_g[..., j0:j1, :].to(acc_dtype), i0, i1, j0, j1, shift,
                               params, slopes, bias, batch0)
            drop = dropout.tile_scale(params, batch0, state_shape, i0, i1, j0, j1, acc_dtype,
                                      q.device)
            m, l, acc = tile.online_update(m, l, acc, s, v_g[..., j0:j1, :].to(acc_dtype), drop)

        out_t, lse_t = tile.finalize(m, l, acc)
        out_g[..., i0:i1, :] = out_t.to(out.dtype)
        lse_g[..., i0:i1] = lse_t
    return out, lse
