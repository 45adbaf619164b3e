"""Hopper-only backward in Gluon (triton.experimental.gluon), FA3-style: a dK/dV kernel and a dQ
kernel; backward.py launches them, dQ first (it stores each row's delta for dK/dV), and reduces
dsink itself.

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
The dQ kernel here sums dQ in a fixed order (bitwise reproducible): one program per BLOCK_M query
rows, Q and dO resident, K/V tiles through a TMA ring, S = Q K^T and dP = dO V^T issued together
(P's exp2 under dP), dQ += dS K with dS from registers, lse and delta per row in registers (two
values per thread in this layout).

Features as compile-time flags through common.py's helpers, as backward.py's kernels use them:
HAS_LEFT / HAS_RIGHT (any window, causal included, bottom-right aligned for seqlen_q != seqlen_k)
pick the tile ranges (common.query_tile_ranges / key_tile_ranges) and mask the edge tiles with
common.visible; the score modifiers SCORES = (SOFTCAP, ALIBI) go through common.score_mod and
common.score_grad, their values loaded by common.load_score_mods; DROPOUT regenerates the
forward's keep-mask (dropout.py's Philox core, each call's decisions packed into one int32: the
dQ kernel drawing in its score layout as the forward does, each call once for both 64-key tiles
that use it, the dK/dV kernel drawing each call once per program and moving the packed bits
into the S^T layout) with
dV = (P o Z)^T dO, dP = Z o (dO V^T), Z = keep / (1 - p), as
backward.py; the tiles select the kept elements and leave out 1 / (1 - p), which each kernel
multiplies into its gradients once (delta enters as (1 - p) delta). A sink lives in lse; for
its gradient the dQ kernel also sums each row's rowsum(P * dP) (SINK), which backward.py
reduces to dsink. A row with no visible key (lse -inf)
only meets masked tiles, where its P (inf before the mask) becomes 0.

VARLEN (packed sequences, cu_seqlens): the grid covers the longest sequence; each program reads
its sequence's first rows and lengths (common.sequence) and returns past its end. TMA reads the
(total, heads * d) views on, so a tile that runs past the sequence's end holds the next
sequence's rows (or zeros past the tensor): the dK/dV kernel masks those query columns in the
sequence's last query tile (their P and dS are exactly 0), the dQ kernel those key columns in its
last key tile; key rows (dK/dV) and query rows (dQ) past the end only reach gradient rows that
are never stored. Lengths need no alignment: equal lengths of whole tiles run what dense runs,
but lse and delta reach the dK/dV kernel as copies in which every sequence starts on 16 bytes
(_aligned_lse_delta: a TMA box must start there; the dQ kernel loads them per row).
The keep-mask is indexed (sequence, head, i, j) with i, j within the sequence, as forward.py's.

Head dim 256 runs the dK/dV kernel with two warpgroups: dK and dV, [BLOCK_N, 256] fp32 each,
would not fit one warpgroup's registers, so each warpgroup holds half of their columns (and of
S^T's and dP^T's); P^T and dS^T, split by query columns, reach the dV and dK matmuls through
shared memory.

Eligible (see `eligible`): what the Gluon forward takes (forward_hopper.gluon_declines: sm_90,
fp16/bf16, head dim 64, 128 or 256, q/k/v (and dO) each read in place through its own 2-D view
for TMA: hopper_common.tma_layout, view_2d), dense with seqlen_q and seqlen_k
multiples of every tile, or varlen; a dense call at other lengths runs as varlen with equal
lengths (dense_as_varlen; contiguous dq, dk, dv), whose tails are
NaN-safe: nothing the TMA tiles read past a batch entry's end reaches its gradients. A user's
score_mod (through its derivative) and mask_mod (flashkit.variants) are applied where the
built-in terms are (hopper_common.user_scores, visible_with_mod), as backward.py's kernels
apply them, and the dQ kernel runs a score_mod's captured_grad rule for the captured tensors
that learn. A dense call's block mask, shared by the heads or one per head, replaces the tile
ranges by its listed tiles (hopper_common.block_listing: the dK/dV kernel walks a key block's
column of query blocks, head after head of its GQA group, the dQ kernel a query block's row of
key blocks); a mask over varlen's packed tokens runs as one sequence of them, the modifiers
given each pair's sequence and positions in it. Block masks with dropout, or over packed
tokens with a learned captured tensor, run backward.py's kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashkit.ops.params import AttentionParams
from flashkit.ops.triton.common import (
    LOG2E,
    SCORE_GRAD_FROM_TANH_JIT,
    captured_grad_args,
    cdiv,
    gradient_pairs,
    key_tile_ranges,
    load_score_mods,
    mod_indices,
    query_tile_ranges,
    score_grad,
    score_mod,
    sequence,
    user_captured_grad,
    variant_args,
)
from flashkit.ops.triton.configs import (
    GLUON_BACKWARD,
    GLUON_BACKWARD_ACROSS_HEADS_PER_SM,
    GLUON_BACKWARD_DKDV,
    GLUON_BACKWARD_DQ,
)
from flashkit.ops.triton.features import (
    GRADIENT_FLAGS,
    SEED,
    dropout_seed,
    feature_tensors,
    kernel_features,
    tiles_in_bounds,
)
from flashkit.ops.triton.forward_hopper import gluon_declines
from flashkit.ops.triton.hopper_common import (
    flash_descriptor,
    flash_layout_2d,
    modifier_tensors,
    rows_descriptor,
    tma_layout,
    view_geometry,
)
from flashkit.ops.triton.launch import Prepared, device_facts, fold, planned

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # a Triton without Gluon: the Triton kernels do everything
    gluon = None
if gluon is not None:  # the forward's K/V ring fill (hopper_common) serves the dQ kernel
    from flashkit.ops.triton.dropout_gluon import (
        keep_bits_t,
        keep_half_tiles,
        keep_tile,
        no_upper_words,
        unpack_keep_t,
    )
    from flashkit.ops.triton.hopper_common import (
        block_listing,
        bounds_flags,
        issue_kv_load,
        issue_kv_rows,
        kv_load_rows,
        listed_tile,
        tile_start,
        user_scores,
        view_origin,
        visible_with_mod,
        zero_tile_tail,
    )



@triton.jit
def _aligned_row(q_start, off_b):
    """Varlen: the first row of sequence off_b (packed row q_start) in the aligned lse / delta
    copies: q_start plus up to 3 per earlier sequence, rounded up to a multiple of 4, so every
    sequence's rows start on 16 bytes (a TMA box must: an unaligned lse box start was an illegal
    instruction on the H200). Sequence b + 1 starts at least len(b) later: no overlap."""
    return (q_start + 3 * off_b + 3) // 4 * 4


@triton.jit
def _align_rows_kernel(Lse, Delta, LseAligned, DeltaAligned, Cu_q, stride_h, stride_aligned_h,
                       batch, BLOCK: tl.constexpr):
    """Rows program_id(1) * BLOCK.. of sequence program_id(0)'s span in the aligned copies
    (nheads, aligned rows), head program_id(2): from its first aligned row (_aligned_row) to
    the next sequence's (for the last sequence, the copies' end, the aligned row of a
    sequence `batch` starting at total_q), lse and delta (nheads, total_q) over the
    sequence's rows and zeros in the gap after them. The spans tile the copies, so every
    element is written (a span is at most its length + 6 rows)."""
    off_b = tl.program_id(0)
    off_h = tl.program_id(2).to(tl.int64)
    q_start = tl.load(Cu_q + off_b)
    q_end = tl.load(Cu_q + off_b + 1)
    first = _aligned_row(q_start, off_b)
    span = _aligned_row(q_end, off_b + 1) - first
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = rows < q_end - q_start
    src = off_h * stride_h + q_start + rows
    dst = off_h * stride_aligned_h + first + rows
    written = rows < span
    tl.store(LseAligned + dst, tl.load(Lse + src, mask=inside, other=0.0), mask=written)
    tl.store(DeltaAligned + dst, tl.load(Delta + src, mask=inside, other=0.0), mask=written)


ALIGN_BLOCK = 128  # rows per program of _align_rows_kernel


def _aligned_lse_delta(lse, delta, params: AttentionParams, plan: dict | None = None):
    """Varlen lse and delta (nheads, total_q) as (nheads, rows) copies in which each sequence
    starts on a multiple of 4 rows (_aligned_row), the gaps zero: what the dK/dV kernel's TMA
    boxes read (a query column past a sequence's end then meets its neighbour's rows or zeros,
    never uninitialised memory, so 0 * (dP - delta) stays 0). One launch writes every element
    (no zero fill first); plan: the dispatch plan's prepared launches."""
    nheads, total_q = lse.shape
    batch = params.cu_seqlens_q.numel() - 1
    rows = (total_q + 3 * batch + 3) // 4 * 4  # _aligned_row(total_q, batch)
    aligned = torch.empty((2, nheads, rows), dtype=torch.float32, device=lse.device)
    prepared = planned(plan, "align", lambda: Prepared(
        _align_rows_kernel, (batch, cdiv(params.max_seqlen_q + 6, ALIGN_BLOCK), nheads),
        (lse.stride(0), rows, batch), dict(BLOCK=ALIGN_BLOCK)))
    prepared(lse, delta, aligned[0], aligned[1], params.cu_seqlens_q)
    return aligned[0], aligned[1]


