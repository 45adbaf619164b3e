"""The ports of the TPU post: FlashAttention tiled in plain JAX, compiled by XLA.

Two implementations that differ only in how the independent blocks are visited:
    "fori"  the outer loop over blocks is a `lax.fori_loop` (sequential: XLA sees a loop)
    "xla"   the outer loop is `jax.vmap` over blocks (XLA sees that the blocks are independent
            and runs them as one batched computation); the post measured up to 45x on a TPU
The inner loop, the one that carries the online-softmax state (or the gradient sums), is a
`lax.fori_loop` in both. Sequences are padded to whole blocks; padded keys are masked and padded
queries are sliced off.

Arrays come in the folded layout of `flashkit.jax` (batch, nheads_k, rows, d), rows = group *
seqlen_q, and each (batch, kv head) slice is handled by a function vmapped over both axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flashkit.jax._checks import AttentionConfig
from flashkit.jax._tile import (
    grad_tile,
    matmul,
    scores,
    softmax_finish,
    softmax_init,
    softmax_step,
    visible,
)

DEFAULT_BLOCK = 128

__all__ = ["forward", "backward"]


def _blocks(x, block: int, pad_value=0.0):
    """(n, ...) -> (ceil(n / block), block, ...), padded with pad_value."""
    n = x.shape[0]
    nblocks = -(-n // block)
    pad = [(0, nblocks * block - n)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad, constant_values=pad_value).reshape(nblocks, block, *x.shape[1:])


def _map_blocks(body, xs, parallel: bool):
    """Stack body(*x[i] for x in xs) over the leading (block) axis of xs.

    parallel: `jax.vmap` (blocks are independent and XLA is told so); else a `lax.fori_loop` that
    writes block i of a preallocated result with dynamic_update_index_in_dim.
    """
    if parallel:
        return jax.vmap(body)(*xs)
    n = xs[0].shape[0]
    shapes = jax.eval_shape(body, *(x[0] for x in xs))
    init = jax.tree.map(lambda s: jnp.zeros((n, *s.shape), s.dtype), shapes)

    def step(i, stacked):
        res = body(*(lax.dynamic_index_in_dim(x, i, keepdims=False) for x in xs))
        return jax.tree.map(lambda a, r: lax.dynamic_update_index_in_dim(a, r, i, 0),
                            stacked, res)

    return lax.fori_loop(0, n, step, init)


def _block_sizes(cfg: AttentionConfig, rows: int):
    return min(cfg.block_q or DEFAULT_BLOCK, rows), min(cfg.block_k or DEFAULT_BLOCK, cfg.seqlen_k)


def _forward_slice(q, k, v, cfg: AttentionConfig):
    """One (batch, kv head): q [R, D], k [Sk, D], v [Sk, Dv] -> out [R, Dv], lse [R]."""
    rows_total, dv = q.shape[0], v.shape[1]
    bm, bn = _block_sizes(cfg, rows_total)
    qb, kb, vb = _blocks(q, bm), _blocks(k, bn), _blocks(v, bn)  # [n, B, D]
    mask_cols = kb.shape[0] * bn != cfg.seqlen_k
    acc_dtype = jnp.promote_types(q.dtype, jnp.float32)

    def one_q_block(i, q_tile):
        rows = i * bm + jnp.arange(bm)

        def step(j, state):
            cols = j * bn + jnp.arange(bn)
            s = scores(q_tile, kb[j], cfg, visible(rows, cols, cfg, mask_cols))
            return softmax_step(state, s, vb[j])

        state = lax.fori_loop(0, kb.shape[0], step, softmax_init(bm, dv, acc_dtype))
        out, lse = softmax_finish(state)
        return out.astype(q.dtype), lse

    out, lse = _map_blocks(one_q_block, (jnp.arange(qb.shape[0]), qb),
                           cfg.implementation == "xla")
    return out.reshape(-1, dv)[:rows_total], lse.reshape(-1)[:rows_total]


def _backward_slice(q, k, v, dout, lse2, delta, cfg: AttentionConfig):
    """One (batch, kv head): the FlashAttention-2 backward in two passes, P recomputed from lse2.

    Pass 1 (per key block, over all query blocks): dV += P^T dO, dK += dS^T Q.
    Pass 2 (per query block, over all key blocks): dQ += dS K.
    dK and dQ take the softmax scale once, at the end (see `grad_tile`).
    Padded query rows get lse2 = +inf, so their P (and dS) is 0.
    """
    rows_total = q.shape[0]
    bm, bn = _block_sizes(cfg, rows_total)
    qb, dob = _blocks(q, bm), _blocks(dout, bm)
    lse2b, deltab = _blocks(lse2, bm, jnp.inf), _blocks(delta, bm)
    kb, vb = _blocks(k, bn), _blocks(v, bn)
    mask_cols = kb.shape[0] * bn != cfg.seqlen_k
    acc_dtype = jnp.promote_types(q.dtype, jnp.float32)
    parallel = cfg.implementation == "xla"

    def one_k_block(j, k_tile, v_tile):
        cols = j * bn + jnp.arange(bn)

        def step(i, carry):
            dk, dv = carry
            rows = i * bm + jnp.arange(bm)
            p, ds = grad_tile(qb[i], k_tile, v_tile, dob[i], lse2b[i], deltab[i], cfg,
                              visible(rows, cols, cfg, mask_cols))
            # [BN, Dv] = [BN, BM] @ [BM, Dv] and [BN, D] = [BN, BM] @ [BM, D]
            dv = dv + matmul(p.astype(dout.dtype), dob[i], trans_a=True)
            dk = dk + matmul(ds.astype(q.dtype), qb[i], trans_a=True)
            return dk, dv

        zeros = (jnp.zeros(k_tile.shape, acc_dtype), jnp.zeros(v_tile.shape, acc_dtype))
        dk, dv = lax.fori_loop(0, qb.shape[0], step, zeros)
        return (dk * cfg.scale).astype(k.dtype), dv.astype(v.dtype)

    def one_q_block(i, q_tile, do_tile, lse2_tile, delta_tile):
        rows = i * bm + jnp.arange(bm)

        def step(j, dq):
            cols = j * bn + jnp.arange(bn)
            _, ds = grad_tile(q_tile, kb[j], vb[j], do_tile, lse2_tile, delta_tile, cfg,
                              visible(rows, cols, cfg, mask_cols))
            return dq + matmul(ds.astype(k.dtype), kb[j])  # [BM, D] = [BM, BN] @ [BN, D]

        dq = lax.fori_loop(0, kb.shape[0], step, jnp.zeros(q_tile.shape, acc_dtype))
        return (dq * cfg.scale).astype(q.dtype)

    dk, dv = _map_blocks(one_k_block, (jnp.arange(kb.shape[0]), kb, vb), parallel)
    dq = _map_blocks(one_q_block, (jnp.arange(qb.shape[0]), qb, dob, lse2b, deltab), parallel)
    sk = cfg.seqlen_k
    return (dq.reshape(-1, q.shape[1])[:rows_total], dk.reshape(-1, k.shape[1])[:sk],
            dv.reshape(-1, v.shape[1])[:sk])


def _per_slice(fn):
    """vmap a per-(batch, kv head) function over the two leading axes."""
    return jax.vmap(jax.vmap(fn))


def forward(q, k, v, cfg: AttentionConfig):
    """q [B, Hk, R, D], k [B, Hk, Sk, D], v [B, Hk, Sk, Dv]
    -> (out [B, Hk, R, Dv], lse [B, Hk, R]).
    """
    return _per_slice(lambda q, k, v: _forward_slice(q, k, v, cfg))(q, k, v)


def backward(q, k, v, dout, lse2, delta, cfg: AttentionConfig):
    """Gradients (dq, dk, dv) in the layout of the inputs; lse2/delta from `backward_rows`."""
    return _per_slice(lambda *a: _backward_slice(*a, cfg))(q, k, v, dout, lse2, delta)
