"""Hopper-only backward in Gluon (triton.experimental.gluon), FA3-style, for the plain case: a
dK/dV kernel and a dQ kernel; backward.py launches them after its preprocess (delta).

Notation as in backward.py: P = exp2(s - lse2) recomputed from the saved lse, dP = dO V^T,
dS = P * (dP - delta), dV = P^T dO, dK = scale dS^T Q, dQ = scale dS K. Transposed tiles carry
a _t suffix: s_t is [BLOCK_N, BLOCK_M] = S^T.

One program per BLOCK_N key rows of one (batch, kv head). K and V stay in shared memory; the
query tiles that see the block, of every query head of the GQA group in turn, stream through a
NUM_STAGES-deep ring of Q and dO buffers filled by TMA (one mbarrier per buffer and tensor, issued
by the program's own warps, refilled once every wgmma that read the buffer has completed). Per
query tile, all matmuls are wgmma with B (and for dQ also A) in shared memory:
    S^T  = K Q^T       [BLOCK_N, BLOCK_M]  issued together with dP^T, so the exp2 of P^T
    dP^T = V dO^T      [BLOCK_N, BLOCK_M]  runs while the tensor cores still work on dP^T
    dV  += P^T dO      [BLOCK_N, D]        P^T and dS^T from registers, both issued once dS
    dK  += dS^T Q      [BLOCK_N, D]        is formed (P, dP, delta die first: register room)
    dQ_p = dS K        [BLOCK_M, D]        (ATOMIC_DQ) dS^T through shared memory, read as its
                                           transposed view; added to an fp32 accumulator with
                                           relaxed atomics (backward.py scales and converts it)
Without ATOMIC_DQ (params.deterministic, or configs.GLUON_BACKWARD_ATOMIC_DQ off, the default)
the kernel does the first four only and the dQ kernel here sums dQ in a fixed order (bitwise
reproducible): one program per BLOCK_M query rows, Q and dO resident, K/V tiles through a TMA
ring, S = Q K^T and dP = dO V^T issued together (P's exp2 under dP), dQ += dS K with dS from
registers, lse and delta per row in registers (two values per thread in this layout).

Eligible (see `eligible`): CUDA sm_90, fp16/bf16, head dim 64 or 128 (q, k, v alike), self
attention (seqlen_q == seqlen_k, a multiple of both tiles), full or causal, GQA, no softcap /
ALiBi / sink / bias / dropout / varlen, q/k/v/dout contiguous in the flash-attn layout (so
(batch * seqlen, heads * d) is a plain 2-D view for TMA). Every row then sees at least its own
key, so lse is finite and no row needs the -inf guard of the Triton kernels.
"""

from __future__ import annotations

import torch

from flashkit.ops.params import AttentionParams
from flashkit.ops.triton.common import LOG2E, interpreting
from flashkit.ops.triton.configs import GLUON_BACKWARD

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon: the Triton kernels do everything
    gluon = None
if gluon is not None:  # the forward's K/V ring fill serves the dQ kernel as it is
    from flashkit.ops.triton.forward_hopper import _issue_kv_load


