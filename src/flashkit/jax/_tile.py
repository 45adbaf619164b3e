"""The tile math shared by every JAX implementation: one mask predicate, one online-softmax step.

Glossary (per (batch, kv head) slice, GQA folded into rows, see `flashkit.jax`):
    BM, BN     rows (queries) and columns (keys) of a tile
    D, Dv      head dims of q/k and of v
    s          log2-domain scores, `scale * log2(e) * q . k`: `exp2(s)` is `exp(scale * q . k)`,
               and exp2 is the instruction GPUs have
    m, l, acc  running row max (log2 domain), running row sum of exp2(s - m), unnormalised output
    lse2       per-row log-sum-exp in the log2 domain, `+inf` for a row that saw no key so that
               `exp2(s - lse2) = 0` there
    delta      `rowsum(dO * O) - dlse`: the backward's correction term (D in FlashAttention-2)

These functions use only jnp/lax operations that both XLA and the Pallas Triton lowering accept,
so the XLA ports and the Pallas kernels run literally the same tile code.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from flashkit.jax._checks import AttentionConfig

LOG2E = math.log2(math.e)
NEG_INF = float("-inf")


def matmul(a, b, trans_a=False, trans_b=False):
    """`a @ b` with optional transposes, accumulated in float32 (float64 for float64 inputs).

    precision=HIGHEST keeps float32 inputs in IEEE float32 (no TF32), and is a no-op for half types.
    """
    contract = ((0 if trans_a else 1,), (1 if trans_b else 0,))
    acc = jnp.promote_types(a.dtype, jnp.float32)
    return lax.dot_general(a, b, (contract, ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=acc)


def visible(rows, cols, cfg: AttentionConfig, mask_cols: bool):
    """[BM, BN] bool, key `cols` visible from folded query `rows`; None when nothing is masked.

    rows [BM], cols [BN] int32. A key is visible iff it exists (`col < seqlen_k`, checked only
    when `mask_cols`: the keys were padded) and lies in the band (docs/design.md section 1)
    around the query's diagonal `pos + shift`.
    """
    keep = None
    if mask_cols:
        keep = cols[None, :] < cfg.seqlen_k
    if cfg.banded:
        pos = rows if cfg.group == 1 else lax.rem(rows, cfg.seqlen_q)
        diag = (pos + cfg.shift)[:, None]
        for ok in ((cols[None, :] >= diag - cfg.window_left) if cfg.window_left is not None
                   else None,
                   (cols[None, :] <= diag + cfg.window_right) if cfg.window_right is not None
                   else None):
            if ok is not None:
                keep = ok if keep is None else keep & ok
    return keep


def scores(q, k, cfg: AttentionConfig, keep):
    """[BM, BN] = [BM, D] @ [D, BN] log2-domain scores, -inf where not visible."""
    s = matmul(q, k, trans_b=True) * (cfg.scale * LOG2E)
    return s if keep is None else jnp.where(keep, s, NEG_INF)


def softmax_init(block_m: int, dv: int, dtype):
    """Empty online-softmax state: m = -inf, l = 0, acc = 0."""
    return (jnp.full((block_m,), NEG_INF, dtype), jnp.zeros((block_m,), dtype),
            jnp.zeros((block_m, dv), dtype))


def softmax_step(state, s, v):
    """Fold one tile of scores s [BM, BN] and values v [BN, Dv] into (m, l, acc).

    The shift is the new running max, or 0 while a row has seen nothing (all -inf): then
    exp2(-inf - 0) = 0 everywhere and nothing becomes NaN.
    """
    m, l, acc = state
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    shift = jnp.where(m_new == NEG_INF, 0.0, m_new).astype(m.dtype)
    alpha = jnp.exp2(m - shift)  # rescales what was accumulated under the old max
    p = jnp.exp2(s - shift[:, None])
    l = alpha * l + jnp.sum(p, axis=1)
    acc = alpha[:, None] * acc + matmul(p.astype(v.dtype), v)  # [BM, Dv] = [BM, BN] @ [BN, Dv]
    return m_new, l, acc


def softmax_finish(state):
    """(out [BM, Dv] in the accumulator dtype, lse [BM] natural log); a row that saw no key gives
    out 0 and lse -inf."""
    m, l, acc = state
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out = acc / l_safe[:, None]
    lse = jnp.where(seen, (m + jnp.log2(l_safe)) / LOG2E, NEG_INF)
    return out, lse


def backward_rows(out, dout, lse, dlse):
    """Per-row backward inputs (any leading shape): (lse2, delta), float32 or float64.

    delta = rowsum(dO * O) - dlse: a cotangent on the returned lse adds `dlse * P` to dS, which is
    the same as lowering delta by dlse.
    """
    acc = lse.dtype
    delta = jnp.sum(dout.astype(acc) * out.astype(acc), axis=-1) - dlse.astype(acc)
    lse2 = jnp.where(lse == NEG_INF, jnp.inf, lse * LOG2E)
    return lse2, delta


def grad_tile(q, k, v, dout, lse2, delta, cfg: AttentionConfig, keep):
    """Recompute one tile of P from the saved LSE; return (p, ds), both [BM, BN].

    ds = P * (dO V^T - delta) is the gradient with respect to the scaled scores; the softmax scale
    (d score / d(q . k)) is applied once to the accumulated dQ and dK instead of to every tile.
    """
    s = scores(q, k, cfg, keep)
    p = jnp.exp2(s - lse2[:, None])
    dp = matmul(dout, v, trans_b=True)  # [BM, BN] = [BM, Dv] @ [Dv, BN]
    return p, p * (dp - delta[:, None])
