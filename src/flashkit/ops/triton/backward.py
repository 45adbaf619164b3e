"""FlashAttention-2 backward in Triton: kernels and their host launcher.

Notation as in common.py, plus
    dO, delta     the output gradient and delta_i = sum_d dO_id * O_id (= rowsum(P * dP))
    P, dP, dS     P = exp2(s - lse2) recomputed from the saved lse; dP = dO V^T;
                  dS = P * (dP - delta); dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO
The kernel's two launches, in this order:
    dQ programs              one per BLOCK_M query rows, looping over key tiles; each first
                             computes its rows' delta from the dO and O tiles and stores it
    dK/dV programs           one per BLOCK_N key columns of one (batch, kv head): loops over the
                             query heads of its GQA group and the query tiles that see the
                             block, so dK/dV are reduced over the group in registers; they read
                             the stored delta
Features as in forward.py: DROPOUT regenerates the forward's keep-mask tile by tile
(dropout.dropout_keep) in both kernels: dV = (P o Z)^T dO and dP = Z o (dO V^T) with
Z = keep / (1 - p), while dS = P o (dP - delta) keeps the pre-dropout P. VARLEN: each program
reads its sequence's rows and lengths from cu_seqlens; blocks past its end return at once (an
early return: clamping the loop ranges instead cost the dQ kernel 30 registers, measured by
ptxas on sm_90).
dQ is summed by one program per query tile in a fixed order, so gradients are bitwise
reproducible.
Transposed tiles carry a _t suffix: s_t is [BLOCK_N, BLOCK_M] = s^T.
On sm_90 dK/dV and dQ run the Gluon kernels of backward_hopper.py instead (configs.GLUON_BACKWARD;
every feature, varlen included, see backward_hopper.declines; dense calls whose lengths are
not tile multiples run there as varlen with equal lengths, dispatch._dense_as_varlen; the
choice is dispatch.backward_call's). dsink here serves both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashkit.ops.params import AttentionParams
from flashkit.ops.triton import backward_hopper
from flashkit.ops.triton.common import (
    DOT_PRECISION,
    LOG2E_JIT,
    SCORE_GRAD_FROM_S_JIT,
    block_args,
    captured_grad_args,
    cdiv,
    exp_units,
    gradient_pairs,
    head_ptr,
    interpreting,
    key_tile_ranges,
    load_score_mods,
    load_tile,
    mod_indices,
    query_tile_ranges,
    score_grad,
    score_mod,
    sequence,
    store_tile,
    tile_ptrs,
    user_captured_grad,
    user_score,
    user_score_grad,
    user_visible,
    variant_args,
    visible,
)
from flashkit.ops.triton.configs import padded_head_dim, tile_config
from flashkit.ops.triton.dropout import dropout_keep, dropout_keep_t
from flashkit.ops.triton.features import GRADIENT_FLAGS, kernel_features
from flashkit.ops.triton.launch import fold, launch


@triton.jit
def _load_lse2(lse_ptrs, offs_m, seqlen_q, MASKED: tl.constexpr = True,
               NATURAL: tl.constexpr = False):
    """lse in log2 units; a row that saw no key (lse = -inf) and rows past seqlen_q read +inf,
    so P = exp2(s - lse2) = 0 for them. MASKED=False: every row is in bounds (the unmasked
    tiles), no mask (with seqlen_q of unknown divisibility, varlen, the mask cost registers)."""
    if MASKED:
        lse = tl.load(lse_ptrs, mask=offs_m < seqlen_q, other=float("-inf"))
    else:
        lse = tl.load(lse_ptrs)
    if not NATURAL:  # NATURAL (fp32): lse stays in the scores' natural units
        lse = lse * LOG2E_JIT
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def _bwd_dkdv_tiles(dk, dv, k_tile, v_tile, rows, start, end, offs, band, mods, drop, variant,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    SCORES: tl.constexpr, DROPOUT: tl.constexpr,
                    ONE_KEY_ZERO: tl.constexpr, PRECISION: tl.constexpr,
                    SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
                    PACKED: tl.constexpr, LISTED: tl.constexpr = False, SPAN: tl.constexpr = 1):
    """Accumulate dK, dV of one key block over query tiles [start, end). rows = (q_base,
    do_base, lse_base, delta_base, stride_qs, stride_qd, stride_dos, stride_dod, stride_ls,
    stride_deltas) of this query head; offs = (offs_n, offs_d, offs_dv); band and mods as
    common.score_mod; drop = (seed_lo, seed_hi, threshold, dropout_scale, off_b, off_h,
    start_n) of the keep-mask; variant = (score_args, mask_args, packing, Blocks) of a user
    score_mod /
    mask_mod (SCORE_MOD with its derivative SCORE_GRAD, MASK_MOD) and a block mask: LISTED,
    [start, end) counts query rows of the SPAN-row blocks listed at Blocks, as the forward's
    _fwd_tiles counts keys."""
    (q_base, do_base, lse_base, delta_base, stride_qs, stride_qd, stride_dos, stride_dod,
     stride_ls, stride_deltas) = rows
    offs_n, offs_d, offs_dv = offs
    seqlen_q, seqlen_k, window_left, window_right = band
    seed_lo, seed_hi, dropout_threshold, dropout_scale, off_b, off_h, start_n = drop
    score_args, mask_args, packing, Blocks = variant
    for pos in tl.range(start, end, BLOCK_M):
        start_m = pos
        if LISTED:
            start_m = tl.load(Blocks + pos // SPAN) * SPAN + pos % SPAN
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_tile = load_tile(tile_ptrs(q_base, offs_m, offs_d, stride_qs, stride_qd), offs_m,
                           seqlen_q, offs_d, HEAD_DIM, MASKED, HEAD_DIM != BLOCK_D)
        lse2 = _load_lse2(lse_base + offs_m * stride_ls, offs_m, seqlen_q, MASKED,
                          q_tile.dtype == tl.float32)
        # [BLOCK_N, BLOCK_M] = [BLOCK_N, BLOCK_D] @ [BLOCK_D, BLOCK_M]
        qk_t = tl.dot(k_tile, tl.trans(q_tile), input_precision=PRECISION)
        s_t, dcap_t = score_mod(qk_t, offs_m[None, :], offs_n[:, None], band, mods, SCORES,
                                SCORE_GRAD_FROM_S_JIT)
        mod_b, mod_i, mod_j, mod_lq, mod_lk, same_t = mod_indices(
            off_b, offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, packing, PACKED)
        if SCORE_MOD is not None:  # d score_mod / d score, then the modified score
            dmod_t = user_score_grad(s_t, mod_b, off_h, mod_i, mod_j, mod_lq, mod_lk,
                                     SCORE_GRAD, score_args, q_tile.dtype == tl.float32)
            s_t = user_score(s_t, mod_b, off_h, mod_i, mod_j, mod_lq, mod_lk, SCORE_MOD,
                             score_args, q_tile.dtype == tl.float32)
        p_t = exp_units(s_t - lse2[None, :], q_tile.dtype == tl.float32)
        if MASKED:
            keep_t = visible(offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, window_left,
                             window_right, HAS_LEFT, HAS_RIGHT)
            if PACKED:
                keep_t = keep_t & same_t
            if MASK_MOD is not None:
                keep_t = keep_t & user_visible(mod_b, off_h, mod_i, mod_j, mod_lq, mod_lk,
                                               MASK_MOD, mask_args)
            p_t = tl.where(keep_t, p_t, 0.0)
        do_tile = load_tile(tile_ptrs(do_base, offs_m, offs_dv, stride_dos, stride_dod), offs_m,
                            seqlen_q, offs_dv, HEAD_DIM_V, MASKED, HEAD_DIM_V != BLOCK_DV)
        pv_t = p_t
        if DROPOUT:  # the forward's keep-mask of this [BLOCK_M, BLOCK_N] tile, transposed
            kept_t = dropout_keep_t(seed_lo, seed_hi, off_b, off_h, offs_m, start_n,
                                    dropout_threshold, BLOCK_N)
            pv_t = tl.where(kept_t, p_t * dropout_scale, 0.0)
        # [BLOCK_N, BLOCK_DV] = [BLOCK_N, BLOCK_M] @ [BLOCK_M, BLOCK_DV]
        dv = tl.dot(pv_t.to(do_tile.dtype), do_tile, dv, input_precision=PRECISION)
        # [BLOCK_N, BLOCK_M] = [BLOCK_N, BLOCK_DV] @ [BLOCK_DV, BLOCK_M]
        dp_t = tl.dot(v_tile, tl.trans(do_tile), input_precision=PRECISION)
        if DROPOUT:
            dp_t = tl.where(kept_t, dp_t * dropout_scale, 0.0)
        if MASKED:
            delta = tl.load(delta_base + offs_m * stride_deltas, mask=offs_m < seqlen_q,
                            other=0.0)
        else:
            delta = tl.load(delta_base + offs_m * stride_deltas)
        ds_t = p_t * (dp_t - delta[None, :])
        if MASKED:  # see gradient_pairs
            ds_t = tl.where(gradient_pairs(keep_t, offs_m[None, :], seqlen_q, seqlen_k,
                                           window_left, window_right, HAS_LEFT, HAS_RIGHT,
                                           ONE_KEY_ZERO), ds_t, 0.0)
        if SCORE_MOD is not None:
            ds_t = ds_t * dmod_t
        ds_t = score_grad(ds_t, dcap_t, SCORES)
        # [BLOCK_N, BLOCK_D] = [BLOCK_N, BLOCK_M] @ [BLOCK_M, BLOCK_D]
        dk = tl.dot(ds_t.to(q_tile.dtype), q_tile, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkdv_program(pid_n, pid_bh, Q, K, V, DO, Lse, Delta, DK, DV,
                     stride_qb, stride_qs, stride_qh, stride_qd,
                     stride_kb, stride_ks, stride_kh, stride_kd,
                     stride_vb, stride_vs, stride_vh, stride_vd,
                     stride_dob, stride_dos, stride_doh, stride_dod,
                     stride_lb, stride_lh, stride_ls,
                     stride_deltab, stride_deltah, stride_deltas,
                     stride_dkb, stride_dks, stride_dkh, stride_dkd,
                     stride_dvb, stride_dvs, stride_dvh, stride_dvd,
                     nheads_k, group, seqlen_q, seqlen_k, window_left, window_right,
                     ScoreTensors, score_values, softmax_scale, seed_lo, seed_hi, dropout_threshold,
                     dropout_scale, Cu_q, Cu_k, score_args, mask_args, packing, QNum, QIdx,
                     FullQNum, FullQIdx, stride_tb, stride_th, n_q_blocks,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SCORES: tl.constexpr,
                     DROPOUT: tl.constexpr, ONE_KEY_ZERO: tl.constexpr,
                     VARLEN: tl.constexpr, EVEN_N: tl.constexpr, PRECISION: tl.constexpr,
                     SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
                     PACKED: tl.constexpr, SPARSE: tl.constexpr, SPARSE_Q: tl.constexpr,
                     SPARSE_KV: tl.constexpr):
    """dK, dV of key block pid_n of (batch, kv head) pid_bh. SPARSE: the query blocks come from
    the block mask's transposed lists (row start_n // SPARSE_KV of each query head)."""
    off_b = (pid_bh // nheads_k).to(tl.int64)
    off_hk = (pid_bh % nheads_k).to(tl.int64)
    q_start, k_start, seqlen_q, seqlen_k = sequence(off_b, seqlen_q, seqlen_k, Cu_q, Cu_k,
                                                    VARLEN)
    start_n = pid_n * BLOCK_N
    if VARLEN:
        if start_n >= seqlen_k:
            return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    k_base = head_ptr(K, off_b, off_hk, k_start, stride_kb, stride_kh, stride_ks)
    v_base = head_ptr(V, off_b, off_hk, k_start, stride_vb, stride_vh, stride_vs)
    k_tile = load_tile(tile_ptrs(k_base, offs_n, offs_d, stride_ks, stride_kd), offs_n, seqlen_k,
                       offs_d, HEAD_DIM, not EVEN_N, HEAD_DIM != BLOCK_D)
    v_tile = load_tile(tile_ptrs(v_base, offs_n, offs_dv, stride_vs, stride_vd), offs_n,
                       seqlen_k, offs_dv, HEAD_DIM_V, not EVEN_N, HEAD_DIM_V != BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = query_tile_ranges(start_n, seqlen_q, seqlen_k, window_left,
                                               window_right, BLOCK_M, BLOCK_N, HAS_LEFT,
                                               HAS_RIGHT)
    for g in range(group):  # the query heads that share this kv head, in a fixed order
        off_h = off_hk * group + g
        mods = load_score_mods(ScoreTensors, score_values, off_b, off_h, SCORES,
                               Q.dtype.element_ty == tl.float32)
        q_base = head_ptr(Q, off_b, off_h, q_start, stride_qb, stride_qh, stride_qs)
        do_base = head_ptr(DO, off_b, off_h, q_start, stride_dob, stride_doh, stride_dos)
        lse_base = head_ptr(Lse, off_b, off_h, q_start, stride_lb, stride_lh, stride_ls)
        delta_base = head_ptr(Delta, off_b, off_h, q_start, stride_deltab, stride_deltah,
                              stride_deltas)
        bounds = (lo, mid_lo, mid_hi, hi)
        band = (seqlen_q, seqlen_k, window_left, window_right)
        rows = (q_base, do_base, lse_base, delta_base, stride_qs, stride_qd, stride_dos,
                stride_dod, stride_ls, stride_deltas)
        offs = (offs_n, offs_d, offs_dv)
        drop = (seed_lo, seed_hi, dropout_threshold, dropout_scale, off_b, off_h, start_n)
        if SPARSE:  # the block mask's lists replace the band's ranges
            row = off_b * stride_tb + off_h * stride_th + start_n // SPARSE_KV
            for listed in tl.static_range(2):  # partial query blocks (masked), then full ones
                Num = QNum if listed == 0 else FullQNum
                Idx = QIdx if listed == 0 else FullQIdx
                dk, dv = _bwd_dkdv_tiles(
                    dk, dv, k_tile, v_tile, rows, 0, tl.load(Num + row) * SPARSE_Q, offs, band,
                    mods, drop, (score_args, mask_args, packing, Idx + row * n_q_blocks),
                    HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, listed == 0,
                    HAS_LEFT, HAS_RIGHT, SCORES, DROPOUT, ONE_KEY_ZERO, PRECISION, SCORE_MOD,
                    SCORE_GRAD, MASK_MOD, PACKED, True, SPARSE_Q)
            bounds = (0, 0, 0, 0)
        for segment in tl.static_range(3):  # masked edge, unmasked middle, masked edge
            dk, dv = _bwd_dkdv_tiles(
                dk, dv, k_tile, v_tile, rows, bounds[segment], bounds[segment + 1], offs, band,
                mods, drop, (score_args, mask_args, packing, QIdx), HEAD_DIM, HEAD_DIM_V,
                BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, segment != 1 or MASK_MOD is not None,
                HAS_LEFT, HAS_RIGHT, SCORES, DROPOUT, ONE_KEY_ZERO, PRECISION, SCORE_MOD,
                SCORE_GRAD, MASK_MOD, PACKED)

    dk_ptrs = tile_ptrs(head_ptr(DK, off_b, off_hk, k_start, stride_dkb, stride_dkh, stride_dks),
                        offs_n, offs_d, stride_dks, stride_dkd)
    dv_ptrs = tile_ptrs(head_ptr(DV, off_b, off_hk, k_start, stride_dvb, stride_dvh, stride_dvs),
                        offs_n, offs_dv, stride_dvs, stride_dvd)
    store_tile(dk_ptrs, (dk * softmax_scale).to(DK.dtype.element_ty), offs_n, seqlen_k, offs_d,
               HEAD_DIM, not EVEN_N, HEAD_DIM != BLOCK_D)
    store_tile(dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, seqlen_k, offs_dv, HEAD_DIM_V,
               not EVEN_N, HEAD_DIM_V != BLOCK_DV)


@triton.jit
def _bwd_dq_tiles(dq, pdp, q_tile, do_tile, lse2, delta, kv, start, end, offs, band, mods, drop,
                  variant, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SCORES: tl.constexpr,
                  SINK: tl.constexpr, DROPOUT: tl.constexpr, ONE_KEY_ZERO: tl.constexpr,
                  PRECISION: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr,
                  MASK_MOD: tl.constexpr, CAPTURED_GRAD: tl.constexpr, PACKED: tl.constexpr,
                  LISTED: tl.constexpr = False, SPAN: tl.constexpr = 1):
    """Accumulate dQ of one query block over key tiles [start, end), and with SINK pdp, the
    rows' sums of P * dP ([BLOCK_M], float32); returns (dq, pdp). kv = (k_base, v_base,
    stride_ks, stride_kd, stride_vs, stride_vd); offs = (offs_m, offs_d, offs_dv); band and mods
    as common.score_mod; drop = (seed_lo, seed_hi, threshold, dropout_scale, off_b, off_h);
    variant = (score_args, mask_args, grad_args, packing, Blocks) and LISTED as the forward's
    _fwd_tiles, plus grad_args, the buffers CAPTURED_GRAD (the score_mod's captured_grad rule)
    adds the captured tensors' gradients into: here, where every visible (query, key) pair is
    visited once, in its [BLOCK_M, BLOCK_N] orientation."""
    k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd = kv
    offs_m, offs_d, offs_dv = offs
    seqlen_q, seqlen_k, window_left, window_right = band
    seed_lo, seed_hi, dropout_threshold, dropout_scale, off_b, off_h = drop
    score_args, mask_args, grad_args, packing, Blocks = variant
    for pos in tl.range(start, end, BLOCK_N):
        start_n = pos
        if LISTED:
            start_n = tl.load(Blocks + pos // SPAN) * SPAN + pos % SPAN
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_tile = load_tile(tile_ptrs(k_base, offs_n, offs_d, stride_ks, stride_kd), offs_n,
                           seqlen_k, offs_d, HEAD_DIM, MASKED, HEAD_DIM != BLOCK_D)
        v_tile = load_tile(tile_ptrs(v_base, offs_n, offs_dv, stride_vs, stride_vd), offs_n,
                           seqlen_k, offs_dv, HEAD_DIM_V, MASKED, HEAD_DIM_V != BLOCK_DV)
        # [BLOCK_M, BLOCK_N] = [BLOCK_M, BLOCK_D] @ [BLOCK_D, BLOCK_N]
        qk = tl.dot(q_tile, tl.trans(k_tile), input_precision=PRECISION)
        s, dcap = score_mod(qk, offs_m[:, None], offs_n[None, :], band, mods, SCORES,
                            SCORE_GRAD_FROM_S_JIT)
        s_in = s  # the score before score_mod, for CAPTURED_GRAD
        mod_b, mod_i, mod_j, mod_lq, mod_lk, same = mod_indices(
            off_b, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, packing, PACKED)
        if SCORE_MOD is not None:  # d score_mod / d score, then the modified score
            dmod = user_score_grad(s, mod_b, off_h, mod_i, mod_j, mod_lq, mod_lk, SCORE_GRAD,
                                   score_args, q_tile.dtype == tl.float32)
            s = user_score(s, mod_b, off_h, mod_i, mod_j, mod_lq, mod_lk, SCORE_MOD, score_args,
                           q_tile.dtype == tl.float32)
        p = exp_units(s - lse2[:, None], q_tile.dtype == tl.float32)
        if MASKED:
            keep = visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left,
                           window_right, HAS_LEFT, HAS_RIGHT)
            if PACKED:
                keep = keep & same
            if MASK_MOD is not None:
                keep = keep & user_visible(mod_b, off_h, mod_i, mod_j, mod_lq, mod_lk,
                                           MASK_MOD, mask_args)
            p = tl.where(keep, p, 0.0)
        # [BLOCK_M, BLOCK_N] = [BLOCK_M, BLOCK_DV] @ [BLOCK_DV, BLOCK_N]
        dp = tl.dot(do_tile, tl.trans(v_tile), input_precision=PRECISION)
        if DROPOUT:  # the forward's keep-mask of this tile
            kept = dropout_keep(seed_lo, seed_hi, off_b, off_h, offs_m, start_n,
                                dropout_threshold, BLOCK_N)
            dp = tl.where(kept, dp * dropout_scale, 0.0)
        if SINK:
            pdp_tile = p * dp
            if MASKED:  # a value the row cannot see may make its dP NaN
                pdp_tile = tl.where(keep, pdp_tile, 0.0)
            pdp += tl.sum(pdp_tile, 1)
        ds = p * (dp - delta[:, None])
        if MASKED:  # see gradient_pairs
            ds = tl.where(gradient_pairs(keep, offs_m[:, None], seqlen_q, seqlen_k, window_left,
                                         window_right, HAS_LEFT, HAS_RIGHT, ONE_KEY_ZERO), ds, 0.0)
        if CAPTURED_GRAD is not None:  # ds is dL / d score_mod(score) here
            user_captured_grad(ds, s_in, mod_b, off_h, mod_i, mod_j, mod_lq, mod_lk,
                               CAPTURED_GRAD, score_args, grad_args, q_tile.dtype == tl.float32)
        if SCORE_MOD is not None:
            ds = ds * dmod
        ds = score_grad(ds, dcap, SCORES)
        # [BLOCK_M, BLOCK_D] = [BLOCK_M, BLOCK_N] @ [BLOCK_N, BLOCK_D]
        dq = tl.dot(ds.to(k_tile.dtype), k_tile, dq, input_precision=PRECISION)
    return dq, pdp


@triton.jit
def _row_delta(o_base, do_tile, dlse_ptrs, offs_m, offs_dv, seqlen_q, stride_os, stride_od,
               HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_M: tl.constexpr,
               LSE_GRAD: tl.constexpr):
    """delta = rowsum(dO * O) - dlse ([BLOCK_M] float32) of the rows offs_m, from the dO tile
    the dQ program holds and O's tile (0 for rows past seqlen_q)."""
    o_tile = load_tile(tile_ptrs(o_base, offs_m, offs_dv, stride_os, stride_od), offs_m,
                       seqlen_q, offs_dv, HEAD_DIM_V, not EVEN_M, HEAD_DIM_V != BLOCK_DV)
    delta = tl.sum(o_tile.to(tl.float32) * do_tile.to(tl.float32), 1)
    if LSE_GRAD:
        delta -= tl.load(dlse_ptrs, mask=offs_m < seqlen_q, other=0.0)
    return delta


@triton.jit
def _bwd_dq_program(pid_m, pid_bh, Q, K, V, Out, DO, Lse, Delta, Dlse, DQ,
                   stride_qb, stride_qs, stride_qh, stride_qd,
                   stride_kb, stride_ks, stride_kh, stride_kd,
                   stride_vb, stride_vs, stride_vh, stride_vd,
                   stride_ob, stride_os, stride_oh, stride_od,
                   stride_dob, stride_dos, stride_doh, stride_dod,
                   stride_lb, stride_lh, stride_ls,
                   stride_deltab, stride_deltah, stride_deltas,
                   stride_dqb, stride_dqs, stride_dqh, stride_dqd,
                   nheads, group, seqlen_q, seqlen_k, window_left, window_right, ScoreTensors,
                   score_values, softmax_scale, seed_lo, seed_hi, dropout_threshold, dropout_scale,
                   Cu_q, Cu_k, score_args, mask_args, grad_args, packing, KvNum, KvIdx, FullNum,
                   FullIdx, stride_sb, stride_sh, n_kv_blocks,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SCORES: tl.constexpr,
                   DROPOUT: tl.constexpr, ONE_KEY_ZERO: tl.constexpr,
                   SINK: tl.constexpr, LSE_GRAD: tl.constexpr, VARLEN: tl.constexpr,
                   EVEN_M: tl.constexpr, PRECISION: tl.constexpr, SCORE_MOD: tl.constexpr,
                   SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr, CAPTURED_GRAD: tl.constexpr,
                   PACKED: tl.constexpr, SPARSE: tl.constexpr, SPARSE_Q: tl.constexpr,
                   SPARSE_KV: tl.constexpr):
    """dQ of query block pid_m of (batch, head) pid_bh; SPARSE as the forward kernel's. The
    program computes its rows' delta = rowsum(dO * O) - dlse (LSE_GRAD: Dlse, laid out like
    Delta) and stores it in Delta for the dK/dV programs launched after it. SINK: what it
    stores is rowsum(P * dP) - dlse from its float32 tiles instead, which dsink reads too
    (attention_backward)."""
    off_b = (pid_bh // nheads).to(tl.int64)
    off_h = (pid_bh % nheads).to(tl.int64)
    off_hk = off_h // group
    q_start, k_start, seqlen_q, seqlen_k = sequence(off_b, seqlen_q, seqlen_k, Cu_q, Cu_k,
                                                    VARLEN)
    start_m = pid_m * BLOCK_M
    if VARLEN:
        if start_m >= seqlen_q:
            return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_ptrs = tile_ptrs(head_ptr(Q, off_b, off_h, q_start, stride_qb, stride_qh, stride_qs),
                       offs_m, offs_d, stride_qs, stride_qd)
    do_ptrs = tile_ptrs(head_ptr(DO, off_b, off_h, q_start, stride_dob, stride_doh, stride_dos),
                        offs_m, offs_dv, stride_dos, stride_dod)
    q_tile = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, not EVEN_M,
                       HEAD_DIM != BLOCK_D)
    do_tile = load_tile(do_ptrs, offs_m, seqlen_q, offs_dv, HEAD_DIM_V, not EVEN_M,
                        HEAD_DIM_V != BLOCK_DV)
    lse2 = _load_lse2(head_ptr(Lse, off_b, off_h, q_start, stride_lb, stride_lh, stride_ls)
                      + offs_m * stride_ls, offs_m, seqlen_q, True, q_tile.dtype == tl.float32)
    delta_ptrs = head_ptr(Delta, off_b, off_h, q_start, stride_deltab, stride_deltah,
                          stride_deltas) + offs_m * stride_deltas
    dlse_ptrs = head_ptr(Dlse, off_b, off_h, q_start, stride_deltab, stride_deltah,
                         stride_deltas) + offs_m * stride_deltas
    delta = _row_delta(head_ptr(Out, off_b, off_h, q_start, stride_ob, stride_oh, stride_os),
                       do_tile, dlse_ptrs, offs_m, offs_dv, seqlen_q, stride_os, stride_od,
                       HEAD_DIM_V, BLOCK_DV, EVEN_M, LSE_GRAD)
    if not SINK:
        tl.store(delta_ptrs, delta, mask=offs_m < seqlen_q)
    k_base = head_ptr(K, off_b, off_hk, k_start, stride_kb, stride_kh, stride_ks)
    v_base = head_ptr(V, off_b, off_hk, k_start, stride_vb, stride_vh, stride_vs)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    pdp = tl.zeros([BLOCK_M], dtype=tl.float32)  # with SINK: rowsum(P * dP)
    mods = load_score_mods(ScoreTensors, score_values, off_b, off_h, SCORES,
                           Q.dtype.element_ty == tl.float32)

    lo, mid_lo, mid_hi, hi = key_tile_ranges(start_m, seqlen_q, seqlen_k, window_left,
                                             window_right, BLOCK_M, BLOCK_N, HAS_LEFT,
                                             HAS_RIGHT)
    bounds = (lo, mid_lo, mid_hi, hi)
    kv = (k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd)
    offs = (offs_m, offs_d, offs_dv)
    band = (seqlen_q, seqlen_k, window_left, window_right)
    drop = (seed_lo, seed_hi, dropout_threshold, dropout_scale, off_b, off_h)
    if SPARSE:  # the block mask's lists replace the band's ranges
        row = off_b * stride_sb + off_h * stride_sh + start_m // SPARSE_Q
        for listed in tl.static_range(2):  # partial key blocks (masked), then full ones
            Num = KvNum if listed == 0 else FullNum
            Idx = KvIdx if listed == 0 else FullIdx
            dq, pdp = _bwd_dq_tiles(dq, pdp, q_tile, do_tile, lse2, delta, kv, 0,
                                    tl.load(Num + row) * SPARSE_KV, offs, band, mods, drop,
                                    (score_args, mask_args, grad_args, packing,
                                     Idx + row * n_kv_blocks), HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                                    BLOCK_DV, BLOCK_N, listed == 0, HAS_LEFT, HAS_RIGHT,
                                    SCORES, SINK, DROPOUT, ONE_KEY_ZERO, PRECISION,
                                    SCORE_MOD, SCORE_GRAD, MASK_MOD, CAPTURED_GRAD, PACKED, True,
                                    SPARSE_KV)
        bounds = (0, 0, 0, 0)
    for segment in tl.static_range(3):  # masked edge, unmasked middle, masked edge
        dq, pdp = _bwd_dq_tiles(dq, pdp, q_tile, do_tile, lse2, delta, kv, bounds[segment],
                                bounds[segment + 1], offs, band, mods, drop,
                                (score_args, mask_args, grad_args, packing, KvIdx), HEAD_DIM,
                                HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N,
                                segment != 1 or MASK_MOD is not None, HAS_LEFT, HAS_RIGHT,
                                SCORES, SINK, DROPOUT, ONE_KEY_ZERO, PRECISION,
                                SCORE_MOD, SCORE_GRAD, MASK_MOD, CAPTURED_GRAD, PACKED)
    if SINK:
        if LSE_GRAD:
            pdp -= tl.load(dlse_ptrs, mask=offs_m < seqlen_q, other=0.0)
        tl.store(delta_ptrs, pdp, mask=offs_m < seqlen_q)

    dq_ptrs = tile_ptrs(head_ptr(DQ, off_b, off_h, q_start, stride_dqb, stride_dqh, stride_dqs),
                        offs_m, offs_d, stride_dqs, stride_dqd)
    store_tile(dq_ptrs, (dq * softmax_scale).to(DQ.dtype.element_ty), offs_m, seqlen_q, offs_d,
               HEAD_DIM, not EVEN_M, HEAD_DIM != BLOCK_D)



# Not specialised on: the dropout seed (new every call) and the sizes that follow the lengths
# (program counts, the block masks' sizes), so a variant at a new length keeps its kernels
@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "dropout_threshold", "num_kv_blocks",
                               "num_q_blocks", "stride_sb", "stride_sh", "n_kv_blocks",
                               "stride_tb", "stride_th", "n_q_blocks"])
