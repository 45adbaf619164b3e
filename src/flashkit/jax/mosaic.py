"""FlashAttention forward as a Mosaic GPU Pallas kernel for Hopper: TMA, wgmma, warp specialisation.

Work is cut into tiles of (batch, query head, 2 * BQ query rows). A CTA has three warpgroups
(FlashAttention-3's plan):
    consumers 0, 1   BQ rows each: S = Q K^T on the tensor cores (wgmma, into registers), the
                     online softmax in registers, O += P V (wgmma); a shared "turn" barrier makes
                     the two take turns, so one's softmax runs while the other's matmuls do
    producer 2       streams K and V blocks with TMA into a ring of STAGES shared-memory slots
Every slot has a "ready" barrier (the TMA bytes landed) and a "free" barrier (both consumers are
done with it). A persistent tile (`Tile.persistent`) launches one CTA per SM that walks tiles
cta, cta + CTAs, ...: the ring runs on across tiles (the producer fetches the next tile's first
K/V blocks while the consumers finish this one), the next tile's Q loads during this one's
epilogue, and the O store (its own shared buffer) drains while the next tile computes; short
sequences, where a CTA's prologue and epilogue are a large part of its life, gain most. A
non-persistent tile launches one CTA per tile. Causal tiles of a batch run heaviest (most key
blocks) first.
The kernel reads and writes the caller's (batch, seqlen, nheads, d) layout directly (TMA boxes
over strided rows): no transposes around it.

Notation as in `_tile`: scores in the log2 domain (`s * scale * log2(e)`), m/l/acc the running
max, sum and unnormalised output. Barrier phases are tracked per thread by Mosaic GPU, so every
consumer waits on every ready barrier exactly once per block, also on blocks it does not need.

It covers the common case and says so in `supports`: bf16/fp16, d = dv in {64, 128}, whole
blocks (seqlen_q % 128 == 0, seqlen_k % 64 == 0), no window, causal only with seqlen_q <=
seqlen_k (every row sees key 0, so no row is empty); flashkit.jax runs the Triton-lowered kernel
(`pallas.py`) for everything else, and for the backward.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from flashkit.jax._checks import AttentionConfig
from flashkit.jax._tile import LOG2E

__all__ = ["forward", "supports", "Tile", "TILES", "CANDIDATES"]


@dataclasses.dataclass(frozen=True)
class Tile:
    """BLOCK_K keys per block, STAGES slots in the K/V ring, one CTA per SM or per tile.
    BLOCK_Q (rows per consumer warpgroup) is wgmma's M, 64. Shared memory: Q and O 2 * 2 * BQ * d,
    K and V 2 * STAGES * BK * d elements (d128 (128, 3) does not fit)."""

    block_k: int
    stages: int = 2
    persistent: bool = True
    block_q: int = 64


# (head dim, causal) -> ((largest seqlen_k, tile), ...): the first entry whose bound is >= seqlen_k
# (None: no bound). The fastest candidate per cell of bench_jax.py --mosaic-cells on the H200 (bf16,
# 16k tokens, jax 0.11.2; benchmarks/results/jax_2026-11-21_mosaic_cells.json), as ratio to cuDNN:
# d64 full: persistent 256 1.00-1.03 (non-persistent 0.88-1.02); d64 causal: persistent 128 at
# 1k (1.07 vs 0.97 for 256), persistent 256 at 2k-8k (1.03-1.06), non-persistent 256 at 16k
# (1.05 vs 0.99: the hardware's dynamic order balances the causal triangle); d128 full: persistent
# 128 at 1k-8k (0.95-1.02 vs 0.92-0.95), non-persistent at 16k (0.96 vs 0.90); d128 causal:
# non-persistent 128 (1.03-1.13 vs 0.80-1.01 persistent).
TILES = {
    (64, False): ((None, Tile(256)),),
    (64, True): ((1024, Tile(128)), (8192, Tile(256)), (None, Tile(256, persistent=False))),
    (128, False): ((8192, Tile(128)), (None, Tile(128, persistent=False))),
    (128, True): ((None, Tile(128, persistent=False)),),
}
# The tiles bench_jax.py --mosaic-cells chooses among per cell (each of them, so every tile TILES
# can hold, is checked against the oracle by tests/jax/test_jax_mosaic.py on the GPU).
CANDIDATES = {
    64: (Tile(256), Tile(128), Tile(256, persistent=False)),
    128: (Tile(128), Tile(128, persistent=False)),
}
MIN_BLOCK_K = 64
_CONSUMERS = 2
_DTYPES = (jnp.bfloat16, jnp.float16)


def is_hopper() -> bool:
    """True when the default JAX device is an sm_90 GPU (what wgmma and this kernel need)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


def sm_count() -> int:
    """CTAs of a persistent launch: the GPU's SMs (132 on an H100/H200 SXM, also when lowering
    for CUDA on a CPU)."""
    return getattr(jax.devices()[0], "core_count", None) or 132


