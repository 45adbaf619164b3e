"""FlashAttention as Pallas kernels (Triton lowering, NVIDIA GPUs), forward and backward.

Three kernels, the tile math from `_tile`:
    forward   (one program per batch, query head, block; the caller's layout) a block of BM
              query rows walks the key blocks its band can see (online softmax), writes
              out [BM, Dv] and lse [BM]
    dK/dV     a block of BN keys walks the query blocks that can see it: dV += P^T dO, dK += dS^T Q
    dQ        a block of BM query rows walks its key blocks again: dQ += dS K
              (both backward kernels: one program per batch, kv head, block; folded GQA rows)
(dQ and dK are multiplied by the softmax scale once, at the end.)
Only the blocks a causal/window band can reach are visited, and the mask is computed only on the
blocks that straddle the band's edges or hold padded keys (`_key_blocks`, `_query_blocks`): the
blocks in between run unmasked, as in FlashAttention-2.

The host side pads rows and keys to whole blocks and head dims to powers of two >= 16 (what the
Triton lowering needs), so kernels never read out of bounds; padded query rows get lse2 = +inf
(P = 0 in the backward) and are sliced off. On a CPU backend the same kernels run in Pallas's
interpreter (`interpret=True`), which is how CI tests them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

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

__all__ = ["forward", "backward", "TILES"]

# (block_q, block_k, num_warps, num_stages) per pass, keyed by the padded head dim it serves up
# to. Backward: one (block_q, block_k) for both the dK/dV and the dQ kernel.
# d64/d128: the fastest of benchmarks/bench_jax.py's --sweep on the H200 (bf16, seqlen 8k, jax
# 0.11.2; the sweep is kept in benchmarks/results/jax_*.json). d256: unmeasured, sized to fit.
TILES = {
    "fwd": {64: (128, 64, 8, 3), 128: (128, 128, 8, 3), 256: (64, 32, 8, 2)},
    "bwd": {64: (64, 64, 4, 2), 128: (64, 64, 4, 2), 256: (32, 32, 8, 1)},
}


def _pow2_at_least(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def _tiles(cfg: AttentionConfig, which: str, rows: int, d: int):
    """(block_q, block_k, compiler params): the table's entry, user overrides, clipped to size."""
    key = min(k for k in TILES[which] if k >= d)
    bq, bk, warps, stages = TILES[which][key]
    bq = min(cfg.block_q or bq, _pow2_at_least(rows))
    bk = min(cfg.block_k or bk, _pow2_at_least(cfg.seqlen_k))
    return bq, bk, plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def _pad_to(x, axis: int, size: int, value=0.0):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _div(x, block: int, size: int, ceil: bool):
    """floor or ceil of x / block for an int32 scalar x clipped to 0..size first."""
    x = jnp.clip(x, 0, size)
    return lax.div(x + (block - 1 if ceil else 0), block)


def _select(pred, if_true, if_false):
    """int32 `pred ? if_true : if_false` (jnp.where on a bool scalar lowers to a bad Triton op:
    `arith.maxsi(i32, i1)` downstream, seen with jax 0.11.2)."""
    return lax.select(pred, jnp.asarray(if_true, jnp.int32), jnp.asarray(if_false, jnp.int32))


def _plan(lo, a, b, hi):
    """(lo, a, b, hi) with lo <= a <= b <= hi: visit [lo, hi), the mask needed outside [a, b)."""
    a = jnp.clip(a, lo, jnp.maximum(lo, hi))
    return lo, a, jnp.clip(b, a, jnp.maximum(a, hi)), hi


