"""Hopper-only forward in Gluon (triton.experimental.gluon): explicit TMA, mbarriers and async
wgmma, for the plain case only; everything else stays on forward.py's kernel.

What it does that the Triton kernel cannot express (FA3's intra-warpgroup overlap, FA3 3.2):
the wgmma of tile j's scores S_j = Q K_j^T and of the previous tile's P_{j-1} V_{j-1} are issued
back to back without waiting; the warps then wait for S_j alone and run its softmax (exp2, row
max and sum) while the tensor cores still work on P_{j-1} V_{j-1}. Then O is rescaled by tile j's
alpha, and P_j goes into the next step. After step j, O holds sum_{i < j} P_i V_i in the scale of
m_j, the running row max (log2 units) after tile j.

K/V tiles come through TMA into a NUM_STAGES-deep ring of shared-memory buffers, one mbarrier per
buffer and tensor; the program's own warps issue the copies (no producer warp). A buffer is
refilled only after every warp's wgmma that read it has completed (wgmma wait, then a CTA
barrier).

Eligible (see `eligible`): CUDA sm_90, fp16/bf16, head dim 64 or 128 (q, k, v alike), self
attention (seqlen_q == seqlen_k, a multiple of the tile), full or causal, no softcap / ALiBi /
sink / bias / dropout / varlen, positive scale, q/k/v contiguous in the flash-attn layout (so
(batch * seqlen, heads * d) is a plain 2-D view for TMA). Same outputs as forward.py: out in
out's dtype, lse (batch, heads, seqlen) float32 natural log.
"""

from __future__ import annotations

import torch
import triton

from flashkit.ops.params import AttentionParams
from flashkit.ops.triton.common import LOG2E, interpreting
from flashkit.ops.triton.configs import GLUON_FORWARD

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


if gluon is not None:
    LN2 = gl.constexpr(0.6931471805599453)

    @gluon.jit
    def _issue_kv_load(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, tile, n_tiles, kv_row,
                       kv_col, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
        """TMA K and V tile `tile` into ring buffer tile % NUM_STAGES (skipped past n_tiles)."""
        stage = tile % NUM_STAGES
        valid = tile < n_tiles
        row = kv_row + tile * BLOCK_N
        mbarrier.expect(k_bars.index(stage), k_desc.block_type.nbytes, pred=valid)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_bars.index(stage),
                                        k_smem.index(stage), pred=valid)
        mbarrier.expect(v_bars.index(stage), v_desc.block_type.nbytes, pred=valid)
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_bars.index(stage),
                                        v_smem.index(stage), pred=valid)

    @gluon.jit
    def _softmax_step(qk, m_i, l_i, qk_scale, tile, start_m, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, MASK: gl.constexpr, s_layout: gl.constexpr):
        """Online softmax of raw scores qk [BLOCK_M, BLOCK_N]: the row max is taken on qk and
        scaled after (qk_scale > 0), so s * scale - m is one FMA per element. MASK applies the
        causal predicate key <= query (self attention: no shift)."""
        if MASK:
            rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            cols = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            keep = gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1)
            qk = gl.where(keep, qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
        p = gl.exp2(qk * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_new = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_new

    @gluon.jit
    def _pipelined_step(q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, acc, p_op, m_i,
                        l_i, qk_scale, tile, n_tiles, start_m, kv_row, kv_col,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        NUM_STAGES: gl.constexpr, MASK: gl.constexpr, s_layout: gl.constexpr,
                        o_layout: gl.constexpr, p_layout: gl.constexpr):
        """S_tile and P_{tile-1} V_{tile-1} in flight together, softmax of S_tile under the
        second; returns (acc rescaled to m_tile, P_tile as the next A operand, m, l)."""
        stage = tile % NUM_STAGES
        mbarrier.wait(k_bars.index(stage), (tile // NUM_STAGES) & 1)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
        prev = (tile - 1) % NUM_STAGES
        mbarrier.wait(v_bars.index(prev), ((tile - 1) // NUM_STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, qk_scale, tile, start_m, BLOCK_M,
                                           BLOCK_N, MASK, s_layout)
        p_next = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        # The softmax results pass through the wait so that the compiler cannot sink the softmax
        # below it (which would serialise it after the P V matmul again).
        acc, p_op, p_next, alpha, l_i = warpgroup_mma_wait(
            num_outstanding=0, deps=(o_tok, p_op, p_next, alpha, l_i))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        # Every warp's reads of buffer `prev` are done: refill it with tile prev + NUM_STAGES.
        gl.thread_barrier()
        _issue_kv_load(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, tile - 1 + NUM_STAGES,
                       n_tiles, kv_row, kv_col, BLOCK_N, NUM_STAGES)
        return acc, p_next, m_i, l_i

    @gluon.jit
    def _fwd_hopper_kernel(q_desc, k_desc, v_desc, Out, Lse,
                           stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                           nheads, group, seqlen, qk_scale,
                           HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                           num_warps: gl.constexpr):
        """One program per BLOCK_M query rows of one (batch, head), heaviest causal rows first.
        q_desc/k_desc/v_desc: TMA descriptors over (batch * seqlen, heads * HEAD_DIM)."""
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        pid_bh = gl.program_id(1)
        off_b = pid_bh // nheads
        off_h = pid_bh % nheads
        start_m = pid_m * BLOCK_M
        q_row = off_b * seqlen + start_m
        kv_row = off_b * seqlen
        kv_col = (off_h // group) * HEAD_DIM
        dtype: gl.constexpr = q_desc.dtype

        # Accumulators in the wgmma layout: warps stacked along the rows, 16 rows per warp.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
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
            n_unmasked = start_m // BLOCK_N  # tiles left of the diagonal block
        else:
            n_tiles = seqlen // BLOCK_N
            n_unmasked = n_tiles

        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, off_h * HEAD_DIM], q_bar, q_smem)
        for i in gl.static_range(NUM_STAGES):
            _issue_kv_load(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, i, n_tiles, kv_row,
                           kv_col, BLOCK_N, NUM_STAGES)

        # Tile 0 on its own: its scores, nothing to add to O yet (masked when causal: exact
        # for every tile, needed when tile 0 touches the diagonal).
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_bars.index(0), 0)
        s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)),
                              gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False,
                              is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, qk_scale, 0, start_m, BLOCK_M, BLOCK_N,
                                           CAUSAL, s_layout)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

        for tile in range(1, n_unmasked):
            acc, p_op, m_i, l_i = _pipelined_step(
                q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, acc, p_op, m_i, l_i,
                qk_scale, tile, n_tiles, start_m, kv_row, kv_col, BLOCK_M, BLOCK_N, NUM_STAGES,
                False, s_layout, o_layout, p_layout)
        if CAUSAL:
            for tile in range(gl.maximum(n_unmasked, 1), n_tiles):
                acc, p_op, m_i, l_i = _pipelined_step(
                    q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, acc, p_op, m_i, l_i,
                    qk_scale, tile, n_tiles, start_m, kv_row, kv_col, BLOCK_M, BLOCK_N,
                    NUM_STAGES, True, s_layout, o_layout, p_layout)

        last = (n_tiles - 1) % NUM_STAGES
        mbarrier.wait(v_bars.index(last), ((n_tiles - 1) // NUM_STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, ))

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))

        # Every row saw at least its own key (self attention), so l > 0.
        out = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
        rows_o = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = (Out + off_b.to(gl.int64) * stride_ob + off_h * stride_oh
                  + gl.expand_dims(rows_o, 1).to(gl.int64) * stride_os
                  + gl.expand_dims(cols_o, 0))
        gl.store(o_ptrs, out.to(Out.dtype.element_ty))
        lse = (m_i + gl.log2(l_i)) * LN2
        rows = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
        gl.store(Lse + off_b.to(gl.int64) * stride_lb + off_h * stride_lh + rows, lse)