if gluon is not None:
    LOG2E_G = gl.constexpr(LOG2E)
    LN2_G = gl.constexpr(1.0 / LOG2E)

    @gluon.jit
    def _program_tile(ACROSS_HEADS: gl.constexpr):
        """(tile, (batch, head) index) of this program in tile_order's grid: ACROSS_HEADS, the
        heads in grid x and the tile in y and z (launch.fold), else the other way round."""
        if ACROSS_HEADS:
            return gl.program_id(1) + gl.program_id(2) * gl.num_programs(1), gl.program_id(0)
        return gl.program_id(0), gl.program_id(1) + gl.program_id(2) * gl.num_programs(1)

    @gluon.jit
    def _tile_count(ACROSS_HEADS: gl.constexpr):
        """The tiles per (batch, head) of tile_order's grid."""
        if ACROSS_HEADS:
            return gl.num_programs(1) * gl.num_programs(2)
        return gl.num_programs(0)

    @gluon.jit
    def _head_lists(head_lists, g):
        """hopper_common.block_listing of group head g's row of a block mask per head:
        head_lists = (lists, the first group head's row, rows between heads, group size)."""
        lists, row0, stride_sh, group = head_lists
        return block_listing(lists, row0 + g * stride_sh)

    @gluon.jit
    def _head_job(head_lists, job, n_jobs):
        """(g, t): job `job` of a block mask per head is listed tile t of group head g, the
        heads' listed tiles numbered head after head (a job past n_jobs reads the last one's
        lists: in bounds, its loads are skipped)."""
        group = head_lists[3]
        job = gl.maximum(gl.minimum(job, n_jobs - 1), 0)
        g = job * 0
        t = job
        first = job * 0  # the jobs before head h
        for h in range(group):
            n_h = _head_lists(head_lists, h)[1]
            if (job >= first) & (job < first + n_h):
                g = h
                t = job - first
            first += n_h
        return g, t

    @gluon.jit
    def _job_tile(job, n_jobs, jobs_per_head, m_first, listing, head_lists,
                  BLOCK_M: gl.constexpr):
        """(group head, first query row) of job `job`: query tile m_first + job % jobs_per_head
        of group head job // jobs_per_head (jobs_per_head >= 1: a block no query sees has
        n_jobs 0), or under a block mask shared by the heads (listing:
        hopper_common.block_listing) that head's listed tile job % jobs_per_head, or under a
        block mask per head (head_lists: _head_lists) the tile _head_job gives."""
        if len(head_lists) > 0:
            g, t = _head_job(head_lists, job, n_jobs)
            start_m = listed_tile(_head_lists(head_lists, g)[0], t) * BLOCK_M
        else:
            g = job // jobs_per_head
            t = job % jobs_per_head
            if len(listing) > 0:
                start_m = listed_tile(listing, t) * BLOCK_M
            else:  # (not tile_start's lo + t * TILE: this is the plain kernel's machine code)
                start_m = (m_first + t) * BLOCK_M
        return g, start_m

    @gluon.jit
    def _issue_q_do_tile(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem,
                         delta_smem, q_bars, do_bars, job, n_jobs, tile, origins, lse_row,
                         lse_stride_h, NUM_STAGES: gl.constexpr):
        """TMA the Q and dO tiles of job `job` at tile = (group head, first query row)
        (_job_tile), with their lse and delta rows, into ring buffer job % NUM_STAGES, skipped
        past n_jobs; lse_row is the first group head's first lse row, lse_stride_h the rows
        between heads."""
        stage = job % NUM_STAGES
        valid = job < n_jobs
        g, start_m = tile
        q_row, q_col, q_geo, do_row, do_col, do_geo = origins
        row_1d = lse_row + g * lse_stride_h + start_m
        q_bar = q_bars.index(stage)
        mbarrier.expect(q_bar, q_desc.block_type.nbytes + lse_desc.block_type.nbytes, pred=valid)
        tma.async_copy_global_to_shared(q_desc, [q_row + g * q_geo[1] + start_m,
                                                 q_col + g * q_geo[2]], q_bar,
                                        q_smem.index(stage), pred=valid)
        tma.async_copy_global_to_shared(lse_desc, [row_1d], q_bar, lse_smem.index(stage),
                                        pred=valid)
        do_bar = do_bars.index(stage)
        mbarrier.expect(do_bar, do_desc.block_type.nbytes + delta_desc.block_type.nbytes,
                        pred=valid)
        tma.async_copy_global_to_shared(do_desc, [do_row + g * do_geo[1] + start_m,
                                                  do_col + g * do_geo[2]], do_bar,
                                        do_smem.index(stage), pred=valid)
        tma.async_copy_global_to_shared(delta_desc, [row_1d], do_bar, delta_smem.index(stage),
                                        pred=valid)

    @gluon.jit
    def _query_tile_step(dk, dv, job, m, smem, bars, descs, ring, geo, mods, drop, user,
                         HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         NUM_STAGES: gl.constexpr, MASK: gl.constexpr, HAS_LEFT: gl.constexpr,
                         HAS_RIGHT: gl.constexpr, SCORES: gl.constexpr,
                         DROPOUT: gl.constexpr, VARLEN: gl.constexpr,
                         ONE_KEY_ZERO: gl.constexpr, SCORE_MOD: gl.constexpr,
                         SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr,
                         st_layout: gl.constexpr, kv_layout: gl.constexpr,
                         op_layout: gl.constexpr):
        """Add query tile m (ring job `job`) to dK, dV; MASK applies the band predicate
        (common.visible), with VARLEN also to the query rows: those past seqlen_q are the next
        sequence's (TMA reads on), their P and dS columns must be exactly 0 (key rows past
        seqlen_k need no mask: they only reach dK/dV rows that are never stored). Since 0 *
        NaN/inf is NaN, the tile that crosses the end also zeroes its Q and dO rows past it in
        shared memory (hopper_common.zero_tile_tail: they feed dK += dS^T Q and dV += P^T dO), so
        rows of a neighbour holding NaN/inf weigh exactly 0. A masked tile's dS^T is selected on
        the pairs common.gradient_pairs gives: a value V_j the query cannot see makes dP^T = V
        dO^T NaN in its whole row j (as does a neighbour's delta past seqlen_q), which P = 0
        would not stop (0 * NaN), and with ONE_KEY_ZERO rows that see one key get exactly zero
        dS. geo = (seqlen_q, seqlen_k, window_left, window_right, dropout_scale); mods are this
        query head's score modifiers (common.load_score_mods, SCORES); drop = (seed_lo,
        seed_hi, threshold, batch, query head) of the keep-mask (DROPOUT: dV = (P o Z)^T dO, dP =
        Z o (dO V^T) with Z = keep / (1 - p), dS = P o (dP - delta) with the pre-dropout P; the
        tile computes dS and P o Z over 1 / (1 - p), a select per element instead of a select and
        a multiply, and the kernel scales dK and dV once). smem = (k, v, q ring, dO ring, lse
        ring, delta ring), bars = (q, dO) ring barriers, descs = (q, dO, lse, delta) descriptors,
        ring = (n_jobs, jobs_per_head, m_first, listing, head_lists, origins, lse_row,
        lse_stride_h, start_n) as _job_tile and _issue_q_do_tile take them (start_n: the key
        block's first key). user = (batch, query head, score_args, mask_args, packing,
        in_bounds) of a user's modifiers (hopper_common.user_scores).
        Returns (dk, dv)."""
        seqlen_q, seqlen_k, window_left, window_right, dropout_scale = geo
        k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem = smem
        q_bars, do_bars = bars
        q_desc, do_desc, lse_desc, delta_desc = descs
        (n_jobs, jobs_per_head, m_first, listing, head_lists, origins, lse_row, lse_stride_h,
         start_n) = ring
        stage = job % NUM_STAGES
        phase = (job // NUM_STAGES) & 1
        start_m = m * BLOCK_M
        # Which tile the refill at the end loads, found first: under a block mask a list
        # lookup (a global load) that would otherwise stall the warps between the last wgmma
        # and the refill; here its latency passes under this tile's matmuls.
        refill = _job_tile(job + NUM_STAGES, n_jobs, jobs_per_head, m_first, listing,
                           head_lists, BLOCK_M)
        dtype: gl.constexpr = q_smem.dtype
        zero_st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
        q_buf = q_smem.index(stage)
        do_buf = do_smem.index(stage)
        col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
        ST_REGS: gl.constexpr = BLOCK_N * BLOCK_M // (32 * gl.num_warps())  # S^T's, per thread

        mbarrier.wait(q_bars.index(stage), phase)
        if MASK and VARLEN:  # the tile that crosses the sequence's end: its Q rows past it
            zero_tile_tail(q_buf, seqlen_q - start_m, BLOCK_M, HEAD_DIM, 0, 1)
        # [BLOCK_N, BLOCK_M] = [BLOCK_N, D] @ [D, BLOCK_M]
        s_tok = warpgroup_mma(k_smem, q_buf.permute((1, 0)), zero_st, use_acc=False,
                              is_async=True)
        mbarrier.wait(do_bars.index(stage), phase)
        if MASK and VARLEN:  # and its dO rows
            zero_tile_tail(do_buf, seqlen_q - start_m, BLOCK_M, HEAD_DIM, 0, 1)
        # [BLOCK_N, BLOCK_M] = [BLOCK_N, D] @ [D, BLOCK_M]
        dp_tok = warpgroup_mma(v_smem, do_buf.permute((1, 0)), zero_st, use_acc=False,
                               is_async=True)
        if DROPOUT:  # drawn while the tensor cores work on S^T and dP^T
            bits_t = keep_bits_t(drop, start_m, start_n, BLOCK_M, BLOCK_N, gl.num_warps())
        s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        # lse and delta are read from shared memory at their use: as per-column vectors of the
        # wgmma layout they would hold 2 * BLOCK_M / 4 registers across the matmuls.
        lse2 = lse_smem.index(stage).load(col_layout) * LOG2E_G
        # query i along the columns, key j along the rows: [1, BLOCK_M] and [BLOCK_N, 1]
        i_t = gl.expand_dims(start_m + gl.arange(0, BLOCK_M, layout=col_layout), 0)
        j_t = gl.expand_dims(start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout)),
                             1)
        s_t, dcap_t = score_mod(s_t, i_t, j_t, (seqlen_q, seqlen_k, window_left, window_right),
                                mods, SCORES, SCORE_GRAD_FROM_TANH_JIT)
        units = 1.0
        if SCORE_MOD is not None:  # natural units for the modifier; log2(e) joins exp2's FMA
            s_t = s_t * LN2_G
            units = LOG2E_G
        s_t, dmod_t = user_scores(s_t, i_t, j_t, seqlen_q, seqlen_k, user, SCORE_MOD,
                                  SCORE_GRAD, True)
        # A row with no visible key has lse -inf: its P is inf before the mask, 0 after (such a
        # row only meets masked tiles).
        p_t = gl.exp2(s_t * units - gl.expand_dims(lse2, 0))
        if MASK:
            keep = visible_with_mod(i_t, j_t, seqlen_q, seqlen_k, window_left, window_right,
                                    user, HAS_LEFT, HAS_RIGHT, MASK_MOD)
            if VARLEN:
                keep = keep & (i_t < seqlen_q)
            p_t = gl.where(keep, p_t, 0.0)
        dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
        delta = delta_smem.index(stage).load(col_layout)
        if DROPOUT:  # dS / (1 / (1 - p)) = P o (keep o dP - (1 - p) delta): see the kernel
            kept_t = unpack_keep_t(bits_t, start_n, BLOCK_M, BLOCK_N, st_layout, gl.num_warps())
            delta = delta * (1.0 / dropout_scale)
            if ST_REGS <= 32:
                # = (keep o P) o dP - P o (1 - p) delta: one select per element, keep o P, which
                # dV / (1 / (1 - p)) takes too (offline sm_90, d128 dK/dV: 844 -> 721
                # instructions per tile; selecting P after its bf16 rounding cost byte
                # permutes). It holds P and keep o P at once: d64's S^T tiles of 64 registers
                # per thread spill.
                p_kept_t = gl.where(kept_t, p_t, 0.0)
                ds_t = p_kept_t * dp_t - p_t * gl.expand_dims(delta, 0)
                p_t = p_kept_t
            else:
                ds_t = p_t * (gl.where(kept_t, dp_t, 0.0) - gl.expand_dims(delta, 0))
        else:
            ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
        if MASK:  # see the docstring (common.gradient_pairs)
            ds_t = gl.where(gradient_pairs(keep, i_t, seqlen_q, seqlen_k, window_left,
                                           window_right, HAS_LEFT, HAS_RIGHT, ONE_KEY_ZERO),
                            ds_t, 0.0)
        if SCORE_MOD is not None:
            ds_t = ds_t * dmod_t
        ds_t = score_grad(ds_t, dcap_t, SCORES)
        ds_t = ds_t.to(dtype)
        if DROPOUT and ST_REGS > 32:  # dV / (1 / (1 - p)) takes the dropped P
            p_t = gl.where(kept_t, p_t, 0.0)
        # dV and dK only after dS: their register operands then replace P, dP and delta instead
        # of living beside them (d128: dK + dV alone take 128 of the 255 registers).
        # [BLOCK_N, D] += [BLOCK_N, BLOCK_M] @ [BLOCK_M, D]
        dv_tok = warpgroup_mma(gl.convert_layout(p_t.to(dtype), op_layout), do_buf, dv,
                               is_async=True)
        # [BLOCK_N, D] += [BLOCK_N, BLOCK_M] @ [BLOCK_M, D]
        dk_tok = warpgroup_mma(gl.convert_layout(ds_t, op_layout), q_buf, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok))
        # Every warp's reads of this buffer are done: refill it.
        gl.thread_barrier()
        _issue_q_do_tile(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem,
                         delta_smem, q_bars, do_bars, job + NUM_STAGES, n_jobs, refill, origins,
                         lse_row, lse_stride_h, NUM_STAGES)
        return dk, dv

    @gluon.jit(do_not_specialize=["seed_lo", "seed_hi", "dropout_threshold"])
    def _bwd_dkdv_hopper_kernel(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DK, DV,
                                stride_dkb, stride_dks, stride_dkh,
                                stride_dvb, stride_dvs, stride_dvh,
                                ScoreTensors, nheads, nheads_k, seqlen_q, seqlen_k,
                                window_left, window_right, score_values, softmax_scale, seed_lo,
                                seed_hi, dropout_threshold, dropout_scale, stride_lh, q_geo,
                                kv_geo, do_geo, Cu_q, Cu_k, score_args, mask_args, packing,
                                blocks, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                                BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                                HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                                SCORES: gl.constexpr, DROPOUT: gl.constexpr,
                                VARLEN: gl.constexpr,
                                ONE_KEY_ZERO: gl.constexpr, SCORE_MOD: gl.constexpr,
                                SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr,
                                QUERIES_IN: gl.constexpr, KEYS_IN: gl.constexpr,
                                HEAD_LISTS: gl.constexpr, ACROSS_HEADS: gl.constexpr,
                                num_warps: gl.constexpr):
        """dK, dV of one key block of one (batch, kv head) (_program_tile: tile_order's grid),
        heaviest causal blocks first. q/k/v/do descriptors over (batch * seqlen, heads *
        HEAD_DIM), lse/delta descriptors over their flat (batch * nheads * seqlen) rows (varlen:
        the aligned copies of _aligned_lse_delta), stride_lh rows per head. VARLEN: batch entry =
        sequence (common.sequence: first rows from Cu_q/Cu_k, its own lengths; seqlen_q/k arrive
        as the longest), descriptors over (total, heads * HEAD_DIM), lse/delta (nheads, total_q);
        blocks past the sequence's end return. SCORE_MOD (with its derivative SCORE_GRAD) and
        MASK_MOD: a user's modifiers, their captured values in score_args / mask_args; a MASK_MOD
        masks every query tile; packing as the forward kernel's. blocks: a block mask, (lists,
        stride_b, stride_h, keys per block) with its transposed lists as
        hopper_common.block_listing takes them (else ()): the block's query tiles are then its
        mask column's listed ones, the partial blocks' masked, the full blocks' not; HEAD_LISTS:
        a column per query head (else the heads share one, stride_h unused), walked head after
        head (_head_job)."""
        pid_n, pid_bh = _program_tile(ACROSS_HEADS)
        off_b = pid_bh // nheads_k
        off_hk = pid_bh % nheads_k
        group = nheads // nheads_k
        start_n = pid_n * BLOCK_N
        q_start, k_start, seqlen_q, seqlen_k = sequence(off_b, seqlen_q, seqlen_k, Cu_q, Cu_k,
                                                        VARLEN)
        if VARLEN:
            if start_n >= seqlen_k:
                return
            lse_row = off_hk * group * stride_lh + _aligned_row(q_start.to(gl.int32), off_b)
        else:
            lse_row = (off_b * nheads + off_hk * group) * seqlen_q
        # the group's first query head in the 2-D views of Q and dO (head g of the group
        # g * rows_h rows and g * cols_h columns on), and this key block's K/V rows
        q_row, q_col = view_origin(q_geo, off_b, off_hk * group, q_start, VARLEN)
        do_row, do_col = view_origin(do_geo, off_b, off_hk * group, q_start, VARLEN)
        origins = (q_row, q_col, q_geo, do_row, do_col, do_geo)
        kv_row, kv_col = view_origin(kv_geo, off_b, off_hk, k_start, VARLEN)
        kv_row += start_n
        geo = (seqlen_q, seqlen_k, window_left, window_right, dropout_scale)
        dtype: gl.constexpr = q_desc.dtype

        # wgmma accumulators: one warpgroup's warps stacked along the key rows (BLOCK_N = 16 *
        # 4); a second warpgroup (head dim 256) takes the right half of every tile's columns, so
        # dK + dV hold 128 registers per thread at head dim 128 and 256 alike, and P^T and dS^T
        # (split by query columns) reach the dV and dK matmuls through shared memory.
        WARPS_M: gl.constexpr = BLOCK_N // 16
        WARPS_N: gl.constexpr = num_warps // WARPS_M
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N],
            instr_shape=[16, BLOCK_M // WARPS_N, 16])
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N],
            instr_shape=[16, HEAD_DIM // WARPS_N, 16])
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
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        do_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1],
                                            mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(q_bars.index(i), count=1)
            mbarrier.init(do_bars.index(i), count=1)

        # Query tiles [m_first, m_end) see this key block (common.query_tile_ranges); those in
        # [m_mid_lo, m_mid_hi) see all of it, those before (HAS_RIGHT) and after (HAS_LEFT) are
        # masked. Every bound is a multiple of BLOCK_M or the last (hi).
        lo, mid_lo, mid_hi, hi = query_tile_ranges(start_n, seqlen_q, seqlen_k, window_left,
                                                   window_right, BLOCK_M, BLOCK_N, HAS_LEFT,
                                                   HAS_RIGHT)
        m_first = lo // BLOCK_M
        m_mid_lo = gl.cdiv(mid_lo, BLOCK_M)
        m_mid_hi = gl.cdiv(mid_hi, BLOCK_M)
        m_end = gl.cdiv(hi, BLOCK_M)
        n_jobs = group * (m_end - m_first)
        listing = ()
        head_lists = ()
        # (named before any loop: inside and after one, Triton 3.6 reads a constexpr member
        # of `blocks`, a tile count of 1, as None)
        SPARSE: gl.constexpr = len(blocks) > 0
        if SPARSE:  # a block mask: the listed query tiles of this key block's column
            lists, stride_sb, stride_sh, block_kv = blocks
            row = off_b * stride_sb + start_n // block_kv
            m_first = 0
            if HEAD_LISTS:  # a column per query head: the jobs are the heads' listed tiles
                head_lists = (lists, row + off_hk * group * stride_sh, stride_sh, group)
                n_jobs = group * 0
                for g in range(group):
                    n_jobs += _head_lists(head_lists, g)[1]
                m_end = n_jobs  # (jobs_per_head is unused)
            else:
                listing, tiles = block_listing(lists, row)
                m_end = tiles
                n_jobs = group * tiles
        jobs_per_head = gl.maximum(m_end - m_first, 1)

        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row, kv_col], kv_bar, k_smem)
        tma.async_copy_global_to_shared(v_desc, [kv_row, kv_col], kv_bar, v_smem)
        for i in gl.static_range(NUM_STAGES):
            _issue_q_do_tile(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem,
                             delta_smem, q_bars, do_bars, i, n_jobs,
                             _job_tile(i, n_jobs, jobs_per_head, m_first, listing, head_lists,
                                       BLOCK_M),
                             origins, lse_row, stride_lh, NUM_STAGES)
        mbarrier.wait(kv_bar, 0)

        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        smem = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem)
        bars = (q_bars, do_bars)
        descs = (q_desc, do_desc, lse_desc, delta_desc)
        ring = (n_jobs, jobs_per_head, m_first, listing, head_lists, origins, lse_row,
                stride_lh, start_n)
        job = 0
        for g in range(group):  # the query heads that share this kv head, in a fixed order
            off_h = off_hk * group + g
            mods = load_score_mods(ScoreTensors, score_values, off_b, off_h, SCORES)
            drop = (seed_lo, seed_hi, dropout_threshold, off_b, off_h)
            user = (off_b, off_h, score_args, mask_args, packing,
                    bounds_flags(QUERIES_IN, KEYS_IN))
            # Masked rows that see part of the block on its right side (HAS_RIGHT), the rows
            # that see all of it, masked rows of the window's left edge and varlen's last
            # query tile (HAS_LEFT); a masked segment is compiled only where it can exist.
            if SPARSE:  # the partial blocks' tiles (masked), then the full blocks'
                if HEAD_LISTS:
                    head_listing, head_tiles = _head_lists(head_lists, g)
                else:
                    head_listing, head_tiles = listing, m_end
                listed = (0, head_listing[1], head_tiles)
                for full in gl.static_range(2):
                    for t in range(listed[full], listed[full + 1]):
                        dk, dv = _query_tile_step(
                            dk, dv, job, listed_tile(head_listing, t), smem, bars, descs, ring,
                            geo,
                            mods, drop, user, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                            full == 0, HAS_LEFT, HAS_RIGHT, SCORES, DROPOUT, VARLEN,
                            ONE_KEY_ZERO, SCORE_MOD, SCORE_GRAD, MASK_MOD, st_layout,
                            kv_layout, op_layout)
                        job += 1
            else:
                bounds = (m_first, m_mid_lo, m_mid_hi, m_end)
                for segment in gl.static_range(3):
                    if (segment == 1 or (segment == 0 and (HAS_RIGHT or VARLEN))
                            or (segment == 2 and (HAS_LEFT or VARLEN))):
                        for m in range(bounds[segment], bounds[segment + 1]):
                            dk, dv = _query_tile_step(
                                dk, dv, job, m, smem, bars, descs, ring, geo, mods, drop,
                                user, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES,
                                segment != 1 or MASK_MOD is not None, HAS_LEFT, HAS_RIGHT,
                                SCORES, DROPOUT, VARLEN, ONE_KEY_ZERO, SCORE_MOD,
                                SCORE_GRAD, MASK_MOD, st_layout, kv_layout, op_layout)
                            job += 1

        mbarrier.invalidate(kv_bar)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(q_bars.index(i))
            mbarrier.invalidate(do_bars.index(i))

        rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
        rows_2d = gl.expand_dims(rows, 1).to(gl.int64) + k_start
        store_mask = None
        if VARLEN:  # rows past the sequence's end belong to the next one
            store_mask = gl.expand_dims(rows < seqlen_k, 1) & gl.expand_dims(cols < HEAD_DIM, 0)
        dk_ptrs = (DK + off_b.to(gl.int64) * stride_dkb + off_hk * stride_dkh
                   + rows_2d * stride_dks + gl.expand_dims(cols, 0))
        if DROPOUT:  # the tiles left out the keep scale 1 / (1 - p): one multiply here
            dk = dk * dropout_scale
            dv = dv * dropout_scale
        gl.store(dk_ptrs, (dk * softmax_scale).to(DK.dtype.element_ty), mask=store_mask)
        dv_ptrs = (DV + off_b.to(gl.int64) * stride_dvb + off_hk * stride_dvh
                   + rows_2d * stride_dvs + gl.expand_dims(cols, 0))
        gl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=store_mask)


    @gluon.jit
    def _key_tile_dq_step(dq, upper, pdp, tile, smem, bars, descs, lse2, delta, ring, geo,
                          mods, drop, user, grad_args, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, MASK: gl.constexpr,
                          HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, SCORES: gl.constexpr,
                          DROPOUT: gl.constexpr, VARLEN: gl.constexpr,
                          ONE_KEY_ZERO: gl.constexpr, SINK: gl.constexpr,
                          SCORE_MOD: gl.constexpr, SCORE_GRAD: gl.constexpr,
                          MASK_MOD: gl.constexpr, CAPTURED_GRAD: gl.constexpr,
                          s_layout: gl.constexpr, op_layout: gl.constexpr):
        """Add key tile `tile` (keys key_lo + tile * BLOCK_N ..., at row key0 + tile * BLOCK_N
        of the 2-D view) to dQ (unscaled); MASK applies the band predicate. geo, mods,
        drop and user as in _query_tile_step; the keep-mask is the forward's own (keep_tile,
        drawn in this same score layout; 64-key tiles through keep_half_tiles, upper its words
        carried from tile to tile); with DROPOUT, delta comes as (1 - p) delta and dQ is left over
        1 / (1 - p). SINK adds the tile's rowsum(P * dP) to pdp (with DROPOUT, (1 - p) times
        it). Returns (dq, upper, pdp). VARLEN: the (last) tile that crosses the sequence's
        keys zeroes the next sequence's K and V rows it holds before the wgmmas read them (0 *
        NaN/inf in dS K or in dP = dO V^T would be NaN; their P is masked to 0). A masked tile's
        dS is selected on common.gradient_pairs: a value V_j a row cannot see makes column j of
        dP NaN for every row, which P = 0 would not stop, and with ONE_KEY_ZERO rows that see one
        key get exactly zero dS. smem = (q, dO,
        K ring, V ring), bars = (K, V) ring barriers, descs = (K, V) descriptors, ring =
        (n_tiles, key0, kv_col, start_m, key_lo, listing): under a block mask (listing:
        hopper_common.block_listing) tile t is the listed one, key0 the sequence's first key.
        CAPTURED_GRAD: the score_mod's rule for its captured tensors' gradients
        (common.user_captured_grad), given this tile's dL / d score_mod(score), zero outside the
        sequence's rows and the visible pairs, and adding into grad_args' buffers."""
        seqlen_q, seqlen_k, window_left, window_right, dropout_scale = geo
        q_smem, do_smem, k_smem, v_smem = smem
        k_bars, v_bars = bars
        k_desc, v_desc = descs
        n_tiles, key0, kv_col, start_m, key_lo, listing = ring
        stage = tile % NUM_STAGES
        phase = (tile // NUM_STAGES) & 1
        k_buf = k_smem.index(stage)
        v_buf = v_smem.index(stage)
        start_n = tile_start(listing, key_lo, tile, BLOCK_N)
        # Where the refill at the end reads from, found first: under a block mask a list
        # lookup (a global load) that would otherwise stall the warps between the last wgmma
        # and the refill; here its latency passes under this tile's matmuls.
        refill_rows = kv_load_rows(k_desc, tile + NUM_STAGES, n_tiles, key0, listing, BLOCK_N)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        mbarrier.wait(k_bars.index(stage), phase)
        if MASK and VARLEN:  # never refilled: the crossing tile is the program's last
            zero_tile_tail(k_buf, seqlen_k - start_n, BLOCK_N, k_buf.shape[1], 0, 1)
        # [BLOCK_M, BLOCK_N] = [BLOCK_M, D] @ [D, BLOCK_N]
        s_tok = warpgroup_mma(q_smem, k_buf.permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
        mbarrier.wait(v_bars.index(stage), phase)
        if MASK and VARLEN:
            zero_tile_tail(v_buf, seqlen_k - start_n, BLOCK_N, v_buf.shape[1], 0, 1)
        # [BLOCK_M, BLOCK_N] = [BLOCK_M, D] @ [D, BLOCK_N]
        dp_tok = warpgroup_mma(do_smem, v_buf.permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
        if DROPOUT:  # drawn while the tensor cores work on S and dP
            if BLOCK_N == 64:
                kept, upper = keep_half_tiles(drop, start_m, start_n, upper, tile == 0, s_layout)
            else:
                kept = keep_tile(drop, start_m, start_n, BLOCK_N, s_layout)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
        i = gl.expand_dims(start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)), 1)
        j = gl.expand_dims(start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
        s, dcap = score_mod(s, i, j, (seqlen_q, seqlen_k, window_left, window_right), mods,
                            SCORES, SCORE_GRAD_FROM_TANH_JIT)
        units = 1.0
        if SCORE_MOD is not None:  # natural units for the modifier; log2(e) joins exp2's FMA
            s = s * LN2_G
            units = LOG2E_G
        s_in = s  # the score before the user's score_mod, for CAPTURED_GRAD
        s, dmod = user_scores(s, i, j, seqlen_q, seqlen_k, user, SCORE_MOD, SCORE_GRAD, True)
        p = gl.exp2(s * units - gl.expand_dims(lse2, 1))  # lse -inf (no visible key): masked
        if MASK:
            keep = visible_with_mod(i, j, seqlen_q, seqlen_k, window_left, window_right, user,
                                    HAS_LEFT, HAS_RIGHT, MASK_MOD)
            p = gl.where(keep, p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
        if DROPOUT:  # dS / (1 / (1 - p)) = P o (keep o dP - (1 - p) delta): see the kernel
            dp = gl.where(kept, dp, 0.0)
        if SINK:
            pdp_tile = p * dp
            if MASK:  # a value the row cannot see may make its dP NaN
                pdp_tile = gl.where(keep, pdp_tile, 0.0)
            pdp += gl.sum(pdp_tile, axis=1)
        ds = p * (dp - gl.expand_dims(delta, 1))
        if MASK:  # see the docstring (common.gradient_pairs)
            ds = gl.where(gradient_pairs(keep, i, seqlen_q, seqlen_k, window_left, window_right,
                                         HAS_LEFT, HAS_RIGHT, ONE_KEY_ZERO), ds, 0.0)
        if CAPTURED_GRAD is not None:  # ds is dL / d score_mod(score) here
            ds_mod = ds
            if VARLEN:  # rows past the sequence's end belong to no pair
                ds_mod = gl.where(i < seqlen_q, ds_mod, 0.0)
            if DROPOUT:  # the tile's dS lacks the keep scale (see the kernel)
                ds_mod = ds_mod * dropout_scale
            # The rule runs on a blocked layout: a sum over the rows of the wgmma accumulator's
            # layout holds each column twice in a thread's registers, and an atomic add of it
            # added it twice (H200: a per-key bias's gradient came out doubled).
            rule: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])
            off_b, off_h, score_args, _, packing, in_bounds = user
            # the indices the modifier saw: with packing, each pair's sequence and positions in
            # it (pairs of two sequences have ds 0: their P is masked)
            mod_b, mod_lq, mod_lk = off_b, seqlen_q, seqlen_k
            mod_i, mod_j = gl.convert_layout(i, rule), gl.convert_layout(j, rule)
            if len(packing) > 0:
                mod_b, mod_i, mod_j, mod_lq, mod_lk, _ = mod_indices(
                    off_b, mod_i, mod_j, seqlen_q, seqlen_k, packing, True)
            user_captured_grad(gl.convert_layout(ds_mod, rule), gl.convert_layout(s_in, rule),
                               mod_b, off_h, mod_i, mod_j, mod_lq, mod_lk, CAPTURED_GRAD,
                               score_args, grad_args, True, len(in_bounds[0]) > 0,
                               len(in_bounds[1]) > 0)
        if SCORE_MOD is not None:
            ds = ds * dmod
        ds = score_grad(ds, dcap, SCORES)
        ds = ds.to(q_smem.dtype)
        # [BLOCK_M, D] += [BLOCK_M, BLOCK_N] @ [BLOCK_N, D]
        dq_tok = warpgroup_mma(gl.convert_layout(ds, op_layout), k_buf, dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, ))
        gl.thread_barrier()  # every warp's reads of this buffer are done: refill it
        issue_kv_rows(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, tile + NUM_STAGES,
                      n_tiles, refill_rows, kv_col, NUM_STAGES)
        return dq, upper, pdp

    @gluon.jit
    def _row_delta(o_ptr, do_ptr, stride_os, stride_od, stride_dos, n_rows,
                   BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, MASK: gl.constexpr,
                   row_layout: gl.constexpr, num_warps: gl.constexpr):
        """rowsum(dO * O) of the BLOCK_M rows of O and dO at o_ptr and do_ptr (their first
        row; dO's column stride 1, as declines checks), in row_layout; MASK: rows at or past
        n_rows read 0. 64 columns at a time ([BLOCK_M, 64] of each in registers, 16-byte
        loads), so head dim 256 adds no register pressure beyond head dim 64's."""
        CHUNK: gl.constexpr = 64
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        rows = gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout)), 1)
        cols = gl.expand_dims(gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout)), 0)
        o_ptrs = o_ptr + rows.to(gl.int64) * stride_os + cols * stride_od
        do_ptrs = do_ptr + rows.to(gl.int64) * stride_dos + cols
        if MASK:  # the row test, broadcast to the [BLOCK_M, CHUNK] tile
            in_rows = (rows < n_rows) & (cols < CHUNK)
        total = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, layout))
        for c in gl.static_range(HEAD_DIM // CHUNK):
            if MASK:
                o = gl.load(o_ptrs + c * CHUNK * stride_od, mask=in_rows, other=0.0)
                do = gl.load(do_ptrs + c * CHUNK, mask=in_rows, other=0.0)
            else:
                o = gl.load(o_ptrs + c * CHUNK * stride_od)
                do = gl.load(do_ptrs + c * CHUNK)
            total += gl.sum(o.to(gl.float32) * do.to(gl.float32), axis=1)
        return gl.convert_layout(total, row_layout)

    @gluon.jit(do_not_specialize=["seed_lo", "seed_hi", "dropout_threshold"])
    def _bwd_dq_hopper_kernel(q_desc, k_desc, v_desc, do_desc, Out, DO, Lse, Delta, Dlse, DQ,
                              ScoreTensors, stride_ob, stride_os, stride_oh, stride_od,
                              stride_dob, stride_dos, stride_doh, stride_lb, stride_lh,
                              stride_deltab, stride_deltah, stride_dqb, stride_dqs, stride_dqh,
                              nheads, group, seqlen_q, seqlen_k, window_left, window_right,
                              score_values, softmax_scale, seed_lo, seed_hi,
                              dropout_threshold, dropout_scale, q_geo, kv_geo, do_geo, Cu_q,
                              Cu_k, score_args,
                              mask_args, packing, blocks, grad_args, HEAD_DIM: gl.constexpr,
                              BLOCK_M: gl.constexpr,
                              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                              HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                              SCORES: gl.constexpr, DROPOUT: gl.constexpr,
                              VARLEN: gl.constexpr,
                              ONE_KEY_ZERO: gl.constexpr, SINK: gl.constexpr,
                              LSE_GRAD: gl.constexpr, SCORE_MOD: gl.constexpr,
                              SCORE_GRAD: gl.constexpr, MASK_MOD: gl.constexpr,
                              QUERIES_IN: gl.constexpr, KEYS_IN: gl.constexpr,
                              CAPTURED_GRAD: gl.constexpr, ACROSS_HEADS: gl.constexpr,
                              num_warps: gl.constexpr):
        """dQ of BLOCK_M query rows of one (batch, head), heaviest causal rows first: Q and dO
        stay in shared memory, K/V tiles stream through a TMA ring (as the forward), each dQ
        element summed in one program in a fixed order (deterministic). VARLEN as the dK/dV
        kernel; key columns past the sequence's end (the next one's, read by TMA) are masked in
        the last key tile, query rows past it are never stored. Each program first computes
        its rows' delta = rowsum(dO * O) - dlse (LSE_GRAD: Dlse, laid out like Delta; O and dO
        read from global memory, 64 columns at a time) and stores it in Delta, which the dK/dV
        kernel launched after it reads. SINK: what it stores is rowsum(P * dP) - dlse from the
        float32 tiles instead, which dsink reads too (backward.py). A user's modifiers as in the
        dK/dV kernel (a MASK_MOD masks every key tile); blocks: a block mask, (lists, stride_b,
        stride_h, query rows per block) (else ()): the rows' key tiles are then their mask
        row's listed ones. CAPTURED_GRAD: a score_mod's captured_grad rule, run on every tile
        pair (this kernel visits each once, rows queries) into grad_args' float32 buffers."""
        # the query tiles counted down: the last, which sees the most causal keys, first
        tile, pid_bh = _program_tile(ACROSS_HEADS)
        pid_m = _tile_count(ACROSS_HEADS) - 1 - tile
        off_b = pid_bh // nheads
        off_h = pid_bh % nheads
        start_m = pid_m * BLOCK_M
        q_start, k_start, seqlen_q, seqlen_k = sequence(off_b, seqlen_q, seqlen_k, Cu_q, Cu_k,
                                                        VARLEN)
        if VARLEN:
            if start_m >= seqlen_q:
                return
        # this head's rows in the 2-D views of Q, dO and K/V
        q_row, q_col = view_origin(q_geo, off_b, off_h, q_start, VARLEN)
        do_row, do_col = view_origin(do_geo, off_b, off_h, q_start, VARLEN)
        key_row0, kv_col = view_origin(kv_geo, off_b, off_h // group, k_start, VARLEN)
        geo = (seqlen_q, seqlen_k, window_left, window_right, dropout_scale)
        drop = (seed_lo, seed_hi, dropout_threshold, off_b, off_h)
        user = (off_b, off_h, score_args, mask_args, packing, bounds_flags(QUERIES_IN, KEYS_IN))
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(not DROPOUT or (BLOCK_M == 64 and num_warps == 4),
                         "keep_tile draws for the forward's 64-row, one-warpgroup tile")

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

        # Key tiles [lo, hi) seen by these rows (common.key_tile_ranges), counted from lo: those
        # in [t_mid_lo, t_mid_hi) fully visible, those before (HAS_LEFT) and after (HAS_RIGHT)
        # masked.
        lo, mid_lo, mid_hi, hi = key_tile_ranges(start_m, seqlen_q, seqlen_k, window_left,
                                                 window_right, BLOCK_M, BLOCK_N, HAS_LEFT,
                                                 HAS_RIGHT)
        n_tiles = gl.cdiv(hi - lo, BLOCK_N)
        t_mid_lo = gl.cdiv(mid_lo - lo, BLOCK_N)
        t_mid_hi = gl.cdiv(mid_hi - lo, BLOCK_N)
        listing = ()
        if len(blocks) > 0:  # a block mask: the listed key tiles of this query block's row
            lists, stride_sb, stride_sh, block_q = blocks
            listing, n_tiles = block_listing(
                lists, off_b * stride_sb + off_h * stride_sh + start_m // block_q)
        key0 = key_row0 + lo

        mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + start_m, q_col], q_bar, q_smem)
        tma.async_copy_global_to_shared(do_desc, [do_row + start_m, do_col], q_bar, do_smem)
        for i in gl.static_range(NUM_STAGES):
            issue_kv_load(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, i, n_tiles, key0,
                          listing, kv_col, BLOCK_N, NUM_STAGES)
        rows = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
        row_mask = None
        if VARLEN:  # rows past the sequence's end: any value, never stored
            row_mask = rows < seqlen_q
        lse2 = gl.load(Lse + off_b.to(gl.int64) * stride_lb + off_h * stride_lh + q_start + rows,
                       mask=row_mask) * LOG2E_G
        row_offsets = off_b.to(gl.int64) * stride_deltab + off_h * stride_deltah + q_start + rows
        delta = _row_delta(
            Out + off_b.to(gl.int64) * stride_ob + off_h * stride_oh
            + (q_start + start_m).to(gl.int64) * stride_os,
            DO + off_b.to(gl.int64) * stride_dob + off_h * stride_doh
            + (q_start + start_m).to(gl.int64) * stride_dos,
            stride_os, stride_od, stride_dos, seqlen_q - start_m, BLOCK_M, HEAD_DIM, VARLEN,
            row_layout, num_warps)
        if LSE_GRAD:
            delta -= gl.load(Dlse + row_offsets, mask=row_mask)
        if not SINK:
            gl.store(Delta + row_offsets, delta, mask=row_mask)
        if DROPOUT:  # the tiles select dP without the keep scale 1 / (1 - p): dQ takes it once
            delta = delta * (1.0 / dropout_scale)
        dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
        pdp = gl.zeros([BLOCK_M], gl.float32, row_layout)  # with SINK: rowsum(P * dP)
        mbarrier.wait(q_bar, 0)

        mods = load_score_mods(ScoreTensors, score_values, off_b, off_h, SCORES)
        # Masked tiles of the window's left edge (HAS_LEFT), the fully visible ones, masked
        # tiles of the diagonal (causal), the window's right edge or a sequence's last key
        # tile (HAS_RIGHT, VARLEN); a masked segment is compiled only where it can exist.
        upper = no_upper_words() if DROPOUT else ()  # keep_half_tiles' carried words
        smem = (q_smem, do_smem, k_smem, v_smem)
        ring = (n_tiles, key0, kv_col, start_m, lo, listing)
        if len(listing) > 0:  # the partial blocks' tiles (masked), then the full blocks'
            listed = (0, listing[1], n_tiles)
            for full in gl.static_range(2):
                for tile in range(listed[full], listed[full + 1]):
                    dq, upper, pdp = _key_tile_dq_step(
                        dq, upper, pdp, tile, smem, (k_bars, v_bars), (k_desc, v_desc), lse2,
                        delta, ring, geo, mods, drop, user, grad_args, BLOCK_M, BLOCK_N,
                        NUM_STAGES, full == 0, HAS_LEFT, HAS_RIGHT, SCORES, DROPOUT, VARLEN,
                        ONE_KEY_ZERO, SINK, SCORE_MOD, SCORE_GRAD, MASK_MOD, CAPTURED_GRAD,
                        s_layout, op_layout)
        else:
            bounds = (0, t_mid_lo, t_mid_hi, n_tiles)
            for segment in gl.static_range(3):
                if (segment == 1 or (segment == 0 and HAS_LEFT)
                        or (segment == 2 and (HAS_RIGHT or VARLEN))):
                    for tile in range(bounds[segment], bounds[segment + 1]):
                        dq, upper, pdp = _key_tile_dq_step(
                            dq, upper, pdp, tile, smem, (k_bars, v_bars), (k_desc, v_desc),
                            lse2, delta, ring, geo, mods, drop, user, grad_args, BLOCK_M,
                            BLOCK_N, NUM_STAGES, segment != 1 or MASK_MOD is not None,
                            HAS_LEFT, HAS_RIGHT, SCORES, DROPOUT, VARLEN, ONE_KEY_ZERO, SINK,
                            SCORE_MOD, SCORE_GRAD, MASK_MOD, CAPTURED_GRAD, s_layout,
                            op_layout)
        if SINK:
            if DROPOUT:  # the tiles summed (1 - p) D
                pdp = pdp * dropout_scale
            if LSE_GRAD:
                pdp -= gl.load(Dlse + row_offsets, mask=row_mask)
            gl.store(Delta + row_offsets, pdp, mask=row_mask)

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))

        rows_o = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
        cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
        store_mask = None
        if VARLEN:
            store_mask = (gl.expand_dims(rows_o < seqlen_q, 1)
                          & gl.expand_dims(cols_o < HEAD_DIM, 0))
        dq_ptrs = (DQ + off_b.to(gl.int64) * stride_dqb + off_h * stride_dqh
                   + (gl.expand_dims(rows_o, 1).to(gl.int64) + q_start) * stride_dqs
                   + gl.expand_dims(cols_o, 0))
        if DROPOUT:
            dq = dq * dropout_scale
        gl.store(dq_ptrs, (dq * softmax_scale).to(DQ.dtype.element_ty), mask=store_mask)


