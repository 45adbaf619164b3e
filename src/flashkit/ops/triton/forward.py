"""FlashAttention-2 forward in Triton: kernel and host launcher.

Notation as in common.py. One program owns BLOCK_M query rows of one (batch, head) and streams
the key/value tiles its band reaches: first the masked tiles left of the fully visible middle
(a bounded left window only), then the unmasked middle (FA2's off-diagonal tiles), then the
masked tiles on and right of the diagonal. Scores live in log2 units so the softmax is exp2.

Layouts (flash-attn): q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv), out (b, sq, h, dv),
lse (b, h, sq) float32, natural log. Every stride is passed, so strided views cost no copy
(Triton specialises a stride of 1 at compile time, which keeps the loads vectorised).
Precision: bf16/fp16 dots accumulate in fp32; fp32 inputs use IEEE fp32 dots (no tf32).
Features as compile-time flags: SOFTCAP and ALIBI change the scores (common.scores,
common.alibi_bias), SINK starts the online softmax from the sink logit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashkit.ops.params import AttentionParams
from flashkit.ops.triton.common import (
    DOT_PRECISION,
    LN2_JIT,
    LOG2E_JIT,
    alibi_args,
    alibi_bias,
    interpreting,
    key_tile_ranges,
    kv_descriptor,
    load_alibi_log2,
    load_kv_tile,
    load_tile,
    online_softmax_update,
    score_args,
    scores,
    store_tile,
    visible,
    window_args,
)
from flashkit.ops.triton.configs import USE_TMA, padded_head_dim, tile_config


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q_tile, k_src, v_src, off_b, off_hk, stride_ks, stride_kd,
               stride_vs, stride_vd, start, end, offs_m, offs_d, offs_dv, seqlen_q, seqlen_k,
               window_left, window_right, qk_scale, softcap_scale, alibi_log2,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
               ALIBI: tl.constexpr,
               USE_TMA: tl.constexpr,
               PRECISION: tl.constexpr):
    """Stream key tiles [start, end) into (acc, m_i, l_i); MASKED applies the band predicate."""
    for start_n in tl.range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_tile = load_kv_tile(k_src, off_b, off_hk, start_n, offs_n, seqlen_k, offs_d,
                              stride_ks, stride_kd, HEAD_DIM, BLOCK_N, BLOCK_D, MASKED, USE_TMA)
        # [BLOCK_M, BLOCK_N] = [BLOCK_M, BLOCK_D] @ [BLOCK_D, BLOCK_N]
        qk = tl.dot(q_tile, tl.trans(k_tile), input_precision=PRECISION)
        s = scores(qk, qk_scale, softcap_scale, SOFTCAP)
        if ALIBI:
            s = s - alibi_bias(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, alibi_log2)
        if MASKED:
            keep = visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left,
                           window_right, HAS_LEFT, HAS_RIGHT)
            s = tl.where(keep, s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_update(m_i, l_i, s, MASKED)
        v_tile = load_kv_tile(v_src, off_b, off_hk, start_n, offs_n, seqlen_k, offs_dv,
                              stride_vs, stride_vd, HEAD_DIM_V, BLOCK_N, BLOCK_DV, MASKED,
                              USE_TMA)
        # [BLOCK_M, BLOCK_DV] = [BLOCK_M, BLOCK_N] @ [BLOCK_N, BLOCK_DV]
        acc = tl.dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(Q, K, V, Out, Lse,
                stride_qb, stride_qs, stride_qh, stride_qd,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd,
                stride_ob, stride_os, stride_oh, stride_od,
                stride_lb, stride_lh, stride_ls,
                nheads, group, seqlen_q, seqlen_k, window_left, window_right, qk_scale,
                softcap_scale, Alibi, stride_ab, stride_ah, Sink,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                ALIBI: tl.constexpr, SINK: tl.constexpr, EVEN_M: tl.constexpr,
                USE_TMA: tl.constexpr, PRECISION: tl.constexpr):
    """K and V are tensor descriptors when USE_TMA (see common.kv_descriptor), else pointers.
    SINK: Sink holds one logit per query head that joins every row's denominator: the online
    softmax starts from it (m = sink, l = 1) instead of from nothing (m = -inf, l = 0)."""
    # Heaviest query tiles first: under a causal band the last rows see the most keys.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // nheads).to(tl.int64)
    off_h = (pid_bh % nheads).to(tl.int64)
    off_hk = off_h // group  # GQA: query head h reads kv head h // group
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_ptrs = (Q + off_b * stride_qb + off_h * stride_qh
              + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd)
    q_tile = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, not EVEN_M,
                       HEAD_DIM != BLOCK_D)
    if USE_TMA:
        k_src = K
        v_src = V
    else:
        k_src = K + off_b * stride_kb + off_hk * stride_kh
        v_src = V + off_b * stride_vb + off_hk * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINK:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(Sink + off_h) * LOG2E_JIT
        l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    alibi_log2 = load_alibi_log2(Alibi, off_b, off_h, stride_ab, stride_ah, ALIBI)

    lo, mid_lo, mid_hi, hi = key_tile_ranges(start_m, seqlen_q, seqlen_k, window_left,
                                             window_right, BLOCK_M, BLOCK_N, HAS_LEFT,
                                             HAS_RIGHT)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q_tile, k_src, v_src, off_b, off_hk,
                               stride_ks, stride_kd, stride_vs, stride_vd, lo, mid_lo, offs_m,
                               offs_d, offs_dv, seqlen_q, seqlen_k, window_left, window_right,
                               qk_scale, softcap_scale, alibi_log2,
                               HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True,
                               HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, USE_TMA, PRECISION)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q_tile, k_src, v_src, off_b, off_hk,
                               stride_ks, stride_kd, stride_vs, stride_vd, mid_lo, mid_hi, offs_m,
                               offs_d, offs_dv, seqlen_q, seqlen_k, window_left, window_right,
                               qk_scale, softcap_scale, alibi_log2,
                               HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, False,
                               HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, USE_TMA, PRECISION)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q_tile, k_src, v_src, off_b, off_hk,
                               stride_ks, stride_kd, stride_vs, stride_vd, mid_hi, hi, offs_m,
                               offs_d, offs_dv, seqlen_q, seqlen_k, window_left, window_right,
                               qk_scale, softcap_scale, alibi_log2,
                               HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True,
                               HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, USE_TMA, PRECISION)

    # A row that saw no key (and no sink) has l = 0: out = 0 (acc is 0) and lse = -inf, never
    # NaN; with a sink it has l = 1 and lse = sink.
    has_mass = l_i > 0.0
    l_safe = tl.where(has_mass, l_i, 1.0)
    out_tile = acc / l_safe[:, None]
    lse = tl.where(has_mass, (m_i + tl.math.log2(l_safe)) * LN2_JIT, float("-inf"))

    o_ptrs = (Out + off_b * stride_ob + off_h * stride_oh
              + offs_m[:, None] * stride_os + offs_dv[None, :] * stride_od)
    store_tile(o_ptrs, out_tile.to(Out.dtype.element_ty), offs_m, seqlen_q, offs_dv, HEAD_DIM_V,
               not EVEN_M, HEAD_DIM_V != BLOCK_DV)
    lse_ptrs = Lse + off_b * stride_lb + off_h * stride_lh + offs_m * stride_ls
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      params: AttentionParams, out: torch.Tensor | None = None,
                      lse: torch.Tensor | None = None,
                      tile: tuple[int, int, int, int] | None = None, use_tma: bool = USE_TMA
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. Returns (out, lse); out/lse may be given preallocated.

    tile = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides configs.py (the tuning sweep);
    use_tma=False keeps K/V loads on pointers even where a TMA descriptor would do.
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_k, head_dim_v = v.shape
    if out is None:
        out_dtype = torch.float32 if params.fp32_out else q.dtype
        out = torch.empty((batch, seqlen_q, nheads, head_dim_v), dtype=out_dtype, device=q.device)
    if lse is None:
        lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    block_m, block_n, num_warps, num_stages = tile or tile_config(
        "forward", max(head_dim, head_dim_v), q.element_size(), interpreting())
    window_left, window_right, has_left, has_right = window_args(params)
    qk_scale, softcap_scale, softcap = score_args(params)
    alibi, alibi_strides, has_alibi = alibi_args(params, lse)
    sink = lse if params.sink is None else params.sink.to(torch.float32)
    block_d, block_dv = padded_head_dim(head_dim), padded_head_dim(head_dim_v)
    k_desc, v_desc = kv_descriptor(k, block_n, block_d), kv_descriptor(v, block_n, block_dv)
    use_tma = use_tma and k_desc is not None and v_desc is not None
    grid = (triton.cdiv(seqlen_q, block_m), batch * nheads)
    _fwd_kernel[grid](
        q, k_desc if use_tma else k, v_desc if use_tma else v, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        nheads, nheads // nheads_k, seqlen_q, seqlen_k, window_left, window_right,
        qk_scale, softcap_scale, alibi, *alibi_strides, sink,
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_LEFT=has_left, HAS_RIGHT=has_right,
        SOFTCAP=softcap, ALIBI=has_alibi, SINK=params.sink is not None,
        EVEN_M=seqlen_q % block_m == 0, USE_TMA=use_tma, PRECISION=DOT_PRECISION,
        num_warps=num_warps, num_stages=num_stages)
    return out, lse