def supports(q_shape, k_shape, v_shape, dtype, cfg: AttentionConfig) -> bool:
    """Whether this kernel covers the problem (original layout shapes, see the module doc)."""
    d = q_shape[3]
    if d not in (64, 128) or v_shape[3] != d or not any(dtype == t for t in _DTYPES):
        return False
    tile = cfg_tile(cfg, d)
    if cfg.seqlen_q % (_CONSUMERS * tile.block_q) or cfg.seqlen_k % tile.block_k:
        return False
    if cfg.window_left is not None:
        return False
    return cfg.window_right is None or (cfg.window_right == 0 and cfg.shift >= 0)


def table_tile(d: int, causal: bool, seqlen_k: int) -> Tile:
    """TILES' entry for the cell."""
    return next(t for bound, t in TILES[d, causal] if bound is None or seqlen_k <= bound)


def cfg_tile(cfg: AttentionConfig, d: int) -> Tile:
    """The table's tile for this problem with BLOCK_K halved (down to 64) until it divides
    seqlen_k and STAGES at most the number of key blocks; block_k overrides BLOCK_K."""
    tile = table_tile(d, cfg.window_right == 0, cfg.seqlen_k)
    bk = cfg.block_k or tile.block_k
    while not cfg.block_k and bk > MIN_BLOCK_K and cfg.seqlen_k % bk:
        bk //= 2
    return dataclasses.replace(tile, block_k=bk, stages=max(1, min(tile.stages,
                                                                   cfg.seqlen_k // bk)))


def _kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, smem, barriers, *, cfg, tile, ctas):
    """q_ref/out_ref [B, Sq, H, D], k_ref/v_ref [B, Sk, Hk, D], lse_ref [B, H, Sq] (all GMEM)."""
    bq, bk, stages = tile.block_q, tile.block_k, tile.stages
    causal = cfg.window_right == 0
    q_smem, o_smem, k_smem, v_smem, lse_smem = smem  # [2, BQ, D] x2, [STAGES, BK, D] x2, [2, BQ]
    k_ready, v_ready, q_ready, k_free, v_free, turn = barriers
    batches, _, heads, _ = out_ref.shape
    wg, cta = lax.axis_index("wg"), lax.axis_index("cta")
    tiles_q = cfg.seqlen_q // (_CONSUMERS * bq)
    my_tiles = lax.div(tiles_q * heads * batches - 1 - cta, ctas) + 1  # cta, cta + ctas, ...
    blocks_k = cfg.seqlen_k // bk

    def work(i):
        """(batch, head, query tile) of this CTA's i-th tile: heads fastest, then query tiles
        (heaviest first when causal), batch outermost. CTAs that run together then share a
        batch and read each K/V block from L2 several times, not from HBM."""
        t = cta + i * ctas
        head, rest = lax.rem(t, heads), lax.div(t, heads)
        tile_q = lax.rem(rest, tiles_q)
        return lax.div(rest, tiles_q), head, (tiles_q - 1 - tile_q) if causal else tile_q

    def key_blocks(rows_end):
        """Key blocks that rows < rows_end see: all, or (causal) up to the last row's diagonal."""
        if not causal:
            return blocks_k
        return lax.div(rows_end + cfg.shift + bk - 1, bk)

    def take_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    def slot_of(it):  # ring position of the CTA's it-th key block
        return lax.rem(it, stages)

    @pl.when(wg < _CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        q_wg, o_wg, lse_wg = q_smem.at[wg], o_smem.at[wg], lse_smem.at[wg]
        c = cfg.scale * LOG2E
        row_layout = plgpu.Layout.WGMMA.reduce(1)

        def rows_of(i):  # (batch, head, first row of this warpgroup, key blocks of the CTA)
            batch, head, tile_q = work(i)
            return (batch, head, (tile_q * _CONSUMERS + wg) * bq,
                    key_blocks((tile_q + 1) * _CONSUMERS * bq))

        def load_q(i):
            batch, head, row0, _ = rows_of(i)
            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row0, bq), head], q_wg, q_ready.at[wg])

        def tile_body(i, base):
            """Tile i, whose first key block is the CTA's base-th."""
            batch, head, row0, cta_blocks = rows_of(i)
            blocks = key_blocks(row0 + bq)
            # Key blocks below every row's diagonal need no mask.
            unmasked = jnp.minimum(lax.div(row0 + cfg.shift + 1, bk), blocks) if causal else blocks
            m = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout)
            l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout)
            acc = plgpu.layout_cast(jnp.zeros((bq, q_ref.shape[3]), jnp.float32),
                                    plgpu.Layout.WGMMA)
            plgpu.barrier_wait(q_ready.at[wg])
            plgpu.barrier_wait(k_ready.at[slot_of(base)])  # blocks >= 1 always (module doc)
            pl.when(wg == 1)(take_turn)  # consumer 0 goes first

            def step(j, state, masked):
                """S, softmax, then O += P V, waited for before the next S. Issuing the next S
                before this P V (FlashAttention-3's intra-warpgroup overlap) made ptxas serialise
                every wgmma (P's register operand is written inside S's open wgmma stage);
                issuing P V and the next S together measured no faster (results NOTES, runs 7-8)."""
                m, l, acc = state
                slot = slot_of(base + j)

                def qk(s_ref):  # [BQ, BK] = [BQ, D] @ [D, BK]
                    plgpu.wgmma(s_ref, q_wg, k_smem.at[slot].transpose((1, 0)))
                    take_turn()  # the other consumer's matmuls go next
                    return s_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:  # key col visible from row iff col <= row + shift
                    rows, cols = (plgpu.broadcasted_iota(jnp.int32, (bq, bk), dim,
                                                         layout=plgpu.Layout.WGMMA)
                                  for dim in (0, 1))
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
                        plgpu.barrier_wait(k_ready.at[slot_of(base + j + 1)])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))  # wgmma accumulates in place
                plgpu.barrier_arrive(v_free.at[slot])
                return m_new, l, acc

            def drain(j, carry):
                """Blocks only the other consumer sees (causal): wait for them (barrier phases
                stay in step), free their slots, keep taking turns."""
                slot = slot_of(base + j)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                take_turn()
                take_turn()
                return carry

            state = (m, l, acc)
            state = lax.fori_loop(0, unmasked, functools.partial(step, masked=False), state)
            if causal:
                state = lax.fori_loop(unmasked, blocks, functools.partial(step, masked=True),
                                      state)
                lax.fori_loop(blocks, cta_blocks, drain, None)
            pl.when(wg == 0)(take_turn)
            pl.when(i + 1 < my_tiles)(functools.partial(load_q, i + 1))  # Q's slot is free
            m, l, acc = state

            acc = acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's O left o_wg
            o_wg[...] = acc.astype(q_ref.dtype)
            lse_wg[...] = (m + jnp.log2(l)) / LOG2E  # natural log, as flashkit returns
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_wg, out_ref.at[batch, pl.ds(row0, bq), head])
            plgpu.copy_smem_to_gmem(lse_wg, lse_ref.at[batch, head, pl.ds(row0, bq)])
            return base + cta_blocks

        load_q(0)
        lax.fori_loop(0, my_tiles, tile_body, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def tile_body(i, base):
            batch, head, tile_q = work(i)
            kv_head = lax.div(head, cfg.group)
            cta_blocks = key_blocks((tile_q + 1) * _CONSUMERS * bq)

            @pl.loop(0, cta_blocks)
            def _(j):
                slot, rows = slot_of(base + j), (batch, pl.ds(j * bk, bk), kv_head)
                for src, dst, ready, free in ((k_ref, k_smem, k_ready, k_free),
                                              (v_ref, v_smem, v_ready, v_free)):
                    # both consumers are done with the slot's last block (STAGES back)
                    pl.when(base + j >= stages)(functools.partial(plgpu.barrier_wait,
                                                                  free.at[slot]))
                    plgpu.copy_gmem_to_smem(src.at[rows], dst.at[slot], ready.at[slot])

            return base + cta_blocks

        lax.fori_loop(0, my_tiles, tile_body, jnp.int32(0))


def forward(q, k, v, cfg: AttentionConfig):
    """q [B, Sq, H, D], k/v [B, Sk, Hk, D] (the caller's layout) -> (out [B, Sq, H, D],
    lse [B, H, Sq] float32). Only for problems `supports` accepts."""
    batch, seqlen_q, heads, d = q.shape
    tile = cfg_tile(cfg, d)
    bq, bk, stages = tile.block_q, tile.block_k, tile.stages
    tiles = batch * heads * (seqlen_q // (_CONSUMERS * bq))
    ctas = min(tiles, sm_count()) if tile.persistent else tiles
    smem_tile = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def entry(q_ref, k_ref, v_ref, out_ref, lse_ref):
        pl.run_scoped(
            lambda *scoped: _kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, scoped[:5],
                                    scoped[5:], cfg=cfg, tile=tile, ctas=ctas),
            plgpu.SMEM((_CONSUMERS, bq, d), q.dtype, transforms=smem_tile),  # Q
            plgpu.SMEM((_CONSUMERS, bq, d), q.dtype, transforms=smem_tile),  # O
            plgpu.SMEM((stages, bk, d), q.dtype, transforms=smem_tile),  # K ring
            plgpu.SMEM((stages, bk, d), q.dtype, transforms=smem_tile),  # V ring
            plgpu.SMEM((_CONSUMERS, bq), jnp.float32),  # lse
            plgpu.Barrier(num_barriers=stages),  # k_ready
            plgpu.Barrier(num_barriers=stages),  # v_ready
            plgpu.Barrier(num_barriers=_CONSUMERS),  # q_ready
            plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),  # k_free
            plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),  # v_free
            plgpu.Barrier(num_arrivals=_CONSUMERS),  # turn
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct((batch, heads, seqlen_q), jnp.float32)),
        grid=(ctas,),
        grid_names=("cta",),
        num_threads=_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v)
