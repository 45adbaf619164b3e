"""FlashAttention backward as Mosaic GPU Pallas kernels for Hopper: TMA, wgmma, warp specialisation.

Two kernels (FlashAttention-2's split, deterministic: no atomics), each a CTA of three warpgroups,
two consumers of 64 rows each (wgmma's M) and a producer that streams tiles with TMA into a ring
of STAGES shared-memory slots (a "ready" barrier per tensor and slot, a "free" barrier per slot
that both consumers arrive on):
    dK/dV   a CTA holds 2 x 64 keys of one kv head (K, V resident in shared memory) and streams
            Q, dO, lse2 and delta of the BQ-row blocks that see them, over every query head of
            the GQA group (dK/dV sum over the group in registers):
                S^T  = K Q^T                [64, BQ] = [64, D] @ [D, BQ]
                P^T  = exp2(S^T c - lse2)   recomputed from the forward's lse
                dV  += P^T dO               [64, D]  = [64, BQ] @ [BQ, D]
                dP^T = V dO^T               [64, BQ] = [64, D] @ [D, BQ]
                dS^T = P^T (dP^T - delta)
                dK  += dS^T Q               [64, D]  = [64, BQ] @ [BQ, D]
    dQ      a CTA holds 2 x 64 query rows of one head (Q, dO, lse2, delta resident) and streams
            the K/V blocks of BK keys they see:
                S = Q K^T, dP = dO V^T      [64, BK] each
                dQ += dS K                  [64, D]  = [64, BK] @ [BK, D]
Notation as in `_tile`: c = scale * log2(e), lse2 = lse * log2(e) (+inf for a row that saw
nothing), delta = rowsum(dO * O) - dlse. dK and dQ get the softmax scale once, at the end.
Causal and windows (`mosaic.Band`): only the blocks a CTA's band reaches are streamed, and only
those at the band's edges are masked; a CTA's blocks are visited by both consumers (the ring is
shared), so a consumer masks a whole block away where only the other one sees it.

The kernels read q/dO/dQ [B, Sq, H, D], k/v/dK/dV [B, Sk, Hk, D] and lse2/delta [B, H, Sq] in
place (TMA boxes over strided rows): no transposes around them. Any lengths: TMA zero-fills rows
past the end and drops stored rows past it; lse2/delta are padded to whole CTAs with +inf/0, so
padded query rows have P = 0; padded keys only reach their own (dropped) dK/dV rows, and the dQ
kernel masks them in the last key block (K is zero there, but exp2 of an unseen score may
overflow). Lengths that are not multiples of 8 are zero-padded first (`mosaic.pad_rows`).
`supports`: bf16/fp16, d = dv = 128 at any shape, d = dv = 64 on whole 128-blocks without a
window; flashkit.jax runs the Triton-lowered backward for the rest.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from flashkit.jax import mosaic
from flashkit.jax._checks import AttentionConfig
from flashkit.jax._tile import LOG2E, backward_rows
from flashkit.jax.mosaic import Band, aligned, cdiv, clip, pad_rows

__all__ = ["backward", "declines", "supports", "Tile", "TILES", "CANDIDATES"]

_WG_ROWS = 64  # rows (dQ: queries, dK/dV: keys) per consumer warpgroup: wgmma's M
_CONSUMERS = 2
_CTA_ROWS = _CONSUMERS * _WG_ROWS
_DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class Tile:
    """block_q: query rows per streamed block of the dK/dV kernel; block_k: keys per streamed
    block of the dQ kernel; stages: ring slots of both. Both blocks divide 128."""

    block_q: int = 64
    block_k: int = 64
    stages: int = 2


# (head dim, causal) -> tile: the fastest candidate over seqlen 1k/4k/16k of bench_jax.py
# --mosaic-bwd on the H200 (bf16, 16k tokens, jax 0.11.2; benchmarks/results/
# jax_2026-11-21_mosaic_bwd.json). d64: (128, 128, 2) fastest in 5 of 6 cells (1k causal: 4%
# behind); d128 full: (64, 64, 2) (<= 3.5% behind where not first); d128 causal: (64, 128, 2)
# (<= 4.5% behind). Run-to-run noise is about 3%. float16 at 16k (jax_2026-11-21_mosaic_bwd_fp16
# .json) agrees within that noise; d64 (128, 128, 3) there: +1.5% full, -7% causal.
TILES = {(64, False): Tile(128, 128, 2), (64, True): Tile(128, 128, 2),
         (128, False): Tile(64, 64, 2), (128, True): Tile(64, 128, 2)}
# What bench_jax.py --mosaic-bwd times per cell (and the GPU tests check against the oracle).
# d128 with BQ = 128 would hold dK, dV [64, 128] and S^T, dP^T [64, 128] in float32: 256
# registers per thread before any temporary, more than a consumer has.
CANDIDATES = {64: (Tile(128, 128, 2), Tile(64, 128, 3), Tile(64, 64, 3), Tile(128, 128, 3)),
              128: (Tile(64, 64, 2), Tile(64, 128, 2), Tile(64, 64, 3))}


def declines(q_shape, k_shape, v_shape, dtype, cfg: AttentionConfig) -> str | None:
    """Why these kernels do not run the call's backward (flashkit.jax.dispatch runs the
    Triton-lowered one), or None."""
    if cfg.interpret:
        return "the Pallas interpreter (interpret=True) runs no Mosaic GPU kernel"
    if not mosaic.is_hopper():
        return f"not a Hopper GPU (the default device is {jax.devices()[0].device_kind})"
    return uncovered(q_shape, k_shape, v_shape, dtype, cfg)


def uncovered(q_shape, k_shape, v_shape, dtype, cfg: AttentionConfig) -> str | None:
    """What of the problem these kernels do not cover (caller's layout shapes, see the module
    doc), or None."""
    d = q_shape[3]
    if not any(dtype == t for t in _DTYPES):
        return f"dtype {jnp.dtype(dtype).name} (takes bfloat16, float16)"
    if d not in CANDIDATES or v_shape[3] != d:
        return f"head dims {d}/{v_shape[3]} (takes {sorted(CANDIDATES)}, q/k/v alike)"
    if d == 64 and not aligned(cfg, _CTA_ROWS, _CTA_ROWS):  # d64: see mosaic.aligned
        return "head dim 64 off whole 128-blocks or with a window"
    return None


def supports(q_shape, k_shape, v_shape, dtype, cfg: AttentionConfig) -> bool:
    """Whether these kernels cover the problem, on a Hopper GPU (uncovered)."""
    return uncovered(q_shape, k_shape, v_shape, dtype, cfg) is None


def _smem_tile():
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _wait(barrier):
    plgpu.barrier_wait(barrier)


def _whole_within(band, x0, size, span):
    """The blocks of `size` every index in [x0, x0 + 64) sees whole, clipped into the CTA's
    blocks span = (lo, hi): the masked ones are [lo, whole_lo) and [whole_hi, hi)."""
    whole_lo, whole_hi = band.full_blocks(x0, x0 + _WG_ROWS, size)
    whole_lo = clip(whole_lo, *span)
    return whole_lo, clip(whole_hi, whole_lo, span[1])


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, smem,
                 barriers, *, cfg, tile):
    """q/do [B, Sq, H, D], k/v/dk/dv [B, Sk, Hk, D], lse/delta [B, H, Sq] (GMEM)."""
    bq, stages = tile.block_q, tile.stages
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem = smem
    k_ready, v_ready, q_ready, do_ready, lse_ready, delta_ready, free = barriers
    kb, kv_head, batch = (lax.axis_index(n) for n in ("blk", "heads", "batch"))
    wg = lax.axis_index("wg")
    # Query blocks (of lse_ref's padded rows: padded rows have P = 0, no mask needed).
    band = Band.rows_of_keys(cfg, lse_ref.shape[2])
    left_edge, right_edge = band.edges(bq)
    k0 = kb * _CTA_ROWS
    lo, hi = band.blocks(k0, k0 + _CTA_ROWS, bq)  # the query blocks that see the CTA's keys
    per_head = hi - lo
    steps = cfg.group * per_head

    def where(t):  # (query head, first row) of the CTA's t-th block: heads outer, rows inner
        return kv_head * cfg.group + lax.div(t, per_head), (lo + lax.rem(t, per_head)) * bq

    @pl.when(wg < _CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        k_wg, v_wg = k_smem.at[wg], v_smem.at[wg]
        key0 = k0 + wg * _WG_ROWS
        rows = (batch, pl.ds(key0, _WG_ROWS), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_wg, k_ready.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_wg, v_ready.at[wg])
        c = cfg.scale * LOG2E
        col_layout = plgpu.Layout.WGMMA.reduce(0)
        zeros = plgpu.layout_cast(jnp.zeros((_WG_ROWS, k_ref.shape[3]), jnp.float32),
                                  plgpu.Layout.WGMMA)
        _wait(k_ready.at[wg])
        _wait(v_ready.at[wg])

        def step(i, carry, t0, masked):
            dk, dv = carry
            t = t0 + i
            slot = lax.rem(t, stages)
            q_s, do_s = q_smem.at[slot], do_smem.at[slot]
            _wait(q_ready.at[slot])

            def qk(acc):  # S^T [64, BQ] = K [64, D] @ Q^T [D, BQ]
                plgpu.wgmma(acc, k_wg, q_s.transpose((1, 0)))
                return acc[...]

            s = pl.run_scoped(qk, plgpu.ACC((_WG_ROWS, bq), jnp.float32))
            _wait(lse_ready.at[slot])
            lse2 = plgpu.load(lse_smem.at[slot], (), layout=col_layout)
            p = jnp.exp2(s * c - lax.broadcast_in_dim(lse2, s.shape, [1]))
            if masked:
                _, row0 = where(t)
                p = jnp.where(band.visible(key0, row0, s.shape, 0, bq), p, 0.0)
            _wait(do_ready.at[slot])

            def dv_dp(accs):  # dV += P^T dO; dP^T [64, BQ] = V [64, D] @ dO^T [D, BQ]
                dv_acc, dp_acc = accs
                plgpu.wgmma(dv_acc, p.astype(q_ref.dtype), do_s)
                plgpu.wgmma(dp_acc, v_wg, do_s.transpose((1, 0)))

            dv, dp = pl.run_state(dv_dp)((plgpu.ACC.init(dv), plgpu.ACC.init(
                plgpu.layout_cast(jnp.zeros(s.shape, jnp.float32), plgpu.Layout.WGMMA))))
            _wait(delta_ready.at[slot])
            delta = plgpu.load(delta_smem.at[slot], (), layout=col_layout)
            ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [1]))

            def dk_step(acc):  # dK += dS^T [64, BQ] @ Q [BQ, D]
                plgpu.wgmma(acc, ds.astype(q_ref.dtype), q_s)

            dk = pl.run_state(dk_step)(plgpu.ACC.init(dk))
            plgpu.barrier_arrive(free.at[slot])
            return dk, dv

        whole_lo, whole_hi = _whole_within(band, key0, bq, (lo, hi))

        def head(g, carry):
            """Query head g of the group: the blocks at the band's edges masked, whole ones
            not."""
            t0 = g * per_head - lo  # step number of block i is t0 + i
            if left_edge:
                carry = lax.fori_loop(lo, whole_lo, functools.partial(step, t0=t0, masked=True),
                                      carry)
            carry = lax.fori_loop(whole_lo, whole_hi,
                                  functools.partial(step, t0=t0, masked=False), carry)
            if right_edge:
                carry = lax.fori_loop(whole_hi, hi, functools.partial(step, t0=t0, masked=True),
                                      carry)
            return carry

        dk, dv = lax.fori_loop(0, cfg.group, head, (zeros, zeros))
        k_wg[...] = (dk * cfg.scale).astype(dk_ref.dtype)  # K/V's buffers are free now
        v_wg[...] = dv.astype(dv_ref.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_wg, dk_ref.at[rows])
        plgpu.copy_smem_to_gmem(v_wg, dv_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        @pl.loop(0, steps)
        def _(t):
            slot = lax.rem(t, stages)
            head, row0 = where(t)
            rows = (batch, pl.ds(row0, bq), head)
            pl.when(t >= stages)(functools.partial(_wait, free.at[slot]))
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_ready.at[slot])
            plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, pl.ds(row0, bq)],
                                    lse_smem.at[slot], lse_ready.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_ready.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, pl.ds(row0, bq)],
                                    delta_smem.at[slot], delta_ready.at[slot])


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, smem, barriers, *,
               cfg, tile):
    """q/do/dq [B, Sq, H, D], k/v [B, Sk, Hk, D], lse/delta [B, H, Sq] (GMEM)."""
    bk, stages = tile.block_k, tile.stages
    q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem = smem
    *rows_ready, k_ready, v_ready, free = barriers  # rows_ready: Q, dO, lse2, delta
    qb, head, batch = (lax.axis_index(n) for n in ("blk", "heads", "batch"))
    wg = lax.axis_index("wg")
    if cfg.window_right is not None and cfg.window_left is None:  # heaviest blocks first
        qb = cdiv(cfg.seqlen_q, _CTA_ROWS) - 1 - qb
    kv_head = lax.div(head, cfg.group)
    band = Band.keys_of_rows(cfg)
    left_edge, right_edge = band.edges(bk)
    lo, hi = band.blocks(qb * _CTA_ROWS, (qb + 1) * _CTA_ROWS, bk)  # the CTA's key blocks

    @pl.when(wg < _CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        row0 = qb * _CTA_ROWS + wg * _WG_ROWS
        rows = (batch, pl.ds(row0, _WG_ROWS), head)
        stats = (batch, head, pl.ds(row0, _WG_ROWS))
        q_wg, do_wg = q_smem.at[wg], do_smem.at[wg]
        # One barrier per copy: a copy arrives on its barrier as it starts.
        for src, dst, ready in zip((q_ref.at[rows], do_ref.at[rows], lse_ref.at[stats],
                                    delta_ref.at[stats]),
                                   (q_wg, do_wg, lse_smem.at[wg], delta_smem.at[wg]),
                                   rows_ready, strict=True):
            plgpu.copy_gmem_to_smem(src, dst, ready.at[wg])
        c = cfg.scale * LOG2E
        for ready in rows_ready:
            _wait(ready.at[wg])
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        lse2 = plgpu.load(lse_smem.at[wg], (), layout=row_layout)
        delta = plgpu.load(delta_smem.at[wg], (), layout=row_layout)

        def step(kb, dq, masked):
            slot = lax.rem(kb - lo, stages)
            k_s, v_s = k_smem.at[slot], v_smem.at[slot]
            _wait(k_ready.at[slot])
            _wait(v_ready.at[slot])
            shape = (_WG_ROWS, bk)

            def s_dp(accs):  # S = Q K^T, dP = dO V^T: [64, BK] = [64, D] @ [D, BK] each
                s_acc, dp_acc = accs
                plgpu.wgmma(s_acc, q_wg, k_s.transpose((1, 0)))
                plgpu.wgmma(dp_acc, do_wg, v_s.transpose((1, 0)))

            zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
            s, dp = pl.run_state(s_dp)((plgpu.ACC.init(zeros), plgpu.ACC.init(zeros)))
            p = jnp.exp2(s * c - lax.broadcast_in_dim(lse2, shape, [0]))
            if masked:  # (also keys past seqlen_k: K is 0 there, but P may overflow)
                p = jnp.where(band.visible(row0, kb * bk, shape, 0, bk), p, 0.0)
            ds = p * (dp - lax.broadcast_in_dim(delta, shape, [0]))

            def dq_step(acc):  # dQ += dS [64, BK] @ K [BK, D]
                plgpu.wgmma(acc, ds.astype(q_ref.dtype), k_s)

            dq = pl.run_state(dq_step)(plgpu.ACC.init(dq))
            plgpu.barrier_arrive(free.at[slot])
            return dq

        dq = plgpu.layout_cast(jnp.zeros((_WG_ROWS, q_ref.shape[3]), jnp.float32),
                               plgpu.Layout.WGMMA)
        whole_lo, whole_hi = _whole_within(band, row0, bk, (lo, hi))
        if left_edge:
            dq = lax.fori_loop(lo, whole_lo, functools.partial(step, masked=True), dq)
        dq = lax.fori_loop(whole_lo, whole_hi, functools.partial(step, masked=False), dq)
        if right_edge:
            dq = lax.fori_loop(whole_hi, hi, functools.partial(step, masked=True), dq)
        q_wg[...] = (dq * cfg.scale).astype(dq_ref.dtype)  # Q's buffer is free now
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_wg, dq_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        @pl.loop(0, hi - lo)
        def _(j):
            slot = lax.rem(j, stages)
            keys = (batch, pl.ds((lo + j) * bk, bk), kv_head)
            pl.when(j >= stages)(functools.partial(_wait, free.at[slot]))
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_ready.at[slot])


def _launch(kernel, args, out_type, grid, scratch, cfg, tile):
    """plgpu.kernel over grid (blk, heads, batch) with three warpgroups; scratch = (shared
    buffers, barriers) allocated per CTA."""
    buffers, barrier_specs = scratch

    def entry(*refs):
        pl.run_scoped(
            lambda *scoped: kernel(*refs, scoped[:len(buffers)], scoped[len(buffers):],
                                   cfg=cfg, tile=tile),
            *buffers, *barrier_specs, collective_axes="wg")

    return plgpu.kernel(
        entry, out_type=out_type, grid=grid, grid_names=("blk", "heads", "batch"),
        num_threads=_CONSUMERS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*args)


def backward(q, k, v, out, dout, lse, dlse, cfg: AttentionConfig):
    """Caller's layout: q/out/dout [B, Sq, H, D], k/v [B, Sk, Hk, D], lse/dlse [B, H, Sq]
    -> (dq, dk, dv) like q, k, v. Only for problems `supports` accepts."""
    batch, seqlen_q, heads, d = q.shape
    heads_k = k.shape[2]
    # cfg's block_q/block_k are the forward's; banded problems take the causal tile
    tile = TILES[d, cfg.window_right is not None]
    # [B, H, Sq] float32; XLA fuses the transpose into the reduction.
    lse2, delta = backward_rows(out.transpose(0, 2, 1, 3), dout.transpose(0, 2, 1, 3), lse,
                                dlse)
    pad = -seqlen_q % _CTA_ROWS  # whole CTAs of rows: padded rows get P = 0 (lse2 = +inf)
    if pad:
        lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, pad)), constant_values=jnp.inf)
        delta = jnp.pad(delta, ((0, 0), (0, 0), (0, pad)))
    args = (pad_rows(q), pad_rows(k), pad_rows(v), pad_rows(dout), lse2, delta)
    dtype, smem_tile = q.dtype, _smem_tile()
    rows, stages = (_CONSUMERS, _WG_ROWS, d), tile.stages

    dk, dv = _launch(
        _dkdv_kernel, args,
        (jax.ShapeDtypeStruct(args[1].shape, k.dtype),
         jax.ShapeDtypeStruct(args[2].shape, v.dtype)),
        (cdiv(cfg.seqlen_k, _CTA_ROWS), heads_k, batch),
        ((plgpu.SMEM(rows, dtype, transforms=smem_tile),  # K
          plgpu.SMEM(rows, dtype, transforms=smem_tile),  # V
          plgpu.SMEM((stages, tile.block_q, d), dtype, transforms=smem_tile),  # Q ring
          plgpu.SMEM((stages, tile.block_q, d), dtype, transforms=smem_tile),  # dO ring
          plgpu.SMEM((stages, tile.block_q), jnp.float32),  # lse2 ring
          plgpu.SMEM((stages, tile.block_q), jnp.float32)),  # delta ring
         (*(plgpu.Barrier(num_barriers=_CONSUMERS),) * 2,  # K, V landed, per consumer
          *(plgpu.Barrier(num_barriers=stages),) * 4,  # Q, dO, lse2, delta ready
          plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages))),  # slot free
        cfg, tile)
    dq = _launch(
        _dq_kernel, args, jax.ShapeDtypeStruct(args[0].shape, q.dtype),
        (cdiv(seqlen_q, _CTA_ROWS), heads, batch),
        ((plgpu.SMEM(rows, dtype, transforms=smem_tile),  # Q
          plgpu.SMEM(rows, dtype, transforms=smem_tile),  # dO
          plgpu.SMEM((_CONSUMERS, _WG_ROWS), jnp.float32),  # lse2
          plgpu.SMEM((_CONSUMERS, _WG_ROWS), jnp.float32),  # delta
          plgpu.SMEM((stages, tile.block_k, d), dtype, transforms=smem_tile),  # K ring
          plgpu.SMEM((stages, tile.block_k, d), dtype, transforms=smem_tile)),  # V ring
         (*(plgpu.Barrier(num_barriers=_CONSUMERS),) * 4,  # Q, dO, lse2, delta landed
          *(plgpu.Barrier(num_barriers=stages),) * 2,  # K, V ready
          plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages))),  # slot free
        cfg, tile)
    seqlen_k = cfg.seqlen_k
    return dq[:, :seqlen_q], dk[:, :seqlen_k], dv[:, :seqlen_k]
