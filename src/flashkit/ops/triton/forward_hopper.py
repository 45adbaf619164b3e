"""Hopper-only forward in Gluon (triton.experimental.gluon): explicit TMA, mbarriers and async
wgmma; forward.py dispatches here when `eligible` says so and keeps dropout and varlen.

Notation as in common.py (whose mask predicate, tile ranges, scores and ALiBi helpers this file
calls: Gluon kernels can call those @triton.jit helpers). One consumer = one warpgroup owning
BLOCK_M = 64 query rows of one (batch, head); the accumulators live in the wgmma layout.

The pipeline (FA3's intra-warpgroup overlap, FA3 3.2): the wgmma of tile t's scores
S_t = Q K_t^T and of the previous tile's P_{t-1} V_{t-1} are issued back to back; the warps wait
for S_t alone and run its softmax while the tensor cores still work on P_{t-1} V_{t-1}, then O is
rescaled by tile t's alpha and P_t goes into the next step. After step t, O holds
sum_{i < t} P_i V_i in the scale of m_t, the running row max (log2 units) after tile t.

K/V tiles come through TMA into a NUM_STAGES-deep ring of shared-memory buffers with a "ready"
mbarrier per buffer and tensor. Two ways to run it (SPECIALIZED, configs.GLUON_FORWARD_TILES):
  - not specialized: one consumer per program issues its own loads; a buffer is refilled after
    the consumer's wgmma that read it completed (wgmma wait, then a warpgroup barrier); two or
    three programs share an SM and drift apart, so one's softmax hides under another's matmuls.
  - specialized (gl.warp_specialize, FA3's layout): a producer warp issues every TMA load and
    CONSUMERS warpgroups share each K/V tile (half the L2 -> shared-memory traffic per FLOP at
    two consumers); consumers release a buffer through "empty" mbarriers, so they drift freely.

Masking: every tile of the program's key range outside a consumer's fully visible middle
(common.key_tile_ranges) applies common.visible, which also drops keys >= seqlen_k. TMA reads
(batch * seqlen, heads * d) views, so a tile past a sequence's end reads the next sequence's
rows (or zeros past the tensor): their scores are masked to -inf, so they weigh exactly 0, and
query rows past seqlen_q are never stored.

Eligible (see `eligible`): CUDA sm_90, fp16/bf16, head dim 64 or 128 (q, k, v alike), dense,
any seqlen_q / seqlen_k, any window (causal included), softcap, ALiBi, sink, GQA; not dropout,
varlen or an SDPA bias; q/k/v contiguous in the flash-attn layout (so (batch * seqlen, heads * d)
is a plain 2-D view for TMA). Same outputs as forward.py: out in out's dtype, lse (batch, heads,
seqlen_q) float32 natural log, a row with no visible key (and no sink) gives out 0, lse -inf.
"""

from __future__ import annotations

import torch
import triton

from flashkit.ops.params import AttentionParams
from flashkit.ops.triton.common import (
    LOG2E,
    alibi_args,
    alibi_bias,
    interpreting,
    key_tile_ranges,
    load_alibi_log2,
    score_args,
    scores,
    visible,
    window_args,
)
from flashkit.ops.triton.configs import GLUON_FORWARD, GLUON_FORWARD_TILES

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon: the Triton kernel does everything
    gluon = None

BLOCK_M = 64  # query rows per consumer warpgroup (the wgmma M of one warpgroup)
PRODUCER_REGS = 24  # registers per thread of the producer warp (the least setmaxnreg allows)


