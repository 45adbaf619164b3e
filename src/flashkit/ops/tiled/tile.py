"""What one (BLOCK_M, BLOCK_N) tile of scores needs, shared by the forward and backward passes.

Notation: rows i are queries, columns j are keys, shift = seqlen_k - seqlen_q puts query i's
diagonal at key i + shift (bottom-right alignment). Tensors keep the query heads split as
(kv head, group) so that K and V broadcast over the group instead of being repeated (GQA):

    q tile  (b, hk, g, BM, d)      k, v tile  (b, hk, 1, BN, d)      scores  (b, hk, g, BM, BN)
"""

from __future__ import annotations

import math

import torch

from flashkit.ops.params import AttentionParams


def key_range(i0: int, i1: int, seqlen_k: int, shift: int, params: AttentionParams):
    """Keys [lo, hi) that some query in [i0, i1) can see; lo >= hi means none."""
    lo = 0 if params.window_left is None else max(0, i0 + shift - params.window_left)
    hi = seqlen_k if params.window_right is None else min(seqlen_k,
                                                          i1 - 1 + shift + params.window_right + 1)
    return lo, hi


def query_range(j0: int, j1: int, seqlen_q: int, shift: int, params: AttentionParams):
    """Queries [lo, hi) that can see some key in [j0, j1); lo >= hi means none."""
    lo = 0 if params.window_right is None else max(0, j0 - shift - params.window_right)
    hi = seqlen_q if params.window_left is None else min(seqlen_q,
                                                         j1 - 1 - shift + params.window_left + 1)
    return lo, hi


def band_mask(i0, i1, j0, j1, shift, params: AttentionParams, device):
    """(BM, BN) bool of visible pairs, or None when the whole tile is visible (no masking cost)."""
    left, right = params.window_left, params.window_right
    # Corners decide: the band's edges are diagonals, so the tile is inside iff its corners are.
    inside_left = left is None or j0 >= (i1 - 1) + shift - left
    inside_right = right is None or j1 - 1 <= i0 + shift + right
    if inside_left and inside_right:
        return None
    diag = torch.arange(i0, i1, device=device)[:, None] + shift  # (BM, 1) key on the diagonal
    j = torch.arange(j0, j1, device=device)[None, :]
    keep = torch.ones(i1 - i0, j1 - j0, dtype=torch.bool, device=device)
    if left is not None:
        keep &= j >= diag - left
    if right is not None:
        keep &= j <= diag + right
    return keep


def gradient_pairs(s, i0, i1, seqlen_k, shift, params: AttentionParams, lse_grad: bool):
    """(.., BM, BN) bool: where dS = P (dP - D) may be nonzero in a tile of scores s. Masked
    pairs (s = -inf) are out, so a NaN dP from a value the row cannot see stays out of dS; so
    are rows that see exactly one key, without a sink and without a gradient on lse (lse_grad;
    either makes the row depend on its one score): their softmax is the constant 1, and
    computing P (dP - D) would leave the rounding of two differently ordered dot products
    (dP = dO . v_j, D = dO . O with O = v_j) in dq and dk."""
    pairs = s > -math.inf
    if params.sink is None and not lse_grad:
        i = torch.arange(i0, i1, device=s.device)[:, None] + shift  # (BM, 1) the diagonal
        first = torch.zeros_like(i) if params.window_left is None else (
            i - params.window_left).clamp(min=0)
        last = torch.full_like(i, seqlen_k - 1) if params.window_right is None else (
            i + params.window_right).clamp(max=seqlen_k - 1)
        pairs = pairs & (first != last)
    return pairs