if gluon is not None:
    LOG2E_G = gl.constexpr(LOG2E)

    @gluon.jit
    def _issue_q_do_load(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem,
                         delta_smem, q_bars, do_bars, job, n_jobs, jobs_per_head, m_first, q_row,
                         q_col, lse_row, seqlen, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                         NUM_STAGES: gl.constexpr):
        """TMA the Q and dO tiles of job `job` (with their lse and delta rows) into ring buffer
        job % NUM_STAGES, skipped past n_jobs. Job j is query tile m_first + j % jobs_per_head of
        group head j // jobs_per_head."""
        stage = job % NUM_STAGES
        valid = job < n_jobs
        g = job // jobs_per_head
        start_m = (m_first + job % jobs_per_head) * BLOCK_M
        col = q_col + g * HEAD_DIM
        row_1d = lse_row + g * seqlen + start_m
        q_bar = q_bars.index(stage)
        mbarrier.expect(q_bar, q_desc.block_type.nbytes + lse_desc.block_type.nbytes, pred=valid)
        tma.async_copy_global_to_shared(q_desc, [q_row + start_m, col], q_bar,
                                        q_smem.index(stage), pred=valid)
        tma.async_copy_global_to_shared(lse_desc, [row_1d], q_bar, lse_smem.index(stage),
                                        pred=valid)
        do_bar = do_bars.index(stage)
        mbarrier.expect(do_bar, do_desc.block_type.nbytes + delta_desc.block_type.nbytes,
                        pred=valid)
        tma.async_copy_global_to_shared(do_desc, [q_row + start_m, col], do_bar,
                                        do_smem.index(stage), pred=valid)
        tma.async_copy_global_to_shared(delta_desc, [row_1d], do_bar, delta_smem.index(stage),
                                        pred=valid)

    @gluon.jit
    def _query_tile_step(dk, dv, job, m, dq_base, k_smem, v_smem, q_smem, do_smem, lse_smem,
                         delta_smem, ds_smem, q_bars, do_bars, q_desc, do_desc, lse_desc,
                         delta_desc, n_jobs, jobs_per_head, m_first, q_row, q_col, lse_row,
                         seqlen, start_n, qk_scale,
                         HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         NUM_STAGES: gl.constexpr, MASK: gl.constexpr, ATOMIC_DQ: gl.constexpr,
                         DQ_CHUNK: gl.constexpr, st_layout: gl.constexpr,
                         kv_layout: gl.constexpr, dq_layout: gl.constexpr,
                         op_layout: gl.constexpr):
        """Add query tile m (ring job `job`) to dK, dV (and dQ's accumulator); MASK applies the
        causal predicate key <= query. Returns (dk, dv)."""
        stage = job % NUM_STAGES
        phase = (job // NUM_STAGES) & 1
        start_m = m * BLOCK_M
        dtype: gl.constexpr = q_smem.dtype
        zero_st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
        q_buf = q_smem.index(stage)
        do_buf = do_smem.index(stage)
        col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)

        mbarrier.wait(q_bars.index(stage), phase)
        # [BLOCK_N, BLOCK_M] = [BLOCK_N, D] @ [D, BLOCK_M]
        s_tok = warpgroup_mma(k_smem, q_buf.permute((1, 0)), zero_st, use_acc=False,
                              is_async=True)
        mbarrier.wait(do_bars.index(stage), phase)
        # [BLOCK_N, BLOCK_M] = [BLOCK_N, D] @ [D, BLOCK_M]
        dp_tok = warpgroup_mma(v_smem, do_buf.permute((1, 0)), zero_st, use_acc=False,
                               is_async=True)
        s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        # lse and delta are read from shared memory at their use: as per-column vectors of the
        # wgmma layout they would hold 2 * BLOCK_M / 4 registers across the matmuls.
        lse2 = lse_smem.index(stage).load(col_layout) * LOG2E_G
        p_t = gl.exp2(s_t * qk_scale - gl.expand_dims(lse2, 0))
        if MASK:
            rows_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
            cols_m = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
            keep = gl.expand_dims(rows_n, 1) <= gl.expand_dims(cols_m, 0)
            p_t = gl.where(keep, p_t, 0.0)
        dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
        delta = delta_smem.index(stage).load(col_layout)
        ds_t = (p_t * (dp_t - gl.expand_dims(delta, 0))).to(dtype)
        # dV and dK only after dS: their register operands then replace P, dP and delta instead
        # of living beside them (d128: dK + dV alone take 128 of the 255 registers).
        # [BLOCK_N, D] += [BLOCK_N, BLOCK_M] @ [BLOCK_M, D]
        dv_tok = warpgroup_mma(gl.convert_layout(p_t.to(dtype), op_layout), do_buf, dv,
                               is_async=True)
        # [BLOCK_N, D] += [BLOCK_N, BLOCK_M] @ [BLOCK_M, D]
        dk_tok = warpgroup_mma(gl.convert_layout(ds_t, op_layout), q_buf, dk, is_async=True)
        if ATOMIC_DQ:
            ds_smem.store(ds_t)
            fence_async_shared()
            gl.thread_barrier()
            rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
            cols = gl.arange(0, DQ_CHUNK, layout=gl.SliceLayout(0, dq_layout))
            offs = gl.expand_dims(rows * HEAD_DIM, 1) + gl.expand_dims(cols, 0)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok))
            # dQ in DQ_CHUNK-column slices, so that its accumulator fits beside dK and dV:
            # [BLOCK_M, DQ_CHUNK] = [BLOCK_M, BLOCK_N] @ [BLOCK_N, DQ_CHUNK]
            for c in gl.static_range(HEAD_DIM // DQ_CHUNK):
                dq_tok = warpgroup_mma(ds_smem.permute((1, 0)),
                                       k_smem.slice(c * DQ_CHUNK, DQ_CHUNK, dim=1),
                                       gl.zeros([BLOCK_M, DQ_CHUNK], gl.float32, dq_layout),
                                       use_acc=False, is_async=True)
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, ))
                gl.atomic_add(dq_base + c * DQ_CHUNK + offs, dq, sem="relaxed")
        else:
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok))
        # Every warp's reads of this buffer (and of ds_smem) are done: refill it.
        gl.thread_barrier()
        _issue_q_do_load(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem,
                         delta_smem, q_bars, do_bars, job + NUM_STAGES, n_jobs, jobs_per_head,
                         m_first, q_row, q_col, lse_row, seqlen, BLOCK_M, HEAD_DIM, NUM_STAGES)
        return dk, dv

    @gluon.jit
    def _bwd_dkdv_hopper_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DK, DV,
                                DQAcc, stride_dkb, stride_dks, stride_dkh,
                                stride_dvb, stride_dvs, stride_dvh,
                                nheads, nheads_k, seqlen, qk_scale, softmax_scale,
                                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                                BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                                CAUSAL: gl.constexpr, ATOMIC_DQ: gl.constexpr,
                                DQ_CHUNK: gl.constexpr, DQ_WARPS_M: gl.constexpr,
                                DS_LAYOUT: gl.constexpr, num_warps: gl.constexpr):
        """dK, dV of key block program_id(0) of (batch, kv head) program_id(1), heaviest causal
        blocks first. q/k/v/do descriptors over (batch * seqlen, heads * HEAD_DIM), lse/delta
        descriptors over their flat (batch * nheads * seqlen) rows; DQAcc (ATOMIC_DQ) is the
        fp32 accumulator (batch * nheads, seqlen, HEAD_DIM) of dQ / scale."""
        pid_n = gl.program_id(0)
        pid_bh = gl.program_id(1)
        off_b = pid_bh // nheads_k
        off_hk = pid_bh % nheads_k
        group = nheads // nheads_k
        start_n = pid_n * BLOCK_N
        q_row = off_b * seqlen
        q_col = off_hk * group * HEAD_DIM
        lse_row = (off_b * nheads + off_hk * group) * seqlen
        dtype: gl.constexpr = q_desc.dtype

        # wgmma accumulators: warps stacked along the key rows (dQ: along its query rows, and
        # across its columns when BLOCK_M has fewer 16-row slices than there are warps).
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[DQ_WARPS_M, num_warps // DQ_WARPS_M],
            instr_shape=[16, DQ_CHUNK * DQ_WARPS_M // num_warps, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout,
                                                      k_width=2)

        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM],
                                            do_desc.layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M],
                                             lse_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M],
                                               delta_desc.layout)
        if ATOMIC_DQ:
            ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], DS_LAYOUT)
        else:
            ds_smem = k_smem  # unused
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        do_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1],
                                            mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(q_bars.index(i), count=1)
            mbarrier.init(do_bars.index(i), count=1)

        # Query tiles that see this key block: causal, from the one holding query row start_n;
        # the first ones (up to the tile whose first row sees the block's last key) are masked.
        n_q = seqlen // BLOCK_M
        if CAUSAL:
            m_first = start_n // BLOCK_M
            m_unmasked = gl.minimum(gl.cdiv(start_n + BLOCK_N - 1, BLOCK_M), n_q)
        else:
            m_first = 0
            m_unmasked = 0
        jobs_per_head = n_q - m_first
        n_jobs = group * jobs_per_head

        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [q_row + start_n, off_hk * HEAD_DIM], kv_bar,
                                        k_smem)
        tma.async_copy_global_to_shared(v_desc, [q_row + start_n, off_hk * HEAD_DIM], kv_bar,
                                        v_smem)
        for i in gl.static_range(NUM_STAGES):
            _issue_q_do_load(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem,
                             delta_smem, q_bars, do_bars, i, n_jobs, jobs_per_head, m_first,
                             q_row, q_col, lse_row, seqlen, BLOCK_M, HEAD_DIM, NUM_STAGES)
        mbarrier.wait(kv_bar, 0)

        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        job = 0
        for g in range(group):  # the query heads that share this kv head, in a fixed order
            dq_base = DQAcc + (off_b * nheads + off_hk * group + g).to(gl.int64) * (
                seqlen * HEAD_DIM)
            for m in range(m_first, m_unmasked):
                dk, dv = _query_tile_step(
                    dk, dv, job, m, dq_base, k_smem, v_smem, q_smem, do_smem, lse_smem,
                    delta_smem, ds_smem, q_bars, do_bars, q_desc, do_desc, lse_desc, delta_desc,
                    n_jobs, jobs_per_head, m_first, q_row, q_col, lse_row, seqlen, start_n,
                    qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, True, ATOMIC_DQ, DQ_CHUNK,
                    st_layout, kv_layout, dq_layout, op_layout)
                job += 1
            for m in range(m_unmasked, n_q):
                dk, dv = _query_tile_step(
                    dk, dv, job, m, dq_base, k_smem, v_smem, q_smem, do_smem, lse_smem,
                    delta_smem, ds_smem, q_bars, do_bars, q_desc, do_desc, lse_desc, delta_desc,
                    n_jobs, jobs_per_head, m_first, q_row, q_col, lse_row, seqlen, start_n,
                    qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, False, ATOMIC_DQ,
                    DQ_CHUNK, st_layout, kv_layout, dq_layout, op_layout)
                job += 1

        mbarrier.invalidate(kv_bar)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(q_bars.index(i))
            mbarrier.invalidate(do_bars.index(i))

        rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
        rows_2d = gl.expand_dims(rows, 1).to(gl.int64)
        dk_ptrs = (DK + off_b.to(gl.int64) * stride_dkb + off_hk * stride_dkh
                   + rows_2d * stride_dks + gl.expand_dims(cols, 0))
        gl.store(dk_ptrs, (dk * softmax_scale).to(DK.dtype.element_ty))
        dv_ptrs = (DV + off_b.to(gl.int64) * stride_dvb + off_hk * stride_dvh
                   + rows_2d * stride_dvs + gl.expand_dims(cols, 0))
        gl.store(dv_ptrs, dv.to(DV.dtype.element_ty))


    @gluon.jit
    def _key_tile_dq_step(dq, tile, q_smem, do_smem, k_smem, v_smem, k_bars, v_bars, k_desc,
                          v_desc, lse2, delta, n_tiles, kv_row, kv_col, start_m, qk_scale,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          NUM_STAGES: gl.constexpr, MASK: gl.constexpr,
                          s_layout: gl.constexpr, op_layout: gl.constexpr):
        """Add key tile `tile` to dQ (unscaled); MASK applies key <= query."""
        stage = tile % NUM_STAGES
        phase = (tile // NUM_STAGES) & 1
        k_buf = k_smem.index(stage)
        v_buf = v_smem.index(stage)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        mbarrier.wait(k_bars.index(stage), phase)
        # [BLOCK_M, BLOCK_N] = [BLOCK_M, D] @ [D, BLOCK_N]
        s_tok = warpgroup_mma(q_smem, k_buf.permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
        mbarrier.wait(v_bars.index(stage), phase)
        # [BLOCK_M, BLOCK_N] = [BLOCK_M, D] @ [D, BLOCK_N]
        dp_tok = warpgroup_mma(do_smem, v_buf.permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
        if MASK:
            rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            cols = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            p = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1), p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
        ds = (p * (dp - gl.expand_dims(delta, 1))).to(q_smem.dtype)
        # [BLOCK_M, D] += [BLOCK_M, BLOCK_N] @ [BLOCK_N, D]
        dq_tok = warpgroup_mma(gl.convert_layout(ds, op_layout), k_buf, dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, ))
        gl.thread_barrier()  # every warp's reads of this buffer are done: refill it
        _issue_kv_load(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, tile + NUM_STAGES,
                        n_tiles, kv_row, kv_col, BLOCK_N, NUM_STAGES)
        return dq

    @gluon.jit
    def _bwd_dq_hopper_kernel(q_desc, k_desc, v_desc, do_desc, Lse, Delta, DQ,
                              stride_lb, stride_lh, stride_deltab, stride_deltah,
                              stride_dqb, stride_dqs, stride_dqh,
                              nheads, group, seqlen, qk_scale, softmax_scale,
                              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                              CAUSAL: gl.constexpr, num_warps: gl.constexpr):
        """dQ of BLOCK_M query rows of one (batch, head), heaviest causal rows first: Q and dO
        stay in shared memory, K/V tiles stream through a TMA ring (as the forward), each dQ
        element summed in one program in a fixed order (deterministic)."""
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        pid_bh = gl.program_id(1)
        off_b = pid_bh // nheads
        off_h = pid_bh % nheads
        start_m = pid_m * BLOCK_M
        q_row = off_b * seqlen + start_m
        kv_row = off_b * seqlen
        kv_col = (off_h // group) * HEAD_DIM
        dtype: gl.constexpr = q_desc.dtype

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout,
                                                      k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)

        if CAUSAL:
            n_tiles = gl.cdiv(start_m + BLOCK_M, BLOCK_N)
            n_unmasked = start_m // BLOCK_N  # key tiles left of the diagonal block
        else:
            n_tiles = seqlen // BLOCK_N
            n_unmasked = n_tiles

        mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, off_h * HEAD_DIM], q_bar, q_smem)
        tma.async_copy_global_to_shared(do_desc, [q_row, off_h * HEAD_DIM], q_bar, do_smem)
        for i in gl.static_range(NUM_STAGES):
            _issue_kv_load(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, i, n_tiles, kv_row,
                            kv_col, BLOCK_N, NUM_STAGES)
        rows = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
        lse2 = gl.load(Lse + off_b.to(gl.int64) * stride_lb + off_h * stride_lh + rows) * LOG2E_G
        delta = gl.load(Delta + off_b.to(gl.int64) * stride_deltab + off_h * stride_deltah
                        + rows)
        dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
        mbarrier.wait(q_bar, 0)

        for tile in range(0, n_unmasked):
            dq = _key_tile_dq_step(dq, tile, q_smem, do_smem, k_smem, v_smem, k_bars, v_bars,
                                   k_desc, v_desc, lse2, delta, n_tiles, kv_row, kv_col, start_m,
                                   qk_scale, BLOCK_M, BLOCK_N, NUM_STAGES, False, s_layout,
                                   op_layout)
        for tile in range(n_unmasked, n_tiles):
            dq = _key_tile_dq_step(dq, tile, q_smem, do_smem, k_smem, v_smem, k_bars, v_bars,
                                   k_desc, v_desc, lse2, delta, n_tiles, kv_row, kv_col, start_m,
                                   qk_scale, BLOCK_M, BLOCK_N, NUM_STAGES, True, s_layout,
                                   op_layout)

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))

        rows_o = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
        cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
        dq_ptrs = (DQ + off_b.to(gl.int64) * stride_dqb + off_h * stride_dqh
                   + gl.expand_dims(rows_o, 1).to(gl.int64) * stride_dqs
                   + gl.expand_dims(cols_o, 0))
        gl.store(dq_ptrs, (dq * softmax_scale).to(DQ.dtype.element_ty))


