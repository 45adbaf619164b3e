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

Any lengths: TMA zero-fills the rows of a box past the end of q/k/v and drops the rows of a
store past the end of out, so a partial last query tile needs no code; keys past seqlen_k are
masked, in the last key block only. Causal and sliding windows (bottom-right aligned,
docs/design.md section 1) through `Band`: a tile streams only the key blocks its rows see, and
only the blocks at the band's edges are masked (the split into masked and unmasked blocks is
static where the problem allows, so aligned full attention runs no mask code). Rows that see no
key give out 0 and lse -inf. `supports` says what it covers: bf16/fp16 and d = dv = 128 at any
shape, d = dv = 64 only on whole blocks without a window (see `aligned`); flashkit.jax runs the
Triton-lowered kernel (`pallas.py`) for everything else.
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

__all__ = ["forward", "declines", "supports", "Band", "Tile", "TILES", "CANDIDATES"]


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
# non-persistent 128 (1.03-1.13 vs 0.80-1.01 persistent). d64 causal is now persistent 128
# throughout: with the Band masks, 256-key blocks lost 1.5x (4096: 0.99 ms vs 0.68 for 128, vs
# 0.66 for 256 before; H200 run 07:20; 16k unmeasured).
TILES = {
    (64, False): ((None, Tile(256)),),
    (64, True): ((None, Tile(128)),),
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
# A finite running-max floor for rows that may see no key in a masked block: exp2(s - m) and
# exp2(m_old - m_new) stay 0 or finite where -inf - -inf would give NaN.
_M_FLOOR = float(jnp.finfo(jnp.float32).min)


def pad_rows(x, multiple=8):
    """x [B, S, H, D] zero-padded along S to a multiple of 8. Mosaic's TMA views the GMEM rows in
    the shared-memory tiling's 8-row tiles and refuses a partial one (jax 0.10/0.11), so a
    length that is not a multiple of 8 costs a copy in and out; others are masked in-kernel."""
    extra = -x.shape[1] % multiple
    return jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, 0))) if extra else x


def cdiv(a, b):
    """ceil(a / b) for a >= 0 (a Python int or an int32 scalar in a kernel)."""
    return (a + b - 1) // b if isinstance(a, int) else lax.div(a + b - 1, b)


def _div(a, b):  # floor(a / b) for a >= 0; lax.div on a traced scalar (jnp's // adds sign fixes)
    return a // b if isinstance(a, int) else lax.div(a, b)


def clip(x, lo, hi):
    """min(max(x, lo), hi) for lo <= hi: a Python int wherever the result is static (an aligned
    problem's loop bounds stay constants)."""
    if isinstance(x, int) and isinstance(lo, int) and x <= lo:
        return lo
    if isinstance(x, int) and isinstance(hi, int) and x >= hi:
        return hi
    if all(isinstance(v, int) for v in (x, lo, hi)):
        return min(max(x, lo), hi)
    return jnp.clip(x, lo, hi)


@dataclasses.dataclass(frozen=True)
class Band:
    """Which indices y (of an axis of length n) an index x of the other axis sees: those with
    lo <= y - x <= hi (None: unbounded) and y < n. The forward and dQ see keys from query rows
    (`keys_of_rows`), dK/dV query rows from keys (`rows_of_keys`). Spans and block ranges are
    Python ints where nothing traced enters them, so a kernel can leave out static no-ops."""

    lo: int | None
    hi: int | None
    n: int

    @classmethod
    def keys_of_rows(cls, cfg: AttentionConfig) -> Band:
        """Key j visible from query row i iff i + shift - left <= j <= i + shift + right."""
        left, right = cfg.window_left, cfg.window_right
        return cls(None if left is None else cfg.shift - left,
                   None if right is None else cfg.shift + right, cfg.seqlen_k)

    @classmethod
    def rows_of_keys(cls, cfg: AttentionConfig, n: int) -> Band:
        """The transpose: row i visible from key j iff j - shift - right <= i <= j - shift +
        left; n (the padded query length) bounds the rows."""
        left, right = cfg.window_left, cfg.window_right
        return cls(None if right is None else -cfg.shift - right,
                   None if left is None else left - cfg.shift, n)

    def blocks(self, x0, x1, size):
        """Blocks of `size` along y that any index in [x0, x1) sees: [lo, hi), hi >= lo."""
        lo = 0 if self.lo is None else clip(x0 + self.lo, 0, self.n)
        hi = self.n if self.hi is None else clip(x1 - 1 + self.hi + 1, 0, self.n)
        lo = _div(lo, size)
        return lo, (max if isinstance(lo, int) and isinstance(hi, int) else jnp.maximum)(
            cdiv(hi, size), lo)

    def full_blocks(self, x0, x1, size):
        """Blocks of `size` along y that every index in [x0, x1) sees whole: [lo, hi) (empty
        where hi <= lo); the last block of a partial n is never whole."""
        lo = 0 if self.lo is None else clip(x1 - 1 + self.lo, 0, self.n)
        hi = self.n if self.hi is None else clip(x0 + self.hi + 1, 0, self.n)
        return cdiv(lo, size), _div(hi, size)

    def edges(self, size):
        """Static: (masked blocks before the whole ones, masked blocks after them) can exist."""
        return self.lo is not None, self.hi is not None or self.n % size != 0

    def visible(self, x0, y0, shape, x_dim, size):
        """[shape] bool in the WGMMA layout: y0 + c visible from x0 + r, r along x_dim and c
        along the other dim (a block of `size` along y)."""
        iota = [plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)
                for dim in (0, 1)]
        xs, ys = iota[x_dim], iota[1 - x_dim]
        diff = ys - xs + (y0 - x0)  # y - x
        ok = []
        if self.lo is not None:
            ok.append(diff >= self.lo)
        if self.hi is not None:
            ok.append(diff <= self.hi)
        if self.n % size:
            ok.append(ys < self.n - y0)
        return functools.reduce(jnp.logical_and, ok)

    def may_see_nothing(self) -> bool:
        """Whether an index may see nothing in a masked block processed before its first
        visible y (then the forward's running max needs its finite floor)."""
        return self.lo is not None or (self.hi is not None and self.hi < 0)