def _declines(q, k, v, dout, lse, params: AttentionParams, dq, dk, dv, tiles,
              copies: bool) -> str | None:
    """What the Gluon kernels need whatever the lengths: what the Gluon forward takes
    (forward_hopper.gluon_declines, varlen included), no Triton tile override, dout like q."""
    if not GLUON_BACKWARD:
        return "switched off (configs.GLUON_BACKWARD)"
    if set(tiles or {}) - {"hopper", "hopper_dq"}:
        return "a Triton tile was asked for"
    variant = params.variant
    why = gluon_declines(q, k, v, params, varlen=True, copies=copies)
    if why is None and variant is not None and variant.block_mask is not None:
        why = block_mask_declines(q, params)
    if why is None and not (dout.dtype == q.dtype and tma_layout(dout)
                            and flash_layout_2d(lse)):
        why = "dout not readable in place (tma_layout), lse not contiguous, or not q's dtype"
    if why is None and not all(x.stride(-1) == 1 for x in (dq, dk, dv)):
        why = "dq, dk or dv has a strided last dim"
    return why


def block_mask_declines(q, params: AttentionParams) -> str | None:
    """Why the Gluon kernels do not take the call's block mask, or None: a dense call's mask
    (shared by the heads or one per head; a mask over varlen's packed tokens runs as one
    sequence), without dropout, whose blocks hold whole tiles of both kernels."""
    mask = params.variant.block_mask
    if params.is_varlen:
        return "a block mask with varlen's own sequences"
    if params.dropout_p > 0:
        return "a block mask with dropout"
    tiles = _tiles(q.shape[-1])
    block_q, block_kv = mask.BLOCK_SIZE
    if any(block_q % rows or block_kv % keys for rows, keys in tiles):
        return f"block mask blocks {block_q} x {block_kv} (takes whole tiles of {tiles})"
    return None