# (BLOCK_M, BLOCK_N, num_warps, NUM_STAGES) per head dim, one warpgroup per program (several
# programs per SM). dK/dV: dK and dV stay in registers ([BLOCK_N, D] fp32 each), which caps
# BLOCK_N * D at 64 * 128; 05:15 sweep at 4k (bf16, TFLOP/s of the whole backward with the
# Triton dQ kernel, full / causal): d64 (64, 64, 4, 2) 390 / 367 vs (64, 64, 4, 3) 385 / 346,
# 8 warps (64, 128) 348 / 328; d128 (64, 64, 4, 2) 418 / 381 vs 8 warps (64, 128) 411 / 362.
# 05:38 sweep (with the Gluon dQ kernel): d64 BLOCK_M 128 (S^T tiles [64, 128]: wider wgmma, half
# the K/V operand reads per flop) 397 / 365 vs (64, 64, 4, 2) 395 / 350.
HOPPER_BACKWARD = {
    64: (128, 64, 4, 2),
    128: (64, 64, 4, 2),
}
# dQ: Q, dO and the dQ accumulator per program, K/V streamed (the forward's shape). 05:23 sweep
# at 4k (whole backward, TFLOP/s full / causal): d64 (64, 64, 4, 2) 408 / 357, (64, 128, 4, 2)
# 382 / 365, (64, 64, 4, 3) 387 / 346; d128 (64, 64, 4, 2) 441 / 391, (64, 128, 4, 2)
# 404 / 371, (64, 64, 4, 3) 404 / 356; 05:38: two warpgroups sharing K/V (128, 64, 8, 2) d64
# 387 / 344, d128 427 / 373, (128, 128, 8, 2) d64 372 / 324.
HOPPER_BACKWARD_DQ = {
    64: (64, 64, 4, 2),
    128: (64, 64, 4, 2),
}


