"""Tiled backward pass: KV tiles outer (dK, dV accumulate in place), Q tiles inner.

P is recomputed from the saved log-sum-exp instead of being stored, and the softmax Jacobian
collapses to dS = P * (dP - D) with D = rowsum(dO * O), one number per query row: that is what
lets the backward pass see one tile at a time. A gradient on the lse output adds to D's role:
d(lse_i)/d(s_ij) = P_ij, so D becomes D - dlse.

A sink's gradient sums exp(sink - lse_i) * D_i over every row. D_i = rowsum(P_i * dP_i) too, and
that sum, taken over the tiles from P and dP in the accumulation dtype, carries none of the
rounding of O's values that the forward's products leave in dO * O: where each other gradient
reads D once per row, dsink adds up every row's error, so it takes the tiles' sum.
"""

from __future__ import annotations

import math

import torch

from flashkit.ops.params import AttentionParams, accumulation_dtype
from flashkit.ops.tiled import dropout, layout, tile
from flashkit.ops.tiled.forward import BLOCK_M, BLOCK_N


def backward(dout, q, k, v, out, lse, params: AttentionParams, dlse=None,
             block_m: int = BLOCK_M, block_n: int = BLOCK_N, own_lse: bool = True,
             grad_dtype: torch.dtype | None = None):
    """(dq, dk, dv, dsink) for dense or varlen inputs; dsink is None without a sink.
    own_lse=False: lse is one over more keys than this call's (ring attention's merged lse).
    grad_dtype: dq, dk, dv in this dtype instead of the inputs' (ring attention sums its steps'
    gradients in the accumulation dtype)."""
    if not params.is_varlen:
        dq, dk, dv, dsink = backward_dense(dout, q, k, v, out, lse, params, params.alibi_slopes,
                                           dlse, block_m, block_n, own_lse=own_lse,
                                           grad_dtype=grad_dtype)
    else:
        dq, dk, dv = (torch.empty_like(x, dtype=grad_dtype) for x in (q, k, v))
        dsink = None
        for b, sq, sk in layout.sequences(params):
            grads = backward_dense(dout[None, sq], q[None, sq], k[None, sk], v[None, sk],
                                   out[None, sq], lse[None, :, sq], params,
                                   layout.sequence_slopes(params, b),
                                   None if dlse is None else dlse[None, :, sq], block_m,
                                   block_n, batch0=b, own_lse=own_lse, grad_dtype=grad_dtype)
            dq[sq], dk[sk], dv[sk] = grads[0][0], grads[1][0], grads[2][0]
            if grads[3] is not None:
                dsink = grads[3] if dsink is None else dsink + grads[3]
    # dsink is summed in the accumulation dtype and rounded to the sink's once
    return dq, dk, dv, None if dsink is None else dsink.to(params.sink.dtype)