def is_hopper() -> bool:
    """True when the default JAX device is an sm_90 GPU (what wgmma and this kernel need)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


def sm_count() -> int:
    """CTAs of a persistent launch: the GPU's SMs (132 on an H100/H200 SXM, also when lowering
    for CUDA on a CPU)."""
    return getattr(jax.devices()[0], "core_count", None) or 132


def aligned(cfg: AttentionConfig, rows: int, keys: int) -> bool:
    """Whole blocks (seqlen_q % rows, seqlen_k % keys), no window, causal with every row seeing
    key 0: the domain d64 keeps (H200 run 07:20: at d64 a partial query tile gave wrong lse in
    the forward; the cause, found for d128 too, is fixed in `forward` (lse padded to whole tiles)
    but not yet re-run on the GPU at d64)."""
    if cfg.seqlen_q % rows or cfg.seqlen_k % keys or cfg.window_left is not None:
        return False
    return cfg.window_right is None or (cfg.window_right == 0 and cfg.shift >= 0)


def declines(q_shape, k_shape, v_shape, dtype, cfg: AttentionConfig) -> str | None:
    """Why this forward does not run the call (flashkit.jax.dispatch runs another), or None."""
    if cfg.interpret:
        return "the Pallas interpreter (interpret=True) runs no Mosaic GPU kernel"
    if not is_hopper():
        return f"not a Hopper GPU (the default device is {jax.devices()[0].device_kind})"
    return uncovered(q_shape, k_shape, v_shape, dtype, cfg)


def uncovered(q_shape, k_shape, v_shape, dtype, cfg: AttentionConfig) -> str | None:
    """What of the problem this kernel does not cover (original layout shapes, see the module
    doc), or None."""
    d = q_shape[3]
    if not any(dtype == t for t in _DTYPES):
        return f"dtype {jnp.dtype(dtype).name} (takes bfloat16, float16)"
    if v_shape[3] != d or d not in (64, 128):
        return f"head dims {d}/{v_shape[3]} (takes 128, or 64, q/k/v alike)"
    if d == 64 and not aligned(cfg, _CONSUMERS * 64, MIN_BLOCK_K):
        return "head dim 64 off whole blocks or with a window"
    return None


def supports(q_shape, k_shape, v_shape, dtype, cfg: AttentionConfig) -> bool:
    """Whether this kernel covers the problem, on a Hopper GPU (uncovered)."""
    return uncovered(q_shape, k_shape, v_shape, dtype, cfg) is None


def table_tile(d: int, causal: bool, seqlen_k: int) -> Tile:
    """TILES' entry for the cell."""
    return next(t for bound, t in TILES[d, causal] if bound is None or seqlen_k <= bound)