def _flash_layout_2d(x: torch.Tensor) -> bool:
    """x (batch, seqlen, heads, d) is contiguous, so (batch * seqlen, heads * d) is a view."""
    return x.is_contiguous() and x.data_ptr() % 16 == 0


def eligible(q, k, v, dout, lse, params: AttentionParams, dq, dk, dv, tiles) -> bool:
    """Whether the Gluon kernels compute this call's gradients (else backward.py's do)."""
    if (not GLUON_BACKWARD or gluon is None or interpreting()
            or set(tiles or {}) - {"hopper", "hopper_dq"}):
        return False
    plain = (params.softcap == 0 and params.alibi_slopes is None and params.sink is None
             and params.attn_bias is None and params.dropout_p == 0 and not params.is_varlen
             and params.softmax_scale > 0 and params.window_left is None
             and params.window_right in (None, 0))
    if not (plain and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return False
    _, seqlen_q, _, head_dim = q.shape  # dense: varlen was excluded above
    _, seqlen_k, _, head_dim_v = v.shape
    if head_dim not in HOPPER_BACKWARD:
        return False
    tile = max(*HOPPER_BACKWARD[head_dim][:2], *HOPPER_BACKWARD_DQ[head_dim][:2])
    return (head_dim == head_dim_v == k.shape[-1]
            and q.dtype in (torch.float16, torch.bfloat16)
            and q.dtype == k.dtype == v.dtype == dout.dtype
            and seqlen_q == seqlen_k and seqlen_q % tile == 0
            and all(_flash_layout_2d(x) for x in (q, k, v, dout, lse))
            and all(x.stride(-1) == 1 for x in (dq, dk, dv)))


def _descriptor(x, rows):
    """TMA descriptor of [rows, d] tiles over x (batch, seqlen, heads, d) as a 2-D view."""
    batch, seqlen, heads, head_dim = x.shape
    gl_dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl_dtype)
    return TensorDescriptor(x.view(batch * seqlen, heads * head_dim),
                            [batch * seqlen, heads * head_dim], [heads * head_dim, 1],
                            [rows, head_dim], layout)


