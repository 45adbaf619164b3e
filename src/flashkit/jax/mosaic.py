"""FlashAttention forward as a Mosaic GPU Pallas kernel for Hopper: TMA, wgmma, warp specialisation.

One CTA per (query head, 2 * BQ query rows, batch), three warpgroups (FlashAttention-3's plan):
    consumers 0, 1   BQ rows each: S = Q K^T on the tensor cores (wgmma, into registers), the
                     online softmax in registers, O += P V (wgmma); a shared "turn" barrier makes
                     the two take turns, so one's softmax runs while the other's matmuls do
    producer 2       streams K and V blocks with TMA into a ring of STAGES shared-memory slots
Every slot has a "ready" barrier (the TMA bytes landed) and a "free" barrier (both consumers are
done with it). The kernel reads and writes the caller's (batch, seqlen, nheads, d) layout
directly (TMA boxes over strided rows): no transposes around it.

Notation as in `_tile`: scores in the log2 domain (`s * scale * log2(e)`), m/l/acc the running
max, sum and unnormalised output.

It covers the common case and says so in `supports`: bf16/fp16, d = dv in {64, 128}, whole
blocks (seqlen_q % 128 == 0, seqlen_k % 64 == 0), no window, causal only with seqlen_q <=
seqlen_k (every row sees key 0, so no row is empty); flashkit.jax runs the Triton-lowered kernel
(`pallas.py`) for everything else, and for the backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from flashkit.jax._checks import AttentionConfig
from flashkit.jax._tile import LOG2E

__all__ = ["forward", "supports", "TILES"]

# (BQ rows per consumer warpgroup, BK keys per block, STAGES in the K/V ring) per head dim.
# BQ is wgmma's M (64 per warpgroup). Shared memory: Q/O 2*BQ*d + K and V 2*STAGES*BK*d elements.
# The fastest of bench_jax.py --sweep-mosaic on the H200 (bf16, 8k, causal + not, jax 0.11.2,
# benchmarks/results/jax_2026-11-21_mosaic_sweep.json): d64 (64, 256, 2) 3.64 ms vs 3.87 for
# (64, 128, 2); d128 (64, 128, 2) 2.74 ms vs 3.30 for (64, 64, 4); (64, 128, 3) does not fit.
TILES = {64: (64, 256, 2), 128: (64, 128, 2)}
MIN_BLOCK_K = 64
_CONSUMERS = 2
_DTYPES = (jnp.bfloat16, jnp.float16)


def is_hopper() -> bool:
    """True when the default JAX device is an sm_90 GPU (what wgmma and this kernel need)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


def supports(q_shape, k_shape, v_shape, dtype, cfg: AttentionConfig) -> bool:
    """Whether this kernel covers the problem (original layout shapes, see the module doc)."""
    d = q_shape[3]
    if d not in TILES or v_shape[3] != d or not any(dtype == t for t in _DTYPES):
        return False
    bq, bk, _ = cfg_tile(cfg, d)
    if cfg.seqlen_q % (_CONSUMERS * bq) or cfg.seqlen_k % bk:
        return False
    if cfg.window_left is not None:
        return False
    return cfg.window_right is None or (cfg.window_right == 0 and cfg.shift >= 0)


def cfg_tile(cfg: AttentionConfig, d: int):
    """(BQ, BK, STAGES): the table's entry with BK halved (down to 64) until it divides seqlen_k;
    block_k overrides BK (block_q stays wgmma's 64)."""
    bq, bk, stages = TILES[d]
    if cfg.block_k:
        return bq, cfg.block_k, stages
    while bk > MIN_BLOCK_K and cfg.seqlen_k % bk:
        bk //= 2
    return bq, bk, stages