def wants_captured_grads(variant) -> bool:
    """Whether a backward computes gradients for a score_mod's captured tensors (its
    captured_grad rule, which the dQ kernels run)."""
    return any(g is not None for g in variant.captured_grads or ())


def _tiles(head_dim: int) -> list:
    """(query rows, keys) of the dQ and the dK/dV kernel's tiles at a head dim."""
    return [GLUON_BACKWARD_DQ[head_dim][:2], GLUON_BACKWARD_DKDV[head_dim][:2]]


def _whole_tiles(q, k) -> bool:
    """Dense seqlen_q and seqlen_k are multiples of every tile of the Gluon kernels (all are
    powers of two, so a multiple of the largest is one of each)."""
    tile = max(max(pair) for pair in _tiles(q.shape[-1]))
    return q.shape[1] % tile == 0 and k.shape[1] % tile == 0


def declines(q, k, v, dout, lse, params: AttentionParams, dq, dk, dv, tiles,
             copies: bool = False) -> str | None:
    """Why the Gluon kernels do not compute this call's gradients as it is, or None (they
    take dense calls with both sequence lengths multiples of every tile, and varlen calls with
    any lengths, at least one token each side). copies=True: the call with q, k and v copied
    into the flash layout (forward_hopper.gluon_declines)."""
    why = _declines(q, k, v, dout, lse, params, dq, dk, dv, tiles, copies)
    if why is None and not (params.is_varlen or _whole_tiles(q, k)):
        why = "dense lengths off the tiles"
    return why