def attention_backward_dkdv(dout, q, k, v, lse, delta, params: AttentionParams, dk, dv,
                            dq_acc=None, block=None):
    """dK, dV of the eligible case into dk, dv; with dq_acc (fp32 (batch * nheads, seqlen, d),
    zeroed) also dQ / scale added into it. delta (like lse) comes from backward.py's preprocess;
    block overrides HOPPER_BACKWARD (the sweep)."""
    batch, seqlen, nheads, head_dim = q.shape
    nheads_k = k.shape[2]
    block_m, block_n, num_warps, num_stages = block or HOPPER_BACKWARD[head_dim]
    gl_dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def rows_descriptor(x):  # lse / delta (batch, nheads, seqlen) as flat rows
        layout = gl.NVMMASharedLayout.get_default_for([block_m], gl.float32)
        return TensorDescriptor(x.view(-1), [x.numel()], [1], [block_m], layout)

    atomic_dq = dq_acc is not None
    grid = (seqlen // block_n, batch * nheads_k)
    _bwd_dkdv_hopper_kernel[grid](
        _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n),
        _descriptor(dout, block_m), rows_descriptor(lse), rows_descriptor(delta), dk, dv,
        dq_acc if atomic_dq else delta,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        nheads, nheads_k, seqlen, params.softmax_scale * LOG2E, params.softmax_scale,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=num_stages,
        CAUSAL=params.window_right == 0, ATOMIC_DQ=atomic_dq,
        DQ_CHUNK=min(head_dim, 64), DQ_WARPS_M=min(num_warps, block_m // 16),
        DS_LAYOUT=gl.NVMMASharedLayout.get_default_for([block_n, block_m], gl_dtype),
        num_warps=num_warps)


def attention_backward_dq(dout, q, k, v, lse, delta, params: AttentionParams, dq, block=None):
    """dQ of the eligible case into dq (deterministic); block overrides HOPPER_BACKWARD_DQ."""
    batch, seqlen, nheads, head_dim = q.shape
    block_m, block_n, num_warps, num_stages = block or HOPPER_BACKWARD_DQ[head_dim]
    grid = (seqlen // block_m, batch * nheads)
    _bwd_dq_hopper_kernel[grid](
        _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n),
        _descriptor(dout, block_m), lse, delta, dq,
        lse.stride(0), lse.stride(1), delta.stride(0), delta.stride(1),
        dq.stride(0), dq.stride(1), dq.stride(2),
        nheads, nheads // k.shape[2], seqlen, params.softmax_scale * LOG2E,
        params.softmax_scale, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        NUM_STAGES=num_stages, CAUSAL=params.window_right == 0, num_warps=num_warps)