def _flash_layout_2d(x: torch.Tensor) -> bool:
    """x (batch, seqlen, heads, d) is contiguous, so (batch * seqlen, heads * d) is a view."""
    return x.is_contiguous() and x.data_ptr() % 16 == 0


def eligible(q, k, v, params: AttentionParams, out, lse, tile) -> bool:
    """Whether the Gluon kernel computes this call (else forward.py's kernel does)."""
    if not GLUON_FORWARD or gluon is None or interpreting() or tile is not None:
        return False
    plain = (params.softcap == 0 and params.alibi_slopes is None and params.sink is None
             and params.attn_bias is None and params.dropout_p == 0 and not params.is_varlen
             and params.softmax_scale > 0 and params.window_left is None
             and params.window_right in (None, 0))
    if not (plain and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return False
    batch, seqlen_q, nheads, head_dim = q.shape  # dense: varlen was excluded above
    _, seqlen_k, nheads_k, head_dim_v = v.shape
    block = HOPPER_FORWARD.get(head_dim)
    return (block is not None and head_dim == head_dim_v == k.shape[-1]
            and q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype
            and seqlen_q == seqlen_k and seqlen_q % max(block[0], block[1]) == 0
            and all(_flash_layout_2d(x) for x in (q, k, v))
            and (out is None or out.stride(-1) == 1) and (lse is None or lse.stride(-1) == 1))


# (BLOCK_M, BLOCK_N, num_warps, NUM_STAGES) per head dim; see benchmarks/NOTES_triton.md.
# One warpgroup per program and two or more programs per SM beat one program of two
# warpgroups: the programs drift apart, so one's softmax runs under another's matmuls
# (03:38 and 03:47 sweeps at 4k, TFLOP/s full / causal: d128 (64,64,4,3) 519 / 472 vs
# (128,128,8,3) 506 / 455, (64,64,4,2) 452 / 404; d64 (64,128,4,2) 442 / 399 vs (64,128,4,3)
# 436 / 387, (128,128,8,3) 365 / 320).
HOPPER_FORWARD = {
    64: (64, 128, 4, 2),
    128: (64, 64, 4, 3),
}


def attention_forward(q, k, v, params: AttentionParams, out=None, lse=None, block=None):
    """(out, lse) of the eligible case; block overrides HOPPER_FORWARD (the sweep)."""
    batch, seqlen, nheads, head_dim = q.shape
    nheads_k = k.shape[2]
    if out is None:
        out_dtype = torch.float32 if params.fp32_out else q.dtype
        out = torch.empty((batch, seqlen, nheads, head_dim), dtype=out_dtype, device=q.device)
    if lse is None:
        lse = torch.empty((batch, nheads, seqlen), dtype=torch.float32, device=q.device)
    block_m, block_n, num_warps, num_stages = block or HOPPER_FORWARD[head_dim]
    gl_dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def descriptor(x, rows, heads):
        layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl_dtype)
        return TensorDescriptor(x.view(batch * seqlen, heads * head_dim),
                                [batch * seqlen, heads * head_dim], [heads * head_dim, 1],
                                [rows, head_dim], layout)

    grid = (triton.cdiv(seqlen, block_m), batch * nheads)
    _fwd_hopper_kernel[grid](
        descriptor(q, block_m, nheads), descriptor(k, block_n, nheads_k),
        descriptor(v, block_n, nheads_k), out, lse,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        nheads, nheads // nheads_k, seqlen, params.softmax_scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=num_stages,
        CAUSAL=params.window_right == 0, num_warps=num_warps)
    return out, lse