def _kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, smem, barriers, *, cfg, tile):
    """q_ref/out_ref [B, Sq, H, D], k_ref/v_ref [B, Sk, Hk, D], lse_ref [B, H, Sq] (all GMEM)."""
    bq, bk, stages = tile
    causal = cfg.window_right == 0
    qo_smem, k_smem, v_smem, lse_smem = smem  # [2, BQ, D], [STAGES, BK, D] x2, [2, BQ]
    k_ready, v_ready, q_ready, k_free, v_free, turn = barriers
    batch, head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    tiles_q = cfg.seqlen_q // (_CONSUMERS * bq)
    # Causal: the CTAs with the most key blocks start first (they set the tail).
    tile_q = tiles_q - 1 - lax.axis_index("q") if causal else lax.axis_index("q")
    blocks_k = cfg.seqlen_k // bk

    def key_blocks(rows_end):
        """Key blocks that rows < rows_end see: all, or (causal) up to the last row's diagonal."""
        if not causal:
            return blocks_k
        return lax.div(rows_end + cfg.shift + bk - 1, bk)

    cta_blocks = key_blocks((tile_q + 1) * _CONSUMERS * bq)  # the producer's trip count

    def take_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < _CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        q_smem, row0 = qo_smem.at[wg], (tile_q * _CONSUMERS + wg) * bq
        blocks = key_blocks(row0 + bq)
        # Key blocks below every row's diagonal need no mask.
        unmasked = jnp.minimum(lax.div(row0 + cfg.shift + 1, bk), blocks) if causal else blocks
        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row0, bq), head], q_smem, q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])
        c = cfg.scale * LOG2E
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        m = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout)
        l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout)
        acc = plgpu.layout_cast(jnp.zeros((bq, q_ref.shape[3]), jnp.float32), plgpu.Layout.WGMMA)
        plgpu.barrier_wait(k_ready.at[0])  # blocks >= 1 always (module doc)
        pl.when(wg == 1)(take_turn)  # consumer 0 goes first

        def step(j, state, masked):
            m, l, acc = state
            slot = lax.rem(j, stages)

            def qk(s_ref):  # [BQ, BK] = [BQ, D] @ [D, BK]
                plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                take_turn()  # the other consumer's matmuls go next
                return s_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:  # key col visible from row iff col <= row + shift
                rows, cols = (plgpu.broadcasted_iota(jnp.int32, (bq, bk), dim,
                                                     layout=plgpu.Layout.WGMMA) for dim in (0, 1))
                s = jnp.where(rows + (row0 + cfg.shift) >= cols + j * bk, s, -jnp.inf)
            # Block 0 holds a visible key for every row, so m is finite from then on: no NaN.
            m_new = jnp.maximum(m, s.max(axis=1) * c)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p = p.astype(q_ref.dtype)
            acc, l, m_new, p = lax.optimization_barrier((acc, l, m_new, p))
            plgpu.barrier_arrive(turn)  # softmax done
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(turn)  # the tensor cores are ours again

            def pv(acc_ref):  # [BQ, D] += [BQ, BK] @ [BK, D]
                plgpu.wgmma(acc_ref, p, v_smem.at[slot])

                @pl.when(j + 1 < blocks)  # wait for the next K while this matmul runs
                def _():
                    plgpu.barrier_wait(k_ready.at[lax.rem(j + 1, stages)])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))  # wgmma accumulates into acc in place
            plgpu.barrier_arrive(v_free.at[slot])
            return m_new, l, acc

        def drain(j, carry):
            """Blocks only the other consumer sees (causal): free the slots, keep taking turns."""
            slot = lax.rem(j, stages)
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            take_turn()
            take_turn()
            return carry

        state = (m, l, acc)
        state = lax.fori_loop(0, unmasked, functools.partial(step, masked=False), state)
        if causal:
            state = lax.fori_loop(unmasked, blocks, functools.partial(step, masked=True), state)
            lax.fori_loop(blocks, cta_blocks, drain, None)
        pl.when(wg == 0)(take_turn)
        m, l, acc = state

        acc = acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])
        q_smem[...] = acc.astype(q_ref.dtype)  # Q is no longer needed: its slot holds O
        lse_smem.at[wg][...] = (m + jnp.log2(l)) / LOG2E  # natural log, as flashkit returns
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, out_ref.at[batch, pl.ds(row0, bq), head])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(row0, bq)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(head, cfg.group)

        def load(j, slot):
            rows = (batch, pl.ds(j * bk, bk), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

        for j in range(stages):
            pl.when(j < cta_blocks)(functools.partial(load, j, j))

        @pl.loop(stages, jnp.maximum(cta_blocks, stages))
        def _(j):
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(k_free.at[slot])  # both consumers are done with block j - STAGES
            plgpu.barrier_wait(v_free.at[slot])
            load(j, slot)


def forward(q, k, v, cfg: AttentionConfig):
    """q [B, Sq, H, D], k/v [B, Sk, Hk, D] (the caller's layout) -> (out [B, Sq, H, D],
    lse [B, H, Sq] float32). Only for problems `supports` accepts."""
    batch, seqlen_q, heads, d = q.shape
    bq, bk, stages = cfg_tile(cfg, d)
    tile = (bq, bk, min(stages, cfg.seqlen_k // bk))
    smem_tile = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def entry(q_ref, k_ref, v_ref, out_ref, lse_ref):
        pl.run_scoped(
            lambda *scoped: _kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, scoped[:4],
                                    scoped[4:], cfg=cfg, tile=tile),
            plgpu.SMEM((_CONSUMERS, bq, d), q.dtype, transforms=smem_tile),
            plgpu.SMEM((tile[2], bk, d), q.dtype, transforms=smem_tile),
            plgpu.SMEM((tile[2], bk, d), q.dtype, transforms=smem_tile),
            plgpu.SMEM((_CONSUMERS, bq), jnp.float32),
            plgpu.Barrier(num_barriers=tile[2]),  # k_ready
            plgpu.Barrier(num_barriers=tile[2]),  # v_ready
            plgpu.Barrier(num_barriers=_CONSUMERS),  # q_ready
            plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=tile[2]),  # k_free
            plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=tile[2]),  # v_free
            plgpu.Barrier(num_arrivals=_CONSUMERS),  # turn
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct((batch, heads, seqlen_q), jnp.float32)),
        grid=(heads, seqlen_q // (_CONSUMERS * bq), batch),
        grid_names=("heads", "q", "batch"),
        num_threads=_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v)