def backward_dense(dout, q, k, v, out, lse, params: AttentionParams, alibi_slopes, dlse=None,
                   block_m=BLOCK_M, block_n=BLOCK_N, batch0=0, own_lse=True, grad_dtype=None):
    """One dense batch; batch0 is the index of its first sequence (for the dropout mask)."""
    seqlen_q, nheads = q.shape[1], q.shape[2]
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    shift = seqlen_k - seqlen_q
    acc_dtype = accumulation_dtype(q.dtype)
    scale = params.softmax_scale

    q_g, do_g = layout.group_heads(q, nheads_k), layout.group_heads(dout, nheads_k)
    k_g, v_g = layout.group_heads(k, nheads_k), layout.group_heads(v, nheads_k)
    slopes = layout.group_slopes(alibi_slopes, nheads_k, acc_dtype)
    bias = layout.group_bias(params.attn_bias, nheads_k)

    lse_g = lse.unflatten(1, (nheads_k, -1)).to(acc_dtype)  # (b, hk, g, sq)
    # A row with no visible key has lse = -inf; +inf there makes exp(s - lse) = 0, not NaN.
    lse_safe = torch.where(lse_g == -math.inf, torch.full_like(lse_g, math.inf), lse_g)
    delta = (dout.to(acc_dtype) * out.to(acc_dtype)).sum(-1)  # D = rowsum(dO * O): (b, sq, h)
    delta = delta.transpose(1, 2).unflatten(1, (nheads_k, -1))  # (b, hk, g, sq)
    if dlse is not None:
        delta = delta - dlse.unflatten(1, (nheads_k, -1)).to(acc_dtype)

    dq_acc = torch.zeros(q_g.shape, dtype=acc_dtype, device=q.device)  # (b, hk, g, sq, d)
    # rowsum(P * dP) from the tiles, for dsink (see the module docstring): (b, hk, g, sq)
    row_pdp = None if params.sink is None else torch.zeros_like(lse_g)
    dk, dv = torch.empty_like(k, dtype=grad_dtype), torch.empty_like(v, dtype=grad_dtype)
    dk_g, dv_g = layout.group_heads(dk, nheads_k), layout.group_heads(dv, nheads_k)

    for j0 in range(0, seqlen_k, block_n):
        j1 = min(j0 + block_n, seqlen_k)
        k_t, v_t = k_g[..., j0:j1, :].to(acc_dtype), v_g[..., j0:j1, :].to(acc_dtype)
        dk_t, dv_t = torch.zeros_like(k_t), torch.zeros_like(v_t)  # (b, hk, 1, BN, d)
        lo, hi = tile.query_range(j0, j1, seqlen_q, shift, params)
        for i0 in range(lo, hi, block_m):
            i1 = min(i0 + block_m, hi)
            q_t, do_t = q_g[..., i0:i1, :].to(acc_dtype), do_g[..., i0:i1, :].to(acc_dtype)
            s, chain = tile.scores(q_t, k_t, i0, i1, j0, j1, shift, params, slopes, bias,
                                   batch0, grad=True)
            p = torch.exp(s - lse_safe[..., i0:i1, None])  # (b, hk, g, BM, BN)
            # Dropout: out = (P * Z) @ V with Z = keep / (1 - p), so dV sees P * Z and dP gains Z.
            drop = dropout.tile_scale(params, batch0, p.shape[:3], i0, i1, j0, j1, acc_dtype,
                                      q.device)
            p_kept = p if drop is None else p * drop
            # The group's query heads all read this kv head: their contributions add up.
            dv_t += (p_kept.transpose(-1, -2) @ do_t).sum(2, keepdim=True)  # [BN, BM] @ [BM, dv]
            dp = do_t @ v_t.transpose(-1, -2)  # [BM, BN] = [BM, dv] @ [dv, BN]
            if drop is not None:
                dp = dp * drop
            if row_pdp is not None:  # masked pairs out: a value a row cannot see may be NaN
                row_pdp[..., i0:i1] += torch.where(s > -math.inf, p * dp, 0.0).sum(-1)
            ds = torch.where(tile.gradient_pairs(s, i0, i1, seqlen_k, shift, params,
                                                 dlse is not None or not own_lse),
                             p * (dp - delta[..., i0:i1, None]), 0.0)
            if chain is not None:  # softcap, score_mod: back to d / d(scale * q.k)
                ds = chain(ds)
            dq_acc[..., i0:i1, :] += scale * (ds @ k_t)  # [BM, d] = [BM, BN] @ [BN, d]
            dk_t += scale * (ds.transpose(-1, -2) @ q_t).sum(2, keepdim=True)  # [BN, d]
        dk_g[..., j0:j1, :], dv_g[..., j0:j1, :] = dk_t, dv_t

    dq = torch.empty_like(q, dtype=grad_dtype)
    layout.group_heads(dq, nheads_k)[...] = dq_acc
    dsink = None
    if row_pdp is not None:
        # d(lse_i)/d(sink) = P_sink,i and dL/d(lse_i) = dlse_i - D_i: dsink = -sum P_sink (D - dlse)
        if dlse is not None:
            row_pdp = row_pdp - dlse.unflatten(1, (nheads_k, -1)).to(acc_dtype)
        p_sink = torch.exp(params.sink.to(acc_dtype).reshape(1, nheads_k, -1, 1) - lse_g)
        dsink = -(p_sink * row_pdp).sum((0, 3)).reshape(nheads)  # accumulation dtype
    return dq, dk, dv, dsink