def eligible(q, k, v, dout, lse, params: AttentionParams, dq, dk, dv, tiles) -> bool:
    """Whether the Gluon kernels compute this call's gradients as it is."""
    return declines(q, k, v, dout, lse, params, dq, dk, dv, tiles) is None


def as_varlen_declines(q, k, v, dout, lse, params: AttentionParams, dq, dk, dv,
                       tiles, copies: bool = False) -> str | None:
    """Why a dense call with lengths off the tiles cannot run through the Gluon kernels as
    varlen with equal lengths (backward.py's dense_as_varlen; its VARLEN tails mask and zero
    what the tiles read of the next batch entry), or None: dq, dk, dv must then be contiguous
    too (their (batch * seqlen, heads, d) views are written). copies: as in declines."""
    if params.is_varlen:
        return "varlen already"
    if params.variant is not None and params.variant.block_mask is not None:
        return "a block_mask (its lists are of the dense tiles)"
    why = _declines(q, k, v, dout, lse, params, dq, dk, dv, tiles, copies)
    if why is None and _whole_tiles(q, k):
        why = "lengths on the tiles (taken as dense)"
    if why is None and not all(x.is_contiguous() for x in (dq, dk, dv)):
        why = "dq, dk or dv not contiguous"
    return why


def dense_as_varlen(q, k, v, dout, lse, params: AttentionParams, dq, dk, dv, tiles) -> bool:
    """Whether a dense call runs through the Gluon kernels as varlen (as_varlen_declines)."""
    return as_varlen_declines(q, k, v, dout, lse, params, dq, dk, dv, tiles) is None