def scores(q_t, k_t, i0, i1, j0, j1, shift, params: AttentionParams, slopes, bias, batch0=0,
           grad=False):
    """Masked scores of one tile and, for the backward pass (grad=True), their chain rule.

    q_t (b, hk, g, BM, d), k_t (b, hk, 1, BN, d) in the accumulation dtype; slopes (b|1, hk, g)
    or None; bias: the 5-D (b|1, hk|1, g|1, sq, sk) view of the SDPA bias, or None; batch0:
    the batch index of q_t's first entry (a varlen sequence), for user modifiers.
    Returns s (b, hk, g, BM, BN) with -inf where masked, and chain: a function taking dL/ds to
    dL/d(scale * q.k) (softcap's 1 - tanh^2, a score_mod's vector-Jacobian product), or None
    where that is the identity.
    """
    s = (q_t @ k_t.transpose(-1, -2)) * params.softmax_scale  # [BM, BN] = [BM, d] @ [d, BN]
    chain = None
    if params.softcap > 0:
        tanh = torch.tanh(s / params.softcap)
        s = params.softcap * tanh
        chain = lambda ds: ds * (1 - tanh * tanh)  # noqa: E731  d(cap tanh(x / cap))/dx
    if slopes is not None:
        i = torch.arange(i0, i1, device=s.device, dtype=s.dtype)[:, None] + shift
        j = torch.arange(j0, j1, device=s.device, dtype=s.dtype)[None, :]
        s = s - slopes[..., None, None] * (i - j).abs()
    if bias is not None:
        s = s + bias[..., i0:i1, j0:j1].to(s.dtype)
    if params.variant is not None:  # user score_mod, then mask_mod (flashkit.variants)
        s, chain = params.variant.grouped_tile(s, batch0, i0, i1, j0, j1, chain, grad)
    keep = band_mask(i0, i1, j0, j1, shift, params, s.device)
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    return s, chain


def online_update(m, l, acc, s, v_t, dropout=None):
    """Fold one tile of scores into the running (max, sum, output) state of each row.

    m, l (b, hk, g, BM); acc (b, hk, g, BM, dv); s (b, hk, g, BM, BN); v_t (b, hk, 1, BN, dv);
    dropout: keep / (1 - p) like s, or None. The old state is rescaled by exp(m_old - m_new) so
    every term shares the newest max. l sums the probabilities before dropout (lse is the
    pre-dropout log-sum-exp); only the output sees the dropped ones. A row that has seen only
    -inf keeps m = -inf; exp is then taken against 0, giving 0, not NaN.
    """
    m_new = torch.maximum(m, s.amax(-1))
    m_safe = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
    p = torch.exp(s - m_safe[..., None])
    alpha = torch.exp(m - m_safe)
    l = l * alpha + p.sum(-1)
    if dropout is not None:
        p = p * dropout
    acc = acc * alpha[..., None] + values_product(p, s, v_t)
    return m_new, l, acc


def values_product(p, s, v_t):
    """p @ v_t ([BM, dv] = [BM, BN] @ [BN, dv]) where a key a row cannot see (s = -inf, so
    p = 0) adds nothing even if its value is NaN or inf: 0 * NaN would otherwise reach every
    row of the tile. A row that sees a non-finite value gets NaN in that column, as the math
    gives NaN or inf there. Values are scanned first, so finite tiles pay one isfinite."""
    bad = ~torch.isfinite(v_t)
    if not bad.any():
        return p @ v_t
    seen = (s > -math.inf).to(p.dtype)
    hit = (seen @ bad.to(p.dtype)) > 0  # (..., BM, dv): a visible key has a non-finite value
    return (p @ v_t.masked_fill(bad, 0.0)).masked_fill(hit, math.nan)


def merge_by_lse(out_parts, lse_parts):
    """Merge partial results over disjoint key sets by their log-sum-exps (split-KV, ring steps).

    out_parts (S, ..., dv) normalised per part, lse_parts (S, ...): lse = log sum_s exp(lse_s),
    out = sum_s exp(lse_s - lse) out_s. Parts with lse -inf weigh 0; if all do, out 0, lse -inf.
    """
    lse = torch.logsumexp(lse_parts, dim=0)
    lse_safe = torch.where(lse == -math.inf, torch.zeros_like(lse), lse)
    weights = torch.exp(lse_parts - lse_safe)  # (S, ...), 0 for empty parts
    return (weights[..., None] * out_parts).sum(0), lse


def finalize(m, l, acc):
    """(out, lse) of the running state; a row with no mass (l = 0) gives out 0 and lse -inf."""
    has_mass = l > 0
    l_safe = torch.where(has_mass, l, torch.ones_like(l))
    out = acc / l_safe[..., None]
    lse = torch.where(has_mass, m + torch.log(l_safe), torch.full_like(l, -math.inf))
    return out, lse