def _key_blocks(cfg: AttentionConfig, row0, bq: int, bk: int, nk: int, mask_cols: bool):
    """Key blocks for query rows row0..row0+bq-1: (lo, a, b, hi), see `_plan`.

    Visible band of row r (position pos): pos + shift - left <= col <= pos + shift + right. A
    key block needs no mask when every row of the block sees all of it, and holds no padding.
    """
    full = nk - 1 if mask_cols else nk  # the last key block holds the padding
    if not cfg.banded:
        return 0, 0, full, nk
    size, left, right = nk * bk, cfg.window_left, cfg.window_right
    if cfg.group > 1:  # the row block may span query heads: any position, mask everywhere
        pos_lo, pos_hi = 0, cfg.seqlen_q - 1
    else:
        pos_lo, pos_hi = row0, row0 + bq - 1
    lo = _div(pos_lo + cfg.shift - left, bk, size, False) if left is not None else 0
    hi = _div(pos_hi + cfg.shift + right + 1, bk, size, True) if right is not None else nk
    if cfg.group > 1:
        return _plan(lo, lo, lo, hi)
    a = _div(pos_hi + cfg.shift - left, bk, size, True) if left is not None else 0
    b = _div(pos_lo + cfg.shift + right + 1, bk, size, False) if right is not None else nk
    return _plan(lo, a, jnp.minimum(b, full), hi)


def _query_blocks(cfg: AttentionConfig, col0, bk: int, bq: int, nq: int, padded_keys):
    """Query blocks whose rows see keys col0..col0+bk-1: (lo, a, b, hi), see `_plan`.

    padded_keys (bool scalar, or False when no key block is padded): this key block holds
    padding, so every query block is masked.
    """
    if not cfg.banded and padded_keys is False:
        return 0, 0, nq, nq
    if not cfg.banded or cfg.group > 1:
        return _plan(0, 0, 0 if cfg.banded else _select(padded_keys, 0, nq), nq)
    size, left, right = nq * bq, cfg.window_left, cfg.window_right
    col1 = col0 + bk - 1
    lo = _div(col0 - cfg.shift - right, bq, size, False) if right is not None else 0
    hi = _div(col1 - cfg.shift + left + 1, bq, size, True) if left is not None else nq
    a = _div(col1 - cfg.shift - right, bq, size, True) if right is not None else 0
    b = _div(col0 - cfg.shift + left + 1, bq, size, False) if left is not None else nq
    return _plan(lo, a, b if padded_keys is False else _select(padded_keys, a, b), hi)


def _visit(plan, step, carry):
    """carry = step(j, carry, masked) for j in [lo, hi): masked outside [a, b), not inside."""
    lo, a, b, hi = plan
    for first, last, masked in ((lo, a, True), (a, b, False), (b, hi, True)):
        if not (isinstance(first, int) and isinstance(last, int) and first >= last):
            carry = lax.fori_loop(first, last, functools.partial(step, masked=masked), carry)
    return carry


# ---------------------------------------------------------------------------------------------
# Kernels. Refs are blocks of the padded arrays with (batch, head) squeezed away.