# The kernels' tensor parameters (descriptors, pointers and the modifiers' bundles), for
# launch's argument order
_DKDV_TENSORS = ("q_desc", "k_desc", "v_desc", "do_desc", "lse_desc", "delta_desc", "DK", "DV",
                 "ScoreTensors", "Cu_q", "Cu_k", "score_args", "mask_args", "packing", "blocks")
_DQ_TENSORS = ("q_desc", "k_desc", "v_desc", "do_desc", "Out", "DO", "Lse", "Delta", "Dlse", "DQ",
               "ScoreTensors", "Cu_q", "Cu_k", "score_args", "mask_args", "packing", "blocks",
               "grad_args")


def attention_backward_dkdv(dout, q, k, v, lse, delta, params: AttentionParams, dk, dv,
                            block=None, one_key_zero=False, plan: dict | None = None):
    """dK, dV of the eligible case into dk, dv. delta (laid out like lse) comes from the dQ
    kernel, launched before; block overrides GLUON_BACKWARD_DKDV (the sweep); one_key_zero:
    the kernels' ONE_KEY_ZERO (backward.py: no sink, no lse gradient, the call's own lse);
    plan: the dispatch plan's prepared launches (launch.planned)."""
    if params.is_varlen:
        lse, delta = _aligned_lse_delta(lse, delta, params, plan)
    prepared = planned(plan, "dkdv", lambda: _prepare_dkdv(q, k, v, dout, lse, delta, params, dk,
                                                           dv, block, one_key_zero))
    score_tensors, _, cu_q, cu_k = feature_tensors(params, lse, float32_sink=False)  # no sink
    prepared(q, k, v, dout, lse, delta, dk, dv, score_tensors, cu_q, cu_k,
             *modifier_tensors(params, lse, prepared.constexprs["BLOCK_M"], transposed=True,
                               kernel_tile=_kernel_tile(prepared)),
             varying=dropout_seed(params))