def _bwd_kernel(Q, K, V, Out, DO, Lse, Delta, Dlse, DQ, DK, DV,
                stride_qb, stride_qs, stride_qh, stride_qd,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd,
                stride_ob, stride_os, stride_oh, stride_od,
                stride_dob, stride_dos, stride_doh, stride_dod,
                stride_lb, stride_lh, stride_ls,
                stride_deltab, stride_deltah, stride_deltas,
                stride_dqb, stride_dqs, stride_dqh, stride_dqd,
                stride_dkb, stride_dks, stride_dkh, stride_dkd,
                stride_dvb, stride_dvs, stride_dvh, stride_dvd,
                batch, nheads, nheads_k, seqlen_q, seqlen_k, window_left, window_right,
                ScoreTensors, score_values, softmax_scale, seed_lo, seed_hi, dropout_threshold,
                dropout_scale, Cu_q, Cu_k, num_kv_blocks, num_q_blocks, score_args, mask_args,
                grad_args, packing, KvNum, KvIdx, FullNum, FullIdx, stride_sb, stride_sh,
                n_kv_blocks, QNum, QIdx, FullQNum, FullQIdx, stride_tb, stride_th, n_q_blocks,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
                BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, HAS_LEFT: tl.constexpr,
                HAS_RIGHT: tl.constexpr, SCORES: tl.constexpr, DROPOUT: tl.constexpr,
                VARLEN: tl.constexpr, ONE_KEY_ZERO: tl.constexpr,
                SINK: tl.constexpr, LSE_GRAD: tl.constexpr, EVEN_M: tl.constexpr,
                EVEN_N: tl.constexpr,
                DO_DKDV: tl.constexpr, PRECISION: tl.constexpr, SCORE_MOD: tl.constexpr,
                SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr, PACKED: tl.constexpr,
                CAPTURED_GRAD: tl.constexpr, SPARSE: tl.constexpr, SPARSE_Q: tl.constexpr,
                SPARSE_KV: tl.constexpr):
    """The dQ programs (heaviest query block first) or the dK/dV programs (DO_DKDV,
    num_kv_blocks on axis 0), in two launches, dQ first: it stores the delta the dK/dV programs
    read; axis 1 is batch * nheads, of which the dK/dV programs use the first batch * nheads_k.
    SINK and LSE_GRAD (the dQ launch's): see _bwd_dq_program."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)  # launch.fold
    group = nheads // nheads_k
    if DO_DKDV:
        # pid < num_kv_blocks holds on this grid; the test stays because without it ptxas
        # schedules the head-dim-256 dK/dV program 0-2% slower (H200, same run), and nested:
        # joined into one `and`, the varlen build's machine code changes too
        if pid < num_kv_blocks:
            if pid_bh < batch * nheads_k:
                _bwd_dkdv_program(pid, pid_bh, Q, K, V, DO, Lse, Delta, DK, DV,
                                  stride_qb, stride_qs, stride_qh, stride_qd,
                                  stride_kb, stride_ks, stride_kh, stride_kd,
                                  stride_vb, stride_vs, stride_vh, stride_vd,
                                  stride_dob, stride_dos, stride_doh, stride_dod,
                                  stride_lb, stride_lh, stride_ls,
                                  stride_deltab, stride_deltah, stride_deltas,
                                  stride_dkb, stride_dks, stride_dkh, stride_dkd,
                                  stride_dvb, stride_dvs, stride_dvh, stride_dvd,
                                  nheads_k, group, seqlen_q, seqlen_k, window_left,
                                  window_right, ScoreTensors, score_values, softmax_scale,
                                  seed_lo, seed_hi, dropout_threshold,
                                  dropout_scale, Cu_q, Cu_k, score_args, mask_args, packing,
                                  QNum, QIdx, FullQNum, FullQIdx, stride_tb, stride_th,
                                  n_q_blocks, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M1,
                                  BLOCK_N1, HAS_LEFT, HAS_RIGHT, SCORES, DROPOUT,
                                  ONE_KEY_ZERO, VARLEN, EVEN_N, PRECISION, SCORE_MOD,
                                  SCORE_GRAD, MASK_MOD, PACKED, SPARSE, SPARSE_Q, SPARSE_KV)
    else:
        pid_m = num_q_blocks - 1 - pid
        _bwd_dq_program(pid_m, pid_bh, Q, K, V, Out, DO, Lse, Delta, Dlse, DQ,
                        stride_qb, stride_qs, stride_qh, stride_qd,
                        stride_kb, stride_ks, stride_kh, stride_kd,
                        stride_vb, stride_vs, stride_vh, stride_vd,
                        stride_ob, stride_os, stride_oh, stride_od,
                        stride_dob, stride_dos, stride_doh, stride_dod,
                        stride_lb, stride_lh, stride_ls,
                        stride_deltab, stride_deltah, stride_deltas,
                        stride_dqb, stride_dqs, stride_dqh, stride_dqd,
                        nheads, group, seqlen_q, seqlen_k, window_left, window_right,
                        ScoreTensors, score_values, softmax_scale, seed_lo, seed_hi,
                        dropout_threshold, dropout_scale, Cu_q, Cu_k, score_args, mask_args,
                        grad_args, packing, KvNum, KvIdx, FullNum, FullIdx, stride_sb,
                        stride_sh, n_kv_blocks, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                        BLOCK_DV, BLOCK_M2, BLOCK_N2, HAS_LEFT, HAS_RIGHT, SCORES, DROPOUT,
                        ONE_KEY_ZERO, SINK, LSE_GRAD, VARLEN, EVEN_M, PRECISION, SCORE_MOD,
                        SCORE_GRAD, MASK_MOD, CAPTURED_GRAD, PACKED, SPARSE, SPARSE_Q, SPARSE_KV)


_BWD_TENSORS = ("Q", "K", "V", "Out", "DO", "Lse", "Delta", "Dlse", "DQ", "DK", "DV",
                "ScoreTensors", "Cu_q", "Cu_k", "KvNum", "KvIdx", "FullNum", "FullIdx", "QNum",
                "QIdx", "FullQNum", "FullQIdx")  # launch's order


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, params: AttentionParams,
                       dq: torch.Tensor | None = None, dk: torch.Tensor | None = None,
                       dv: torch.Tensor | None = None, tiles: dict | None = None,
                       dlse: torch.Tensor | None = None, gluon: bool = False,
                       own_lse: bool = True, plan: dict | None = None):
    """Launch dQ, then dK/dV. Returns (dq, dk, dv, dsink), dsink None without a sink; dq/dk/dv
    may be preallocated. dlse, a gradient on the lse output, enters as D - dlse (d lse_i /
    d s_ij = P_ij, the same shape of term as D). own_lse=False: lse is one over more keys than
    this call's (ring attention), so rows seeing one key here keep their dS. Which kernels run
    is chosen by dispatch.backward_call; this launches that choice.

    The dQ kernel computes each row's delta = D - dlse, D = rowsum(dO * O), from the dO and O
    tiles it loads, and stores it (float32, laid out like lse) for the dK/dV kernel launched
    after it: no separate pass over O and dO.

    gluon: dQ and dK/dV in backward_hopper's kernels (the call must be one they take,
    backward_hopper.declines); else in this file's kernels. tiles = {"dkdv": (BLOCK_M, BLOCK_N,
    num_warps, num_stages), "dq": ...} overrides configs.SM90 (the tuning sweep); tiles =
    {"hopper": ..., "hopper_dq": ...} override configs.GLUON_BACKWARD_DKDV and
    configs.GLUON_BACKWARD_DQ. plan: the dispatch plan's prepared launches of the Gluon
    kernels (launch.planned).
    """
    tiles = tiles or {}
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    # float32 in lse's shape, contiguous (empty_like: half the host time of torch.empty)
    delta = torch.empty_like(lse, dtype=torch.float32, memory_format=torch.contiguous_format)
    if dlse is not None:  # the kernels read it laid out like delta
        dlse = dlse.to(torch.float32).contiguous()

    one_key_zero = params.sink is None and dlse is None and own_lse
    if gluon:
        backward_hopper.attention_backward_dq(dout, q, k, v, out, lse, delta, dlse, params, dq,
                                              block=tiles.get("hopper_dq"),
                                              one_key_zero=one_key_zero, plan=plan)
        backward_hopper.attention_backward_dkdv(dout, q, k, v, lse, delta, params, dk, dv,
                                                block=tiles.get("hopper"),
                                                one_key_zero=one_key_zero, plan=plan)
    else:
        _triton_dkdv_dq(dout, q, k, v, out, lse, delta, dlse, params, dq, dk, dv, tiles,
                        one_key_zero)

    dsink = None
    if params.sink is not None:
        # d lse_i / d sink = exp(sink - lse_i) and dL/d lse_i = dlse_i - D_i, summed over rows
        # (lse (batch, nheads, seqlen_q), varlen (nheads, total_q)): a fixed-order torch
        # reduction, deterministic like the rest. With a sink the dQ kernels store each row's
        # D - dlse with D = rowsum(P * dP) from the float32 tiles: rowsum(dO * O) would carry
        # the rounding of O's values, once per row, into a sum over every row.
        row_share = torch.exp(params.sink.to(torch.float32)[:, None] - lse) * delta
        dsink = (-row_share.sum(-1).reshape(-1, lse.shape[-2]).sum(0)).to(params.sink.dtype)
    return dq, dk, dv, dsink


def _triton_dkdv_dq(dout, q, k, v, out, lse, delta, dlse, params: AttentionParams, dq, dk, dv,
                    tiles, one_key_zero: bool):
    """dQ and dK, dV in this file's kernels, the dQ programs then the dK/dV programs. delta:
    float32 laid out like lse, which the dQ programs fill; dlse None or laid out like delta.
    one_key_zero: the kernels' ONE_KEY_ZERO (no sink and no lse gradient)."""
    f = kernel_features(params, q, v, lse, q.dtype, flags=GRADIENT_FLAGS)
    head_dim, head_dim_v = f.head_dim, f.head_dim_v
    block_d, block_dv = padded_head_dim(head_dim), padded_head_dim(head_dim_v)
    d_max = max(head_dim, head_dim_v)
    has_variant = params.variant is not None
    block_m1, block_n1, num_warps, num_stages = tiles.get("dkdv") or tile_config(
        "dkdv", d_max, q.element_size(), interpreting(), has_variant)
    block_m2, block_n2, dq_warps, dq_stages = tiles.get("dq") or tile_config(
        "dq", d_max, q.element_size(), interpreting(), has_variant)
    score_mod_args, mask_mod_args, packing, variant = variant_args(params)
    grad_args, captured_grad = captured_grad_args(params)
    kv_blocks, sparse = block_args(params, lse)
    q_blocks, _ = block_args(params, lse, transposed=True)
    if sparse["SPARSE"]:  # the kernels' tiles must divide the block mask's
        block_m1, block_m2 = (min(b, sparse["SPARSE_Q"]) for b in (block_m1, block_m2))
        block_n1, block_n2 = (min(b, sparse["SPARSE_KV"]) for b in (block_n1, block_n2))
    num_kv_blocks, num_q_blocks = cdiv(f.seqlen_k, block_n1), cdiv(f.seqlen_q, block_m2)
    tensors = (q, k, v, out, dout, lse, delta, delta if dlse is None else dlse, dq, dk, dv,
               f.score_tensors, *f.cu_seqlens, *kv_blocks[:4], *q_blocks[:4])
    scalars = (*(stride for t in (q, k, v, out, dout, lse, delta, dq, dk, dv)
                 for stride in f.strides(t)),
               f.batch, f.nheads, f.nheads_k, *f.band, f.score_values, params.softmax_scale,
               *f.dropout, num_kv_blocks, num_q_blocks, score_mod_args, mask_mod_args, grad_args,
               packing, *kv_blocks[4:], *q_blocks[4:])
    varlen = f.varlen
    meta = dict(HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv,
                BLOCK_M1=block_m1, BLOCK_N1=block_n1, BLOCK_M2=block_m2, BLOCK_N2=block_n2,
                **f.flags, ONE_KEY_ZERO=one_key_zero)
    sink = params.sink is not None
    even_m = not varlen and f.seqlen_q % block_m2 == 0
    even_n = not varlen and f.seqlen_k % block_n1 == 0
    launches = {"dkdv": (num_kv_blocks, num_warps, num_stages),
                "dq": (num_q_blocks, dq_warps, dq_stages)}
    for part in ("dq", "dkdv"):  # dQ first: it stores the delta the dK/dV programs read
        programs, warps, stages = launches[part]
        do_dkdv = part == "dkdv"
        # constexprs in the kernel's signature order (launch passes them positionally)
        launch(_bwd_kernel, (programs, *fold(f.batch * f.nheads)), tensors, scalars,
               dict(meta, SINK=sink and not do_dkdv, LSE_GRAD=dlse is not None and not do_dkdv,
                    EVEN_M=even_m, EVEN_N=even_n,
                    DO_DKDV=do_dkdv, PRECISION=DOT_PRECISION,
                    **variant, **captured_grad, **sparse), _BWD_TENSORS, num_warps=warps,
               num_stages=stages)