def _forward_kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, *, cfg, bq, bk, mask_cols):
    """Rows are positions of one query head (cfg.group == 1 here), see `forward`."""
    i = pl.program_id(2)
    nk = k_ref.shape[0] // bk
    q = q_ref[...]  # [BQ, D]
    rows = i * bq + jnp.arange(bq)

    def step(j, state, masked):
        keep = visible(rows, j * bk + jnp.arange(bk), cfg, mask_cols) if masked else None
        s = scores(q, k_ref[pl.ds(j * bk, bk), :], cfg, keep)  # [BQ, BK] = [BQ, D] @ [D, BK]
        return softmax_step(state, s, v_ref[pl.ds(j * bk, bk), :])

    plan = _key_blocks(cfg, i * bq, bq, bk, nk, mask_cols)
    state = _visit(plan, step, softmax_init(bq, out_ref.shape[1], jnp.float32))
    out, lse = softmax_finish(state)
    out_ref[...] = out.astype(out_ref.dtype)
    lse_ref[...] = lse


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dk_ref, dv_ref, *,
                 cfg, bq, bk, mask_cols):
    j = pl.program_id(2)
    nq = q_ref.shape[0] // bq
    k, v = k_ref[...], v_ref[...]  # [BK, D], [BK, Dv]
    cols = j * bk + jnp.arange(bk)

    def step(i, carry, masked):
        dk, dv = carry
        rows = pl.ds(i * bq, bq)
        q, do = q_ref[rows, :], do_ref[rows, :]  # [BQ, D], [BQ, Dv]
        keep = visible(i * bq + jnp.arange(bq), cols, cfg, mask_cols) if masked else None
        p, ds = grad_tile(q, k, v, do, lse2_ref[rows], delta_ref[rows], cfg, keep)
        dv = dv + matmul(p.astype(do.dtype), do, trans_a=True)  # [BK, Dv] = [BK, BQ] @ [BQ, Dv]
        dk = dk + matmul(ds.astype(q.dtype), q, trans_a=True)  # [BK, D] = [BK, BQ] @ [BQ, D]
        return dk, dv

    padded_keys = (j == pl.num_programs(2) - 1) if mask_cols else False
    plan = _query_blocks(cfg, j * bk, bk, bq, nq, padded_keys)
    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = _visit(plan, step, zeros)
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse2_ref, delta_ref, dq_ref, *,
               cfg, bq, bk, mask_cols):
    i = pl.program_id(2)
    nk = k_ref.shape[0] // bk
    q, do = q_ref[...], do_ref[...]  # [BQ, D], [BQ, Dv]
    lse2, delta = lse2_ref[...], delta_ref[...]  # [BQ]
    rows = i * bq + jnp.arange(bq)

    def step(j, dq, masked):
        cols = pl.ds(j * bk, bk)
        k = k_ref[cols, :]  # [BK, D]
        keep = visible(rows, j * bk + jnp.arange(bk), cfg, mask_cols) if masked else None
        _, ds = grad_tile(q, k, v_ref[cols, :], do, lse2, delta, cfg, keep)
        return dq + matmul(ds.astype(k.dtype), k)  # [BQ, D] = [BQ, BK] @ [BK, D]

    plan = _key_blocks(cfg, i * bq, bq, bk, nk, mask_cols)
    dq = _visit(plan, step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


# ---------------------------------------------------------------------------------------------
# Host side: padding, grids and block specs.


def _spec(block_rows, width=None):
    """BlockSpec over (batch, kv head, rows[, width]) arrays: block (block_rows[, width]) at the
    grid's (b, h, program 2) when block_rows is an int, else the whole extent (block_rows=(n,))."""
    whole = isinstance(block_rows, tuple)
    rows = block_rows[0] if whole else block_rows
    shape = (None, None, rows) + (() if width is None else (width,))

    def index(b, h, n):
        return (b, h, 0 if whole else n) + (() if width is None else (0,))

    return pl.BlockSpec(shape, index)


def _padded(q, k, v, cfg, bq, bk, seq_axis: int):
    """Pad rows/keys (on seq_axis) to whole blocks and head dims to powers of two."""
    d, dv = _pow2_at_least(q.shape[3]), _pow2_at_least(v.shape[3])
    rows, keys = _round_up(q.shape[seq_axis], bq), _round_up(cfg.seqlen_k, bk)
    q = _pad_to(_pad_to(q, seq_axis, rows), 3, d)
    k = _pad_to(_pad_to(k, seq_axis, keys), 3, d)
    v = _pad_to(_pad_to(v, seq_axis, keys), 3, dv)
    return q, k, v


def _check_backend(cfg: AttentionConfig):
    if not cfg.interpret and jax.default_backend() != "gpu":
        raise NotImplementedError(
            f"implementation='pallas' compiles for NVIDIA GPUs (Triton lowering); on "
            f"{jax.default_backend()!r} pass interpret=True or use implementation='xla'")


def forward(q, k, v, cfg: AttentionConfig):
    """Caller's layout: q [B, Sq, H, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv]
    -> (out [B, Sq, H, Dv], lse [B, H, Sq]).

    One program per (batch, query head, query block) reads its kv head's K/V (h // group) in
    place: no transposes around the kernel, and a block's rows are one head's positions, so a
    causal GQA forward skips the masked key blocks like any other.
    """
    _check_backend(cfg)
    batch, seqlen_q, heads, _ = q.shape
    bq, bk, params = _tiles(cfg, "fwd", seqlen_q, _pow2_at_least(q.shape[3]))
    qp, kp, vp = _padded(q, k, v, cfg, bq, bk, seq_axis=1)
    rows, keys, d, dv = qp.shape[1], kp.shape[1], qp.shape[3], vp.shape[3]
    kernel = functools.partial(_forward_kernel, cfg=dataclasses.replace(cfg, group=1), bq=bq,
                               bk=bk, mask_cols=keys != cfg.seqlen_k)

    def rows_spec(width):  # [BQ, width] of query head h, block i
        return pl.BlockSpec((None, bq, None, width), lambda b, h, i: (b, i, h, 0))

    def keys_spec(width):  # all keys of query head h's kv head
        return pl.BlockSpec((None, keys, None, width),
                            lambda b, h, i: (b, 0, lax.div(h, cfg.group), 0))

    out, lse = pl.pallas_call(
        kernel,
        grid=(batch, heads, rows // bq),
        in_specs=[rows_spec(d), keys_spec(d), keys_spec(dv)],
        out_specs=[rows_spec(dv), pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct((batch, rows, heads, dv), q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, rows), jnp.float32)],
        compiler_params=params, interpret=cfg.interpret, name="flashkit_attention_fwd",
    )(qp, kp, vp)
    return out[:, :seqlen_q, :, :v.shape[3]], lse[:, :, :seqlen_q]


def backward(q, k, v, dout, lse2, delta, cfg: AttentionConfig):
    """(dq, dk, dv) in the input layout; lse2/delta [B, Hk, R] from `_tile.backward_rows`."""
    _check_backend(cfg)
    batch, heads, rows, _ = q.shape
    bq, bk, params = _tiles(cfg, "bwd", rows, _pow2_at_least(q.shape[3]))
    qp, kp, vp = _padded(q, k, v, cfg, bq, bk, seq_axis=2)
    nq, nk = qp.shape[2] // bq, kp.shape[2] // bk
    d, dv, rows_p, keys = qp.shape[3], vp.shape[3], qp.shape[2], kp.shape[2]
    dop = _pad_to(_pad_to(dout, 2, rows_p), 3, dv)
    lse2p = _pad_to(lse2.astype(jnp.float32), 2, rows_p, jnp.inf)
    deltap = _pad_to(delta.astype(jnp.float32), 2, rows_p)
    args = (qp, kp, vp, dop, lse2p, deltap)
    statics = dict(cfg=cfg, bq=bq, bk=bk, mask_cols=keys != cfg.seqlen_k)

    whole_q = [_spec((rows_p,), d), _spec((keys,), d), _spec((keys,), dv), _spec((rows_p,), dv),
               _spec((rows_p,)), _spec((rows_p,))]
    dk, dv_ = pl.pallas_call(
        functools.partial(_dkdv_kernel, **statics),
        grid=(batch, heads, nk),
        in_specs=[whole_q[0], _spec(bk, d), _spec(bk, dv), *whole_q[3:]],
        out_specs=[_spec(bk, d), _spec(bk, dv)],
        out_shape=[jax.ShapeDtypeStruct(kp.shape, k.dtype),
                   jax.ShapeDtypeStruct(vp.shape, v.dtype)],
        compiler_params=params, interpret=cfg.interpret, name="flashkit_attention_dkdv",
    )(*args)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **statics),
        grid=(batch, heads, nq),
        in_specs=[_spec(bq, d), whole_q[1], whole_q[2], _spec(bq, dv), _spec(bq), _spec(bq)],
        out_specs=_spec(bq, d),
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=params, interpret=cfg.interpret, name="flashkit_attention_dq",
    )(*args)
    sk = cfg.seqlen_k
    return (dq[:, :, :rows, :q.shape[3]], dk[:, :, :sk, :k.shape[3]],
            dv_[:, :, :sk, :v.shape[3]])