def cfg_tile(cfg: AttentionConfig, d: int) -> Tile:
    """The table's tile for this problem (banded problems take the causal row) with BLOCK_K
    halved (down to 64) until it divides seqlen_k, or, where no block of 64 or more divides it,
    while half a block still holds all the keys; STAGES at most the number of key blocks.
    block_k overrides BLOCK_K."""
    tile = table_tile(d, cfg.window_right is not None, cfg.seqlen_k)
    bk, sk = cfg.block_k or tile.block_k, cfg.seqlen_k
    while not cfg.block_k and bk > MIN_BLOCK_K and (
            sk % bk if sk % MIN_BLOCK_K == 0 else bk // 2 >= sk):
        bk //= 2
    return dataclasses.replace(tile, block_k=bk, stages=max(1, min(tile.stages,
                                                                   cdiv(sk, bk))))


def _kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, smem, barriers, *, cfg, tile, ctas):
    """q_ref/out_ref [B, Sq, H, D], k_ref/v_ref [B, Sk, Hk, D], lse_ref [B, H, >= Sq] (GMEM)."""
    bq, bk, stages = tile.block_q, tile.block_k, tile.stages
    cta_rows = _CONSUMERS * bq
    band = Band.keys_of_rows(cfg)
    left_edge, right_edge = band.edges(bk)  # masked blocks can precede / follow the whole ones
    floor = band.may_see_nothing()
    heaviest_first = cfg.window_right is not None and cfg.window_left is None
    q_smem, o_smem, k_smem, v_smem, lse_smem = smem  # [2, BQ, D] x2, [STAGES, BK, D] x2, [2, BQ]
    k_ready, v_ready, q_ready, k_free, v_free, turn = barriers
    batches, _, heads, _ = out_ref.shape
    wg, cta = lax.axis_index("wg"), lax.axis_index("cta")
    tiles_q = cdiv(cfg.seqlen_q, cta_rows)
    my_tiles = lax.div(tiles_q * heads * batches - 1 - cta, ctas) + 1  # cta, cta + ctas, ...

    def work(i):
        """(batch, head, query tile) of this CTA's i-th tile: heads fastest, then query tiles
        (heaviest first when causal), batch outermost. CTAs that run together then share a
        batch and read each K/V block from L2 several times, not from HBM."""
        t = cta + i * ctas
        head, rest = lax.rem(t, heads), lax.div(t, heads)
        tile_q = lax.rem(rest, tiles_q)
        return lax.div(rest, tiles_q), head, (tiles_q - 1 - tile_q) if heaviest_first else tile_q

    def cta_blocks(tile_q):
        """The key blocks the tile's rows see, [lo, hi): the producer streams these."""
        return band.blocks(tile_q * cta_rows, (tile_q + 1) * cta_rows, bk)

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

        def load_q(i):
            batch, head, tile_q = work(i)
            row0 = (tile_q * _CONSUMERS + wg) * bq
            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row0, bq), head], q_wg, q_ready.at[wg])

        def tile_body(i, base):
            """Tile i, whose first key block is the CTA's base-th."""
            batch, head, tile_q = work(i)
            row0 = (tile_q * _CONSUMERS + wg) * bq
            cta_lo, cta_hi = cta_blocks(tile_q)
            # This consumer's blocks [lo, hi) within the tile's, whole ones [lo_full, hi_full).
            lo, hi = band.blocks(row0, row0 + bq, bk)
            lo = clip(lo, cta_lo, cta_hi)
            hi = clip(hi, lo, cta_hi)
            lo_full, hi_full = band.full_blocks(row0, row0 + bq, bk)
            lo_full = clip(lo_full, lo, hi)
            hi_full = clip(hi_full, lo_full, hi)
            m = plgpu.layout_cast(jnp.full((bq,), _M_FLOOR if floor else -jnp.inf, jnp.float32),
                                  row_layout)
            l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout)
            acc = plgpu.layout_cast(jnp.zeros((bq, q_ref.shape[3]), jnp.float32),
                                    plgpu.Layout.WGMMA)
            plgpu.barrier_wait(q_ready.at[wg])
            pl.when(wg == 1)(take_turn)  # consumer 0 goes first

            def step(kb, state, masked):
                """Key block kb: S, softmax, then O += P V, waited for before the next S.
                Issuing the next S before this P V (FlashAttention-3's intra-warpgroup overlap)
                made ptxas serialise every wgmma (P's register operand is written inside S's
                open wgmma stage); issuing P V and the next S together measured no faster
                (results NOTES, runs 7-8)."""
                m, l, acc = state
                slot = slot_of(base + kb - cta_lo)

                def qk(s_ref):  # [BQ, BK] = [BQ, D] @ [D, BK]
                    plgpu.wgmma(s_ref, q_wg, k_smem.at[slot].transpose((1, 0)))
                    take_turn()  # the other consumer's matmuls go next
                    return s_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    s = jnp.where(band.visible(row0, kb * bk, s.shape, 0, bk), s, -jnp.inf)
                # m is finite after the first block (or floored): no NaN from -inf - -inf.
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

                    @pl.when(kb + 1 < hi)  # wait for the next K while this matmul runs
                    def _():
                        plgpu.barrier_wait(k_ready.at[slot_of(base + kb + 1 - cta_lo)])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))  # wgmma accumulates in place
                plgpu.barrier_arrive(v_free.at[slot])
                return m_new, l, acc

            def drain(kb, carry):
                """Blocks only the other consumer sees: wait for them (barrier phases stay in
                step), free their slots, keep taking turns."""
                slot = slot_of(base + kb - cta_lo)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                take_turn()
                take_turn()
                return carry

            state = (m, l, acc)
            if left_edge:  # a window's left edge: the other consumer's first blocks
                lax.fori_loop(cta_lo, lo, drain, None)

            @pl.when(lo < hi)
            def _():
                plgpu.barrier_wait(k_ready.at[slot_of(base + lo - cta_lo)])

            if left_edge:
                state = lax.fori_loop(lo, lo_full, functools.partial(step, masked=True), state)
            state = lax.fori_loop(lo_full, hi_full, functools.partial(step, masked=False), state)
            if right_edge:
                state = lax.fori_loop(hi_full, hi, functools.partial(step, masked=True), state)
            if cfg.window_right is not None:  # blocks past this consumer's diagonal
                lax.fori_loop(hi, cta_hi, drain, None)
            pl.when(wg == 0)(take_turn)
            pl.when(i + 1 < my_tiles)(functools.partial(load_q, i + 1))  # Q's slot is free
            m, l, acc = state

            inv_l = 1.0 / l
            lse = (m + jnp.log2(l)) / LOG2E  # natural log, as flashkit returns
            if floor:  # rows that saw no key: out 0, lse -inf
                inv_l = jnp.where(l > 0, inv_l, 0.0)
                lse = jnp.where(l > 0, lse, -jnp.inf)
            acc = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's O left o_wg
            o_wg[...] = acc.astype(q_ref.dtype)
            lse_wg[...] = lse
            plgpu.commit_smem()
            # TMA drops the rows of a partial last tile past seqlen_q.
            plgpu.copy_smem_to_gmem(o_wg, out_ref.at[batch, pl.ds(row0, bq), head])
            plgpu.copy_smem_to_gmem(lse_wg, lse_ref.at[batch, head, pl.ds(row0, bq)])
            return base + cta_hi - cta_lo

        load_q(0)
        lax.fori_loop(0, my_tiles, tile_body, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def tile_body(i, base):
            batch, head, tile_q = work(i)
            kv_head = lax.div(head, cfg.group)
            cta_lo, cta_hi = cta_blocks(tile_q)

            @pl.loop(0, cta_hi - cta_lo)
            def _(j):  # TMA zero-fills the keys of a partial last block past seqlen_k
                slot, rows = slot_of(base + j), (batch, pl.ds((cta_lo + j) * bk, bk), kv_head)
                for src, dst, ready, free in ((k_ref, k_smem, k_ready, k_free),
                                              (v_ref, v_smem, v_ready, v_free)):
                    # both consumers are done with the slot's last block (STAGES back)
                    pl.when(base + j >= stages)(functools.partial(plgpu.barrier_wait,
                                                                  free.at[slot]))
                    plgpu.copy_gmem_to_smem(src.at[rows], dst.at[slot], ready.at[slot])

            return base + cta_hi - cta_lo

        lax.fori_loop(0, my_tiles, tile_body, jnp.int32(0))


def forward(q, k, v, cfg: AttentionConfig):
    """q [B, Sq, H, D], k/v [B, Sk, Hk, D] (the caller's layout) -> (out [B, Sq, H, D],
    lse [B, H, Sq] float32). Only for problems `supports` accepts."""
    batch, seqlen_q, heads, d = q.shape
    tile = cfg_tile(cfg, d)
    bq, bk, stages = tile.block_q, tile.block_k, tile.stages
    tiles = batch * heads * cdiv(seqlen_q, _CONSUMERS * bq)
    ctas = min(tiles, sm_count()) if tile.persistent else tiles
    smem_tile = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    q, k, v = pad_rows(q), pad_rows(k), pad_rows(v)  # a no-op for lengths that are multiples of 8
    # lse's rows are padded to whole tiles (sliced off below): Mosaic stores a contiguous 1-D
    # slice with a plain bulk copy that is clipped only at the end of the whole array, so a
    # partial last tile would write into the next head's first rows (H200 run 07:24).
    lse_len = cdiv(seqlen_q, _CONSUMERS * bq) * _CONSUMERS * bq

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

    out, lse = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct((batch, heads, lse_len), jnp.float32)),
        grid=(ctas,),
        grid_names=("cta",),
        num_threads=_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v)
    return out[:, :seqlen_q], lse if lse_len == seqlen_q else lse[..., :seqlen_q]