def _prepare_dkdv(q, k, v, dout, lse, delta, params: AttentionParams, dk, dv, block,
                  one_key_zero: bool) -> Prepared:
    """The dK/dV launch (launch.Prepared) of the call's shapes, strides and params' values;
    lse and delta as the kernel reads them (varlen: aligned)."""
    f = kernel_features(params, q, v, lse, q.dtype, flags=GRADIENT_FLAGS)
    head_dim = f.head_dim
    block_m, block_n, num_warps, num_stages = block or GLUON_BACKWARD_DKDV[head_dim]
    grid, across_heads = tile_order(cdiv(f.seqlen_k, block_n), f.batch * f.nheads_k, f,
                                    q.device)
    descriptors = {0: flash_descriptor(q, block_m), 1: flash_descriptor(k, block_n),
                   2: flash_descriptor(v, block_n), 3: flash_descriptor(dout, block_m),
                   4: rows_descriptor(lse, block_m), 5: rows_descriptor(delta, block_m)}
    variant = variant_args(params)[3]
    return Prepared(_bwd_dkdv_hopper_kernel, grid, (
        *f.strides(dk)[:3], *f.strides(dv)[:3], f.nheads, f.nheads_k, *f.band,
        f.score_values, params.softmax_scale, *f.dropout, lse.stride(-2), view_geometry(q),
        view_geometry(k), view_geometry(dout)), dict(
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=num_stages, **f.flags,
        ONE_KEY_ZERO=one_key_zero, **_user_modifiers(variant, f, params, block_m, block_n),
        HEAD_LISTS=_per_head_mask(params), ACROSS_HEADS=across_heads, num_warps=num_warps),
        _DKDV_TENSORS, descriptors, SEED)