if gluon is not None:
    LN2 = gl.constexpr(0.6931471805599453)
    LOG2E_GL = gl.constexpr(LOG2E)
    BM = gl.constexpr(BLOCK_M)
    PRODUCER_REGS_GL = gl.constexpr(PRODUCER_REGS)

    @gluon.jit
    def _issue_kv_load(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, tile, n_tiles, key0,
                       kv_col, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
        """TMA K and V tile `tile` (keys key0 + tile * BLOCK_N ..., key0 the first key row of
        the program's range in the 2-D view) into ring buffer tile % NUM_STAGES; skipped past
        n_tiles."""
        stage = tile % NUM_STAGES
        valid = tile < n_tiles
        row = key0 + tile * BLOCK_N
        mbarrier.expect(k_bars.index(stage), k_desc.block_type.nbytes, pred=valid)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_bars.index(stage),
                                        k_smem.index(stage), pred=valid)
        mbarrier.expect(v_bars.index(stage), v_desc.block_type.nbytes, pred=valid)
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_bars.index(stage),
                                        v_smem.index(stage), pred=valid)

    @gluon.jit
    def _softmax_step(qk, m_i, l_i, rows, cols, geo, alibi_log2, MASK: gl.constexpr,
                      HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                      ALIBI: gl.constexpr):
        """Online softmax of raw scores qk [BLOCK_M, BLOCK_N] for query rows `rows` [BLOCK_M, 1]
        and key columns `cols` [1, BLOCK_N]. Plain scores take the row max on qk and scale it
        after (qk_scale > 0), so s - m is one FMA per element; softcap/ALiBi build s first. MASK
        applies the band predicate; a row that has seen only -inf then subtracts 0, not -inf."""
        seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_scale = geo
        if SOFTCAP or ALIBI:
            s = scores(qk, qk_scale, softcap_scale, SOFTCAP)
            if ALIBI:
                s = s - alibi_bias(rows, cols, seqlen_q, seqlen_k, alibi_log2)
            scale = 1.0
        else:
            s = qk
            scale = qk_scale
        if MASK:
            keep = visible(rows, cols, seqlen_q, seqlen_k, window_left, window_right, HAS_LEFT,
                           HAS_RIGHT)
            s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * scale)
        m_use = m_new
        if MASK:
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * scale - gl.expand_dims(m_use, 1))
        alpha = gl.exp2(m_i - m_use)
        l_new = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_new

    @gluon.jit
    def _release_k(k_empty, stage, SPECIALIZED: gl.constexpr):
        """This consumer's wgmma that read K buffer `stage` completed: hand it to the producer
        (the unspecialized consumer refills K and V together in _release_v)."""
        if SPECIALIZED:
            mbarrier.arrive(k_empty.index(stage), count=1)

    @gluon.jit
    def _take_turn(turns, step, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong (FA3 3.1): the consumers issue their wgmmas in turns, so one's softmax runs
        while the other's matmuls do. Consumer 0 goes first: a fresh mbarrier passes a wait on
        phase 1. Every consumer takes n_tiles + 1 turns (prologue, steps, epilogue)."""
        if PINGPONG:
            mbarrier.wait(turns.index(CONSUMER), (step & 1) ^ (1 - CONSUMER))

    @gluon.jit
    def _pass_turn(turns, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turns.index(1 - CONSUMER), count=1)

    @gluon.jit
    def _release_v(descs, smem, bars, tile, n_tiles, key0, kv_col, BLOCK_N: gl.constexpr,
                   NUM_STAGES: gl.constexpr, SPECIALIZED: gl.constexpr):
        """This consumer's P V wgmma of tile `tile` completed: hand V's buffer to the producer,
        or (unspecialized) refill the buffer with tile + NUM_STAGES after every warp is done."""
        k_desc, v_desc = descs
        q_smem, k_smem, v_smem = smem
        q_bars, k_ready, v_ready, k_empty, v_empty, turns = bars
        stage = tile % NUM_STAGES
        if SPECIALIZED:
            mbarrier.arrive(v_empty.index(stage), count=1)
        else:
            gl.thread_barrier()
            _issue_kv_load(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, tile + NUM_STAGES,
                           n_tiles, key0, kv_col, BLOCK_N, NUM_STAGES)

    @gluon.jit
    def _pipelined_step(descs, smem, bars, q_tile, acc, p_op, m_i, l_i, rows, tile, n_tiles,
                        key0, key_start, kv_col, geo, alibi_log2, BLOCK_N: gl.constexpr,
                        NUM_STAGES: gl.constexpr, SPECIALIZED: gl.constexpr,
                        CONSUMER: gl.constexpr, PINGPONG: gl.constexpr, MASK: gl.constexpr,
                        HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                        SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, s_layout: gl.constexpr,
                        o_layout: gl.constexpr, p_layout: gl.constexpr):
        """S_tile and P_{tile-1} V_{tile-1} in flight together, softmax of S_tile under the
        second; returns (acc rescaled to m_tile, P_tile as the next A operand, m, l).
        key_start: the first key column of tile 0 (within the sequence)."""
        q_smem, k_smem, v_smem = smem
        q_bars, k_ready, v_ready, k_empty, v_empty, turns = bars
        stage = tile % NUM_STAGES
        mbarrier.wait(k_ready.index(stage), (tile // NUM_STAGES) & 1)
        prev = (tile - 1) % NUM_STAGES
        mbarrier.wait(v_ready.index(prev), ((tile - 1) // NUM_STAGES) & 1)
        _take_turn(turns, tile, CONSUMER, PINGPONG)
        # [BLOCK_M, BLOCK_N] = [BLOCK_M, D] @ [D, BLOCK_N]
        s_tok = warpgroup_mma(q_tile, k_smem.index(stage).permute((1, 0)),
                              gl.zeros([BM, BLOCK_N], gl.float32, s_layout),
                              use_acc=False, is_async=True)
        # [BLOCK_M, D] += [BLOCK_M, BLOCK_N] @ [BLOCK_N, D]
        o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        _pass_turn(turns, CONSUMER, PINGPONG)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        _release_k(k_empty, stage, SPECIALIZED)
        cols = key_start + tile * BLOCK_N + gl.arange(0, BLOCK_N,
                                                      layout=gl.SliceLayout(0, s_layout))
        p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, rows, gl.expand_dims(cols, 0), geo,
                                           alibi_log2, MASK, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                                           ALIBI)
        p_next = gl.convert_layout(p.to(q_tile.dtype), p_layout)
        # The softmax results pass through the wait so that the compiler cannot sink the softmax
        # below it (which would serialise it after the P V matmul again).
        acc, p_op, p_next, alpha, l_i = warpgroup_mma_wait(
            num_outstanding=0, deps=(o_tok, p_op, p_next, alpha, l_i))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        _release_v((descs[1], descs[2]), smem, bars, tile - 1, n_tiles, key0, kv_col, BLOCK_N,
                   NUM_STAGES, SPECIALIZED)
        return acc, p_next, m_i, l_i

    @gluon.jit
    def _consumer(descs, smem, bars, scalars, CONSUMER: gl.constexpr, HEAD_DIM: gl.constexpr,
                  BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                  SPECIALIZED: gl.constexpr, PINGPONG: gl.constexpr, HAS_LEFT: gl.constexpr,
                  HAS_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr,
                  SINK: gl.constexpr):
        """One warpgroup: query rows start_m + CONSUMER * BLOCK_M ... over the program's key
        tiles [lo, lo + n_tiles * BLOCK_N), then out and lse of its rows."""
        (Out, Lse, Alibi, Sink, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
         stride_ab, stride_ah, off_b, off_h, start_m, lo, n_tiles, key0, kv_col, seqlen_q,
         seqlen_k, window_left, window_right, qk_scale, softcap_scale) = scalars
        geo = (seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_scale)
        q_smem, k_smem, v_smem = smem
        q_bars, k_ready, v_ready, k_empty, v_empty, turns = bars
        dtype: gl.constexpr = q_smem.dtype

        # Accumulators in the wgmma layout: warps stacked along the rows, 16 rows per warp.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        row0 = start_m + CONSUMER * BM
        rows_1d = row0 + gl.arange(0, BM, layout=row_layout)
        rows = gl.expand_dims(rows_1d, 1)
        alibi_log2 = load_alibi_log2(Alibi, off_b, off_h, stride_ab, stride_ah, ALIBI)
        m_i = gl.full([BM], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([BM], gl.float32, row_layout)
        if SINK:  # the sink logit joins every row's denominator: start from (m, l) = (sink, 1)
            m_i = gl.full([BM], 0.0, gl.float32, row_layout) + gl.load(Sink + off_h) * LOG2E_GL
            l_i = l_i + 1.0
        acc = gl.zeros([BM, HEAD_DIM], gl.float32, o_layout)

        # Tiles [t_lo, t_hi) are fully visible from this warpgroup's rows (no mask).
        _, mid_lo, mid_hi, _ = key_tile_ranges(row0, seqlen_q, seqlen_k, window_left,
                                               window_right, BM, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        t_lo = gl.minimum(gl.cdiv(gl.maximum(mid_lo - lo, 0), BLOCK_N), n_tiles)
        t_hi = gl.minimum(gl.maximum((mid_hi - lo) // BLOCK_N, t_lo), n_tiles)
        q_tile = q_smem.index(CONSUMER)
        if n_tiles > 0:
            # Tile 0 on its own: its scores, nothing to add to O yet (masked: exact anywhere).
            mbarrier.wait(q_bars.index(CONSUMER), 0)
            mbarrier.wait(k_ready.index(0), 0)
            _take_turn(turns, 0, CONSUMER, PINGPONG)
            s_tok = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)),
                                  gl.zeros([BM, BLOCK_N], gl.float32, s_layout), use_acc=False,
                                  is_async=True)
            _pass_turn(turns, CONSUMER, PINGPONG)
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
            _release_k(k_empty, 0, SPECIALIZED)
            cols = lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, rows, gl.expand_dims(cols, 0),
                                               geo, alibi_log2, True, HAS_LEFT, HAS_RIGHT,
                                               SOFTCAP, ALIBI)
            p_op = gl.convert_layout(p.to(dtype), p_layout)

            if HAS_LEFT:  # masked tiles left of the visible middle
                for tile in range(1, gl.maximum(t_lo, 1)):
                    acc, p_op, m_i, l_i = _pipelined_step(
                        descs, smem, bars, q_tile, acc, p_op, m_i, l_i, rows, tile, n_tiles,
                        key0, lo, kv_col, geo, alibi_log2, BLOCK_N, NUM_STAGES, SPECIALIZED,
                        CONSUMER, PINGPONG, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, s_layout,
                        o_layout, p_layout)
            for tile in range(gl.maximum(t_lo, 1), gl.maximum(t_hi, 1)):
                acc, p_op, m_i, l_i = _pipelined_step(
                    descs, smem, bars, q_tile, acc, p_op, m_i, l_i, rows, tile, n_tiles, key0,
                    lo, kv_col, geo, alibi_log2, BLOCK_N, NUM_STAGES, SPECIALIZED, CONSUMER,
                    PINGPONG, False,
                    HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, s_layout, o_layout, p_layout)
            for tile in range(gl.maximum(t_hi, 1), n_tiles):  # diagonal, right bound, last tile
                acc, p_op, m_i, l_i = _pipelined_step(
                    descs, smem, bars, q_tile, acc, p_op, m_i, l_i, rows, tile, n_tiles, key0,
                    lo, kv_col, geo, alibi_log2, BLOCK_N, NUM_STAGES, SPECIALIZED, CONSUMER,
                    PINGPONG, True,
                    HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, s_layout, o_layout, p_layout)

            last = (n_tiles - 1) % NUM_STAGES
            mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // NUM_STAGES) & 1)
            _take_turn(turns, n_tiles, CONSUMER, PINGPONG)
            o_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
            _pass_turn(turns, CONSUMER, PINGPONG)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, ))

        # A row with no visible key (and no sink) has l = 0: out 0 (acc is 0), lse -inf.
        has_mass = l_i > 0.0
        l_safe = gl.where(has_mass, l_i, 1.0)
        out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
        rows_o = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
        cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = (Out + off_b.to(gl.int64) * stride_ob + off_h * stride_oh
                  + gl.expand_dims(rows_o, 1).to(gl.int64) * stride_os
                  + gl.expand_dims(cols_o, 0))
        gl.store(o_ptrs, out.to(Out.dtype.element_ty),
                 mask=gl.expand_dims(rows_o, 1) < seqlen_q)
        lse = gl.where(has_mass, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
        gl.store(Lse + off_b.to(gl.int64) * stride_lb + off_h * stride_lh + rows_1d, lse,
                 mask=rows_1d < seqlen_q)

    @gluon.jit
    def _producer(descs, smem, bars, scalars, q_row, q_col, CONSUMERS: gl.constexpr,
                  BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
        """The producer warp: Q of every consumer, then K and V tiles into the ring as the
        consumers free its buffers (a fresh mbarrier passes a wait on phase 1, so the first
        NUM_STAGES waits pass)."""
        q_desc, k_desc, v_desc = descs
        q_smem, k_smem, v_smem = smem
        q_bars, k_ready, v_ready, k_empty, v_empty, turns = bars
        n_tiles = scalars[15]
        key0 = scalars[16]
        kv_col = scalars[17]
        for c in gl.static_range(CONSUMERS):
            mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes, pred=n_tiles > 0)
            tma.async_copy_global_to_shared(q_desc, [q_row + c * BM, q_col], q_bars.index(c),
                                            q_smem.index(c), pred=n_tiles > 0)
        for tile in range(n_tiles):
            stage = tile % NUM_STAGES
            phase = (tile // NUM_STAGES) & 1
            row = key0 + tile * BLOCK_N
            mbarrier.wait(k_empty.index(stage), phase ^ 1)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(stage),
                                            k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), phase ^ 1)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(stage),
                                            v_smem.index(stage))

    @gluon.jit
    def _fwd_hopper_kernel(q_desc, k_desc, v_desc, Out, Lse, Alibi, Sink,
                           stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ab,
                           stride_ah, nheads, group, seqlen_q, seqlen_k, window_left,
                           window_right, qk_scale, softcap_scale,
                           HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                           NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                           SPECIALIZED: gl.constexpr, PINGPONG: gl.constexpr,
                           CONSUMER_REGS: gl.constexpr,
                           HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                           SOFTCAP: gl.constexpr, ALIBI: gl.constexpr, SINK: gl.constexpr,
                           num_warps: gl.constexpr):
        """One program per CONSUMERS * 64 query rows of one (batch, head), heaviest causal rows
        first. q_desc/k_desc/v_desc: TMA descriptors over (batch * seqlen, heads * HEAD_DIM)."""
        BLOCK_Q: gl.constexpr = CONSUMERS * BM
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        pid_bh = gl.program_id(1)
        off_b = pid_bh // nheads
        off_h = pid_bh % nheads
        start_m = pid_m * BLOCK_Q
        kv_col = (off_h // group) * HEAD_DIM
        lo, _, _, hi = key_tile_ranges(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                       BLOCK_Q, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        n_tiles = gl.cdiv(hi - lo, BLOCK_N)
        key0 = off_b * seqlen_k + lo  # the program's first key row in the 2-D view
        q_row = off_b * seqlen_q + start_m
        dtype: gl.constexpr = q_desc.dtype

        q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BM, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(CONSUMERS):
            mbarrier.init(q_bars.index(c), count=1)
            mbarrier.init(turns.index(c), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=CONSUMERS)  # one arrive per consumer
            mbarrier.init(v_empty.index(i), count=CONSUMERS)

        smem = (q_smem, k_smem, v_smem)
        bars = (q_bars, k_ready, v_ready, k_empty, v_empty, turns)
        scalars = (Out, Lse, Alibi, Sink, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                   stride_ab, stride_ah, off_b, off_h, start_m, lo, n_tiles, key0, kv_col,
                   seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_scale)
        descs = (q_desc, k_desc, v_desc)
        if SPECIALIZED:
            if CONSUMERS == 1:
                gl.warp_specialize(
                    [(_consumer, (descs, smem, bars, scalars, 0, HEAD_DIM, BLOCK_N, NUM_STAGES,
                                  CONSUMERS, SPECIALIZED, PINGPONG, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                                  ALIBI, SINK)),
                     (_producer, (descs, smem, bars, scalars, q_row, off_h * HEAD_DIM, CONSUMERS,
                                  BLOCK_N, NUM_STAGES))],
                    [1], [PRODUCER_REGS_GL])
            else:  # the second consumer is a worker partition of its own warpgroup
                gl.warp_specialize(
                    [(_consumer, (descs, smem, bars, scalars, 0, HEAD_DIM, BLOCK_N, NUM_STAGES,
                                  CONSUMERS, SPECIALIZED, PINGPONG, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                                  ALIBI, SINK)),
                     (_producer, (descs, smem, bars, scalars, q_row, off_h * HEAD_DIM, CONSUMERS,
                                  BLOCK_N, NUM_STAGES)),
                     (_consumer, (descs, smem, bars, scalars, 1, HEAD_DIM, BLOCK_N, NUM_STAGES,
                                  CONSUMERS, SPECIALIZED, PINGPONG, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                                  ALIBI, SINK))],
                    [1, 4], [PRODUCER_REGS_GL, CONSUMER_REGS])
        else:
            mbarrier.expect(q_bars.index(0), q_desc.block_type.nbytes, pred=n_tiles > 0)
            tma.async_copy_global_to_shared(q_desc, [q_row, off_h * HEAD_DIM], q_bars.index(0),
                                            q_smem.index(0), pred=n_tiles > 0)
            for i in gl.static_range(NUM_STAGES):
                _issue_kv_load(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, i, n_tiles,
                               key0, kv_col, BLOCK_N, NUM_STAGES)
            _consumer(descs, smem, bars, scalars, 0, HEAD_DIM, BLOCK_N, NUM_STAGES, CONSUMERS,
                      SPECIALIZED, PINGPONG, HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, SINK)

        for c in gl.static_range(CONSUMERS):
            mbarrier.invalidate(q_bars.index(c))
            mbarrier.invalidate(turns.index(c))
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(k_ready.index(i))
            mbarrier.invalidate(v_ready.index(i))
            mbarrier.invalidate(k_empty.index(i))
            mbarrier.invalidate(v_empty.index(i))


def _flash_layout_2d(x: torch.Tensor) -> bool:
    """x (batch, seqlen, heads, d) is contiguous, so (batch * seqlen, heads * d) is a view."""
    return x.is_contiguous() and x.data_ptr() % 16 == 0


def eligible(q, k, v, params: AttentionParams, out, lse, tile) -> bool:
    """Whether the Gluon kernel computes this call (else forward.py's kernel does)."""
    if not GLUON_FORWARD or gluon is None or interpreting() or tile is not None:
        return False
    supported = (params.attn_bias is None and params.dropout_p == 0 and not params.is_varlen
                 and params.softmax_scale > 0)
    if not (supported and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return False
    head_dim = q.shape[-1]  # dense: varlen was excluded above
    return (head_dim in GLUON_FORWARD_TILES and head_dim == v.shape[-1] == k.shape[-1]
            and q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype
            and min(q.shape[1], k.shape[1]) > 0
            and all(_flash_layout_2d(x) for x in (q, k, v))
            and (out is None or out.stride(-1) == 1) and (lse is None or lse.stride(-1) == 1))


def launch_config(tile) -> dict:
    """num_warps, maxnreg and the consumer worker's registers of a tile (BLOCK_N, NUM_STAGES,
    CONSUMERS, SPECIALIZED, PINGPONG). Specialized programs have CONSUMERS + 1 warpgroups (the
    producer warp pads to one); one consumer aims at two programs per SM, two at one."""
    _, _, consumers, specialized, _ = tile
    if not specialized:
        return dict(num_warps=4, CONSUMER_REGS=0)
    warpgroups, programs = consumers + 1, (2 if consumers == 1 else 1)
    maxnreg = min(65536 // (128 * warpgroups * programs) // 8 * 8, 256)
    consumer_regs = min((maxnreg * warpgroups - PRODUCER_REGS) // consumers // 8 * 8, 240)
    return dict(num_warps=4, maxnreg=maxnreg, CONSUMER_REGS=consumer_regs)


def attention_forward(q, k, v, params: AttentionParams, out=None, lse=None, tile=None):
    """(out, lse) of an eligible call; tile overrides configs.GLUON_FORWARD_TILES (the sweep)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if out is None:
        out_dtype = torch.float32 if params.fp32_out else q.dtype
        out = torch.empty((batch, seqlen_q, nheads, head_dim), dtype=out_dtype, device=q.device)
    if lse is None:
        lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    tile = tile or GLUON_FORWARD_TILES[head_dim]
    block_n, num_stages, consumers, specialized, pingpong = tile
    gl_dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def descriptor(x, rows):
        seqlen, heads = x.shape[1], x.shape[2]
        layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl_dtype)
        return TensorDescriptor(x.view(batch * seqlen, heads * head_dim),
                                [batch * seqlen, heads * head_dim], [heads * head_dim, 1],
                                [rows, head_dim], layout)

    window_left, window_right, has_left, has_right = window_args(params)
    qk_scale, softcap_scale, softcap = score_args(params, q.dtype)
    alibi, alibi_strides, has_alibi = alibi_args(params, lse)
    sink = lse if params.sink is None else params.sink.to(torch.float32)
    grid = (triton.cdiv(seqlen_q, BLOCK_M * consumers), batch * nheads)
    _fwd_hopper_kernel[grid](
        descriptor(q, BLOCK_M), descriptor(k, block_n), descriptor(v, block_n), out, lse, alibi,
        sink, out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        *alibi_strides, nheads, nheads // nheads_k, seqlen_q, seqlen_k, window_left,
        window_right, qk_scale, softcap_scale,
        HEAD_DIM=head_dim, BLOCK_N=block_n, NUM_STAGES=num_stages, CONSUMERS=consumers,
        SPECIALIZED=specialized, PINGPONG=pingpong and consumers == 2, HAS_LEFT=has_left,
        HAS_RIGHT=has_right, SOFTCAP=softcap, ALIBI=has_alibi, SINK=params.sink is not None,
        **launch_config(tile))
    return out, lse
