"""FlashAttention-2 forward in Triton: kernel and host launcher.

Notation as in common.py. One program owns BLOCK_M query rows of one (batch, head) and streams
the key/value tiles its band reaches: first the masked tiles left of the fully visible middle
(a bounded left window only), then the unmasked middle (FA2's off-diagonal tiles), then the
masked tiles on and right of the diagonal. Scores live in log2 units (fp32: natural, see
common.py) so the softmax is exp2.

Layouts (flash-attn): q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv), out (b, sq, h, dv),
lse (b, h, sq) float32, natural log. Every stride is passed, so strided views cost no copy
(Triton specialises a stride of 1 at compile time, which keeps the loads vectorised).
Precision: bf16/fp16 dots accumulate in fp32; fp32 inputs use IEEE fp32 dots (no tf32).
Features as compile-time flags: SCORES = (SOFTCAP, ALIBI) change the scores (common.score_mod,
their values in the score_values and ScoreTensors bundles), SINK starts the online softmax from
the sink logit, DROPOUT zeroes the dropped probabilities before the P @ V product (l and lse stay
pre-dropout) and scales the output by 1 / (1 - p), VARLEN reads each sequence's rows and
lengths from cu_seqlens (common.sequence).
Varlen layouts: q (total_q, h, d), k/v (total_k, hk, d), out like q, lse (h, total_q).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashkit.ops.params import AttentionParams, lse_shape
from flashkit.ops.triton.common import (
    DOT_PRECISION,
    LOG2E_JIT,
    block_args,
    cdiv,
    head_ptr,
    interpreting,
    key_tile_ranges,
    load_score_mods,
    load_tile,
    masked_values_product,
    mod_indices,
    online_softmax_update,
    score_mod,
    sequence,
    softmax_denominator,
    softmax_lse,
    softmax_start,
    store_tile,
    tile_ptrs,
    user_score,
    user_visible,
    variant_args,
    visible,
)
from flashkit.ops.triton.configs import padded_head_dim, tile_config
from flashkit.ops.triton.dropout import dropout_keep
from flashkit.ops.triton.features import kernel_features
from flashkit.ops.triton.launch import fold, launch


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q_tile, kv, start, end, offs, band, mods, drop, variant,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SCORES: tl.constexpr,
               DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
               SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, PACKED: tl.constexpr,
               LISTED: tl.constexpr = False, SPAN: tl.constexpr = 1):
    """Stream key tiles [start, end) into (acc, m_i, l_i); MASKED applies the band predicate.
    kv = (k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd) of this (batch, kv head);
    offs = (offs_m, offs_d, offs_dv); band and mods as common.score_mod; drop = (seed_lo,
    seed_hi, threshold, off_b, off_h) of the keep-mask. DROPOUT: l sums every probability, acc
    only the kept ones (the 1 / (1 - p) comes last). variant = (score_args, mask_args, packing,
    Blocks) of a user score_mod / mask_mod (SCORE_MOD, MASK_MOD; MASKED applies MASK_MOD too;
    PACKED: packing as common.mod_indices) and a block mask: LISTED, [start, end) counts keys
    of the SPAN-key blocks listed at Blocks, position t being key Blocks[t // SPAN] * SPAN +
    t % SPAN, one loop over every listed block so the software pipeline runs across them."""
    k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd = kv
    offs_m, offs_d, offs_dv = offs
    seqlen_q, seqlen_k, window_left, window_right = band
    seed_lo, seed_hi, dropout_threshold, off_b, off_h = drop
    score_args, mask_args, packing, Blocks = variant
    for pos in tl.range(start, end, BLOCK_N):
        start_n = pos
        if LISTED:
            start_n = tl.load(Blocks + pos // SPAN) * SPAN + pos % SPAN
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_tile = load_tile(tile_ptrs(k_base, offs_n, offs_d, stride_ks, stride_kd), offs_n,
                           seqlen_k, offs_d, HEAD_DIM, MASKED, HEAD_DIM != BLOCK_D)
        # [BLOCK_M, BLOCK_N] = [BLOCK_M, BLOCK_D] @ [BLOCK_D, BLOCK_N]
        qk = tl.dot(q_tile, tl.trans(k_tile), input_precision=PRECISION)
        s, _ = score_mod(qk, offs_m[:, None], offs_n[None, :], band, mods, SCORES)
        mod_b, mod_i, mod_j, mod_lq, mod_lk, same = mod_indices(
            off_b, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, packing, PACKED)
        if SCORE_MOD is not None:
            s = user_score(s, mod_b, off_h, mod_i, mod_j, mod_lq, mod_lk, SCORE_MOD, score_args,
                           q_tile.dtype == tl.float32)
        if MASKED:
            keep = visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left,
                           window_right, HAS_LEFT, HAS_RIGHT)
            if PACKED:
                keep = keep & same
            if MASK_MOD is not None:
                keep = keep & user_visible(mod_b, off_h, mod_i, mod_j, mod_lq, mod_lk,
                                           MASK_MOD, mask_args)
            s = tl.where(keep, s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_update(m_i, l_i, s, MASKED,
                                                   q_tile.dtype == tl.float32)
        if DROPOUT:
            p = tl.where(dropout_keep(seed_lo, seed_hi, off_b, off_h, offs_m, start_n,
                                      dropout_threshold, BLOCK_N), p, 0.0)
        v_tile = load_tile(tile_ptrs(v_base, offs_n, offs_dv, stride_vs, stride_vd), offs_n,
                           seqlen_k, offs_dv, HEAD_DIM_V, MASKED, HEAD_DIM_V != BLOCK_DV)
        acc = acc * alpha[:, None]
        if MASKED:
            acc = masked_values_product(acc, p, s, v_tile, PRECISION)
        else:
            # [BLOCK_M, BLOCK_DV] = [BLOCK_M, BLOCK_N] @ [BLOCK_N, BLOCK_DV]
            acc = tl.dot(p.to(v_tile.dtype), v_tile, acc, input_precision=PRECISION)
    return acc, m_i, l_i


# Not specialised on: the dropout seed (new every call) and the block mask's length-dependent
# sizes, so a variant at a new length keeps its kernel
@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "dropout_threshold", "stride_sb",
                               "stride_sh", "n_kv_blocks"])
def _fwd_kernel(Q, K, V, Out, Lse,
                stride_qb, stride_qs, stride_qh, stride_qd,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd,
                stride_ob, stride_os, stride_oh, stride_od,
                stride_lb, stride_lh, stride_ls,
                nheads, group, seqlen_q, seqlen_k, window_left, window_right, ScoreTensors,
                score_values, Sink, seed_lo, seed_hi,
                dropout_threshold, dropout_scale, Cu_q, Cu_k, score_args, mask_args, packing,
                KvNum, KvIdx, FullNum, FullIdx, stride_sb, stride_sh, n_kv_blocks,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SCORES: tl.constexpr,
                SINK: tl.constexpr, DROPOUT: tl.constexpr,
                VARLEN: tl.constexpr, EVEN_M: tl.constexpr, PRECISION: tl.constexpr,
                SCORE_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, MASK_MOD: tl.constexpr,
                PACKED: tl.constexpr, SPARSE: tl.constexpr, SPARSE_Q: tl.constexpr,
                SPARSE_KV: tl.constexpr):
    """SINK: Sink holds one logit per query head that joins every row's denominator
    (common.softmax_start). VARLEN: the grid covers the longest sequence; blocks past a shorter
    one's end return. SCORE_MOD / MASK_MOD: user modifiers (common.user_score / user_visible);
    a MASK_MOD masks every tile. SPARSE: the key blocks come from a block mask
    (flashkit.variants.BlockMask): the row of query block start_m // SPARSE_Q lists its partial
    blocks (masked) and its full blocks (no mask at all); causal/window never come with one.
    PACKED: that block mask is over varlen's packed tokens, run here as one sequence
    (common.mod_indices). SCORE_GRAD is unused here."""
    # Heaviest query tiles first: under a causal band the last rows see the most keys.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)  # launch.fold
    off_b = (pid_bh // nheads).to(tl.int64)
    off_h = (pid_bh % nheads).to(tl.int64)
    off_hk = off_h // group  # GQA: query head h reads kv head h // group
    q_start, k_start, seqlen_q, seqlen_k = sequence(off_b, seqlen_q, seqlen_k, Cu_q, Cu_k,
                                                    VARLEN)
    NATURAL: tl.constexpr = Q.dtype.element_ty == tl.float32  # common.py's notation
    start_m = pid_m * BLOCK_M
    if VARLEN:
        if start_m >= seqlen_q:
            return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_ptrs = tile_ptrs(head_ptr(Q, off_b, off_h, q_start, stride_qb, stride_qh, stride_qs),
                       offs_m, offs_d, stride_qs, stride_qd)
    q_tile = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, not EVEN_M,
                       HEAD_DIM != BLOCK_D)
    k_base = head_ptr(K, off_b, off_hk, k_start, stride_kb, stride_kh, stride_ks)
    v_base = head_ptr(V, off_b, off_hk, k_start, stride_vb, stride_vh, stride_vs)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINK:
        sink = tl.load(Sink + off_h)
        if not NATURAL:
            sink = sink * LOG2E_JIT
        m_i, l_i = softmax_start(m_i, l_i, sink)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    mods = load_score_mods(ScoreTensors, score_values, off_b, off_h, SCORES, NATURAL)

    lo, mid_lo, mid_hi, hi = key_tile_ranges(start_m, seqlen_q, seqlen_k, window_left,
                                             window_right, BLOCK_M, BLOCK_N, HAS_LEFT,
                                             HAS_RIGHT)
    kv = (k_base, v_base, stride_ks, stride_kd, stride_vs, stride_vd)
    offs = (offs_m, offs_d, offs_dv)
    band = (seqlen_q, seqlen_k, window_left, window_right)
    drop = (seed_lo, seed_hi, dropout_threshold, off_b, off_h)
    if SPARSE:  # the block mask's lists replace the band's ranges
        row = off_b * stride_sb + off_h * stride_sh + start_m // SPARSE_Q
        for listed in tl.static_range(2):  # partial key blocks (masked), then full ones
            Num = KvNum if listed == 0 else FullNum
            Idx = KvIdx if listed == 0 else FullIdx
            acc, m_i, l_i = _fwd_tiles(
                acc, m_i, l_i, q_tile, kv, 0, tl.load(Num + row) * SPARSE_KV, offs, band, mods,
                drop, (score_args, mask_args, packing, Idx + row * n_kv_blocks), HEAD_DIM,
                HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, listed == 0, HAS_LEFT, HAS_RIGHT,
                SCORES, DROPOUT, PRECISION, SCORE_MOD, MASK_MOD, PACKED, True, SPARSE_KV)
        lo, mid_lo, mid_hi, hi = 0, 0, 0, 0
    bounds = (lo, mid_lo, mid_hi, hi)
    for segment in tl.static_range(3):  # masked edge, unmasked middle, masked edge
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q_tile, kv, bounds[segment],
                                   bounds[segment + 1], offs, band, mods, drop,
                                   (score_args, mask_args, packing, KvIdx), HEAD_DIM,
                                   HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N,
                                   segment != 1 or MASK_MOD is not None, HAS_LEFT, HAS_RIGHT,
                                   SCORES, DROPOUT, PRECISION, SCORE_MOD, MASK_MOD, PACKED)

    has_mass = l_i > 0.0
    l_safe = softmax_denominator(l_i)
    if DROPOUT:
        acc = acc * dropout_scale
    out_tile = acc / l_safe[:, None]
    lse = softmax_lse(m_i, has_mass, l_safe, NATURAL)

    o_ptrs = tile_ptrs(head_ptr(Out, off_b, off_h, q_start, stride_ob, stride_oh, stride_os),
                       offs_m, offs_dv, stride_os, stride_od)
    store_tile(o_ptrs, out_tile.to(Out.dtype.element_ty), offs_m, seqlen_q, offs_dv, HEAD_DIM_V,
               not EVEN_M, HEAD_DIM_V != BLOCK_DV)
    lse_ptrs = (head_ptr(Lse, off_b, off_h, q_start, stride_lb, stride_lh, stride_ls)
                + offs_m * stride_ls)
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)


_TENSORS = ("Q", "K", "V", "Out", "Lse", "ScoreTensors", "Sink", "Cu_q", "Cu_k", "KvNum", "KvIdx",
            "FullNum", "FullIdx")  # launch's order


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      params: AttentionParams, out: torch.Tensor | None = None,
                      lse: torch.Tensor | None = None,
                      tile: tuple[int, int, int, int] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch this file's forward kernel (dispatch.forward_call chooses it or the Gluon one).
    Returns (out, lse); out/lse may be given preallocated.

    tile = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides configs.SM90 (the tuning sweep).
    """
    if lse is None:
        lse = torch.empty(lse_shape(q, params), dtype=torch.float32, device=q.device)
    f = kernel_features(params, q, v, lse, q.dtype)
    head_dim, head_dim_v = f.head_dim, f.head_dim_v
    if out is None:
        out = torch.empty((*q.shape[:-1], head_dim_v), dtype=q.dtype, device=q.device)
    # dropout takes the plain tiles: its keep-mask is drawn in the scores' own layout, so it
    # needs no shared memory (sm90 probe: 229376 bytes at d128, as without dropout)
    block_m, block_n, num_warps, num_stages = tile or tile_config(
        "forward", max(head_dim, head_dim_v), q.element_size(), interpreting(),
        params.variant is not None)
    score_mod_args, mask_mod_args, packing, variant = variant_args(params)
    blocks, sparse = block_args(params, lse)
    if sparse["SPARSE"]:  # the kernel's tiles must divide the block mask's
        block_m, block_n = min(block_m, sparse["SPARSE_Q"]), min(block_n, sparse["SPARSE_KV"])
    block_d, block_dv = padded_head_dim(head_dim), padded_head_dim(head_dim_v)
    grid = (cdiv(f.seqlen_q, block_m), *fold(f.batch * f.nheads))
    launch(_fwd_kernel, grid, (q, k, v, out, lse, f.score_tensors, f.sink, *f.cu_seqlens,
                               *blocks[:4]), (
        *f.strides(q), *f.strides(k), *f.strides(v), *f.strides(out), *f.strides(lse),
        f.nheads, f.nheads // f.nheads_k, *f.band, f.score_values, *f.dropout,
        score_mod_args, mask_mod_args, packing, *blocks[4:]), dict(
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_M=block_m, BLOCK_N=block_n, **f.flags,
        EVEN_M=not f.varlen and f.seqlen_q % block_m == 0, PRECISION=DOT_PRECISION,
        **variant, **sparse), _TENSORS, num_warps=num_warps, num_stages=num_stages)
    return out, lse