def attention_backward_dq(dout, q, k, v, out, lse, delta, dlse, params: AttentionParams, dq,
                          block=None, one_key_zero=False, plan: dict | None = None):
    """dQ of the eligible case into dq (deterministic), and each row's delta = rowsum(dO * O)
    - dlse into delta (float32, laid out like lse; dlse None or laid out like it) for the dK/dV
    kernel; block overrides GLUON_BACKWARD_DQ; one_key_zero and plan as
    attention_backward_dkdv's."""
    prepared = planned(plan, "dq", lambda: _prepare_dq(q, k, v, out, dout, lse, delta, dlse,
                                                       params, dq, block, one_key_zero))
    score_tensors, _, cu_q, cu_k = feature_tensors(params, lse, float32_sink=False)  # no sink
    prepared(q, k, v, dout, out, dout, lse, delta, delta if dlse is None else dlse, dq,
             score_tensors, cu_q, cu_k,
             *modifier_tensors(params, lse, prepared.constexprs["BLOCK_N"],
                               kernel_tile=_kernel_tile(prepared)),
             captured_grad_args(params)[0], varying=dropout_seed(params))


def _kernel_tile(prepared: Prepared) -> tuple:
    """(query rows, keys) of a prepared backward launch's tile: a block mask's finest lists
    that hold whole tiles of it (BlockMask.finest; 64-token blocks at head dim 128) skip the
    empty parts of its partial blocks and leave their full parts unmasked."""
    return prepared.constexprs["BLOCK_M"], prepared.constexprs["BLOCK_N"]


def _prepare_dq(q, k, v, out, dout, lse, delta, dlse, params: AttentionParams, dq, block,
                one_key_zero: bool) -> Prepared:
    """The dQ launch (launch.Prepared) of the call's shapes, strides and params' values (dout
    with a unit column stride, as declines checks; out any strides)."""
    f = kernel_features(params, q, v, lse, q.dtype, flags=GRADIENT_FLAGS)
    head_dim = f.head_dim
    block_m, block_n, num_warps, num_stages = block or GLUON_BACKWARD_DQ[head_dim]
    grid, across_heads = tile_order(cdiv(f.seqlen_q, block_m), f.batch * f.nheads, f,
                                    q.device)
    descriptors = {0: flash_descriptor(q, block_m), 1: flash_descriptor(k, block_n),
                   2: flash_descriptor(v, block_n), 3: flash_descriptor(dout, block_m)}
    variant = variant_args(params)[3]
    return Prepared(_bwd_dq_hopper_kernel, grid, (
        *f.strides(out), *f.strides(dout)[:3], *f.strides(lse)[:2], *f.strides(delta)[:2],
        *f.strides(dq)[:3], f.nheads,
        f.nheads // f.nheads_k, *f.band, f.score_values, params.softmax_scale,
        *f.dropout, view_geometry(q), view_geometry(k), view_geometry(dout)), dict(
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=num_stages, **f.flags,
        ONE_KEY_ZERO=one_key_zero, SINK=params.sink is not None, LSE_GRAD=dlse is not None,
        **_user_modifiers(variant, f, params, block_m, block_n),
        **captured_grad_args(params)[1],
        ACROSS_HEADS=across_heads, num_warps=num_warps), _DQ_TENSORS, descriptors, SEED)


def tile_order(n_tiles: int, n_heads: int, f, device) -> tuple[tuple, bool]:
    """(grid, ACROSS_HEADS) of a launch of n_tiles tiles for each of n_heads (batch, head)
    pairs; f: the call's kernel_features. The GPU starts programs in grid order. Each head's
    tiles together (tile in grid x, the heads in y and z) share the head's streamed tiles in
    L2; but a banded call's tiles differ in work (causal: the first key block is seen by every
    query tile), and with few programs a head whose heavy tiles start last holds the launch up
    alone (a GQA model's 512 dK/dV programs, each walking 4 query heads). Such launches, at
    most GLUON_BACKWARD_ACROSS_HEADS_PER_SM programs per SM, put the heads in grid x instead:
    every head's heaviest tile starts before any head's next (ACROSS_HEADS)."""
    banded = f.flags["HAS_LEFT"] or f.flags["HAS_RIGHT"]
    sms = device_facts(device)[0]
    if banded and n_tiles * n_heads <= GLUON_BACKWARD_ACROSS_HEADS_PER_SM * sms:
        return (n_heads, *fold(n_tiles)), True
    return (n_tiles, *fold(n_heads)), False


def _per_head_mask(params: AttentionParams) -> bool:
    """Whether the call's block mask has a list row per head (the dK/dV kernel's HEAD_LISTS);
    else one row serves every head (its head stride is 0, hopper_common.block_lists)."""
    mask = params.variant.block_mask if params.variant is not None else None
    return mask is not None and mask.kv_num_blocks.shape[1] != 1


def _user_modifiers(variant: dict, f, params: AttentionParams, block_m: int,
                    block_n: int) -> dict:
    """The kernels' SCORE_MOD, SCORE_GRAD and MASK_MOD of common.variant_args' dict, and
    QUERIES_IN, KEYS_IN (tiles_in_bounds: the positions the modifiers see need no clamp) of
    the call's features f and a launch of block_m x block_n tiles."""
    queries_in, keys_in = tiles_in_bounds(f, params, block_m, block_n)
    return dict(SCORE_MOD=variant["SCORE_MOD"], SCORE_GRAD=variant["SCORE_GRAD"],
                MASK_MOD=variant["MASK_MOD"], QUERIES_IN=queries_in, KEYS_IN=keys_in)
