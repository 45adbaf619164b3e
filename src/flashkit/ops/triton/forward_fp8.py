"""FP8 attention forward (float8_e4m3fn or float8_e5m2 q, k, v; bf16 out) in Triton.

Notation as in common.py, whose mask predicate, tile ranges, scores, ALiBi and online-softmax
helpers this kernel calls. One program owns BLOCK_M query rows of one (batch, head) and streams
the key/value tiles its band reaches (masked tiles, the unmasked middle, masked tiles), as the
16-bit forward in forward.py does. Forward only: there is no FP8 backward.

Scales (FA3's convention): the real inputs are q = q8 * q_descale, k = k8 * k_descale,
v = v8 * v_descale, each descale float32 per tensor or per (batch, head). Then
scale * q . k = (scale * q_descale * k_descale) * q8 . k8, so the two descales fold into the
score scale (qk_scale, or softcap_scale under a softcap), and v_descale into the output's last
scaling: out = v_descale * acc / (P_SCALE * l).

P in fp8: P = exp2(s - m) lies in [0, 1]; cast as is, e4m3 would flush every P below 2^-10 to
zero. P_SCALE (a power of two, so exact) lifts it to the top of the format before the cast:
2^8 for e4m3 (largest finite 448), 2^15 for e5m2 (largest finite 57344). l sums the unrounded
fp32 P, as in FA3.

Why V is read key-major: sm_90's wgmma takes fp8 operands from shared memory only K-major (the
reduction axis contiguous). For S = Q K^T the reduction axis is d, contiguous in q and k as
given. For O = P V it is the key axis, which the flash-attn layout strides by nheads_k * d_v.
Triton 3.6 still emits wgmma for that layout, but transposes every V tile in registers (byte
permutes in the sm_90 PTX) on its way to shared memory, off the asynchronous copy path. So the
launcher reads V through a view whose key axis has stride 1 (the Triton tutorial's fused
attention does the same for its float8_e5m2 forward): free when the caller's v already is such
a view, else one copy of V (key_major).

Layouts: q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv) with v.stride(1) == 1 after
key_major, out (b, sq, h, dv) bf16, lse (b, h, sq) float32 natural log. Descales: q_descale
(b, h) (the launcher expands FA3's (b, hk) and (1,)), k_descale and v_descale (b, hk) or (1,)
(batch and head strides 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashkit.fp8 import key_major_empty
from flashkit.ops.params import AttentionParams
from flashkit.ops.triton import interpreter
from flashkit.ops.triton.common import (
    LOG2E_JIT,
    cdiv,
    descaled_mods,
    head_ptr,
    interpreting,
    key_tile_ranges,
    load_score_mods,
    load_tile,
    online_softmax_update,
    score_mod,
    softmax_denominator,
    softmax_lse,
    softmax_start,
    store_tile,
    tile_ptrs,
    visible,
)
from flashkit.ops.triton.features import DENSE_FLAGS, kernel_features
from flashkit.ops.triton.launch import settle_cache_keys

interpreter.patch_float8_casts()

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# P's scale before its cast to fp8: the largest power of two at or below the format's largest
# finite value, so P * P_SCALE <= that value (see the module docstring).
P_SCALE = {torch.float8_e4m3fn: 256.0, torch.float8_e5m2: 32768.0}

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim on sm_90 (registers from an offline
# sm_90 compile). Softmax, not the fp8 matmuls, bounds a tile at small head dims, and one CTA's
# warpgroups run its phases in step: only a second CTA on the SM overlaps one's exps with the
# other's wgmma, so the register count per thread (64K registers per SM) decides the speed.
# benchmarks/suites/fp8.py sweeps the alternatives at d64 and d128.
TILES = {
    # one warpgroup, 168 registers full and causal, no spill: 3 CTAs per SM. H200, 16k
    # tokens, one run: 489 / 471 TFLOP/s full / causal, (128, 64, 8, 3) 454 / 442
    64: (64, 128, 4, 3),
    128: (128, 128, 8, 3),  # 211 registers, K and V tiles both through cp.async
    256: (128, 64, 8, 3),  # 234 registers (BLOCK_N 128: 255 and spills)
}
INTERPRETER_TILE = (32, 32, 1, 1)  # CPU tests: small tiles exercise every loop split
MIN_BLOCK_D = 32  # fp8 wgmma reduces over 32 elements at a time


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             params: AttentionParams) -> str | None:
    """None when this kernel computes the call, else why not (a phrase naming the feature)."""
    if q.dtype not in FLOAT8_DTYPES:
        return f"inputs are {q.dtype}, not float8"
    if not interpreting():
        if not q.is_cuda:
            return "float8 attention runs on CUDA tensors"
        if torch.cuda.get_device_capability(q.device) < (8, 9):
            return "float8 matmuls need a GPU of compute capability 8.9 or newer"
    if params.dropout_p > 0:
        return "dropout is not supported with float8 inputs (forward only, inference)"
    if params.is_varlen:
        return "varlen (packed) inputs are not supported with float8 inputs"
    if params.attn_bias is not None:
        return "attn_mask is not supported with float8 inputs"
    return None


def tile_for(head_dim: int) -> tuple[int, int, int, int]:
    """The tile of a (padded) head dim: the table's row for the smallest entry that holds it."""
    if interpreting():
        return INTERPRETER_TILE
    return TILES[min(d for d in TILES if d >= head_dim)]


@triton.jit
def _fp8_tiles(acc, m_i, l_i, q_tile, k_base, v_base, stride_ks, stride_kd, stride_vs,
               stride_vd, start, end, offs_m, offs_d, offs_dv, band, mods,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, P_SCALE: tl.constexpr,
               MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               SCORES: tl.constexpr):
    """Stream key tiles [start, end) into (acc, m_i, l_i); MASKED applies the band predicate.
    acc holds sum P_SCALE * P V8 in fp32, in the scale of the running max m_i. band and mods
    as common.score_mod."""
    seqlen_q, seqlen_k, window_left, window_right = band
    for start_n in tl.range(start, end, BLOCK_N):
        # every tile that runs starts at a multiple of BLOCK_N (common.key_tile_ranges)
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_tile = load_tile(tile_ptrs(k_base, offs_n, offs_d, stride_ks, stride_kd), offs_n,
                           seqlen_k, offs_d, HEAD_DIM, MASKED, HEAD_DIM != BLOCK_D)
        # [BLOCK_M, BLOCK_N] = [BLOCK_M, BLOCK_D] @ [BLOCK_D, BLOCK_N], fp8 in, fp32 out
        qk = tl.dot(q_tile, tl.trans(k_tile))
        s, _ = score_mod(qk, offs_m[:, None], offs_n[None, :], band, mods, SCORES)
        if MASKED:
            keep = visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left,
                           window_right, HAS_LEFT, HAS_RIGHT)
            s = tl.where(keep, s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_update(m_i, l_i, s, MASKED)
        # [BLOCK_N, BLOCK_DV], key axis contiguous in memory (stride_vs == 1): K-major for wgmma
        v_tile = load_tile(tile_ptrs(v_base, offs_n, offs_dv, stride_vs, stride_vd), offs_n,
                           seqlen_k, offs_dv, HEAD_DIM_V, MASKED, HEAD_DIM_V != BLOCK_DV)
        # [BLOCK_M, BLOCK_DV] = [BLOCK_M, BLOCK_N] @ [BLOCK_N, BLOCK_DV], fp8 in, fp32 out
        acc = tl.dot((p * P_SCALE).to(v_tile.dtype), v_tile, acc * alpha[:, None])
    return acc, m_i, l_i


@triton.jit
def _fp8_fwd_kernel(Q, K, V, Out, Lse, Q_descale, K_descale, V_descale,
                    stride_qb, stride_qs, stride_qh, stride_qd,
                    stride_kb, stride_ks, stride_kh, stride_kd,
                    stride_vb, stride_vs, stride_vh, stride_vd,
                    stride_ob, stride_os, stride_oh, stride_od,
                    stride_lb, stride_lh, stride_ls,
                    stride_qdb, stride_qdh, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
                    nheads, group, seqlen_q, seqlen_k, window_left, window_right, ScoreTensors,
                    score_values, Sink,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    P_SCALE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    SCORES: tl.constexpr, SINK: tl.constexpr,
                    EVEN_M: tl.constexpr):
    """SINK: one logit per query head joins every row's denominator (m = sink, l = 1 at the
    start), as in forward.py."""
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

    # The descales fold into the score modifiers' multiplier of q . k (common.descaled_mods).
    qk_descale = (tl.load(Q_descale + off_b * stride_qdb + off_h * stride_qdh)
                  * tl.load(K_descale + off_b * stride_kdb + off_hk * stride_kdh))
    mods = descaled_mods(load_score_mods(ScoreTensors, score_values, off_b, off_h, SCORES),
                         qk_descale, SCORES)
    v_descale = tl.load(V_descale + off_b * stride_vdb + off_hk * stride_vdh)

    q_ptrs = tile_ptrs(head_ptr(Q, off_b, off_h, 0, stride_qb, stride_qh, stride_qs),
                       offs_m, offs_d, stride_qs, stride_qd)
    q_tile = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, not EVEN_M,
                       HEAD_DIM != BLOCK_D)
    k_base = head_ptr(K, off_b, off_hk, 0, stride_kb, stride_kh, stride_ks)
    v_base = head_ptr(V, off_b, off_hk, 0, stride_vb, stride_vh, stride_vs)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINK:
        m_i, l_i = softmax_start(m_i, l_i, tl.load(Sink + off_h) * LOG2E_JIT)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = key_tile_ranges(start_m, seqlen_q, seqlen_k, window_left,
                                             window_right, BLOCK_M, BLOCK_N, HAS_LEFT,
                                             HAS_RIGHT)
    bounds = (lo, mid_lo, mid_hi, hi)
    for segment in tl.static_range(3):  # masked edge, unmasked middle, masked edge
        acc, m_i, l_i = _fp8_tiles(acc, m_i, l_i, q_tile, k_base, v_base, stride_ks, stride_kd,
                                   stride_vs, stride_vd, bounds[segment], bounds[segment + 1],
                                   offs_m, offs_d, offs_dv,
                                   (seqlen_q, seqlen_k, window_left, window_right), mods,
                                   HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, P_SCALE,
                                   segment != 1, HAS_LEFT, HAS_RIGHT, SCORES)

    has_mass = l_i > 0.0
    l_safe = softmax_denominator(l_i)
    out_tile = acc * (v_descale / P_SCALE) / l_safe[:, None]
    lse = softmax_lse(m_i, has_mass, l_safe)

    o_ptrs = tile_ptrs(head_ptr(Out, off_b, off_h, 0, stride_ob, stride_oh, stride_os),
                       offs_m, offs_dv, stride_os, stride_od)
    store_tile(o_ptrs, out_tile.to(Out.dtype.element_ty), offs_m, seqlen_q, offs_dv, HEAD_DIM_V,
               not EVEN_M, HEAD_DIM_V != BLOCK_DV)
    lse_ptrs = head_ptr(Lse, off_b, off_h, 0, stride_lb, stride_lh, stride_ls) + offs_m * stride_ls
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)


def key_major(v: torch.Tensor) -> torch.Tensor:
    """v (batch, seqlen_k, nheads_k, d_v) as a view with the key axis contiguous (stride 1):
    v itself when it already is one (flashkit.fp8.quantize(v, key_major=True) makes it so),
    else a copy in fp8.key_major_empty's layout."""
    if v.stride(1) == 1:
        return v
    return key_major_empty(v.shape, v.dtype, v.device).copy_(v)


def descale_args(descale: torch.Tensor | None, heads: int, group: int, placeholder):
    """(tensor, stride_batch, stride_head) of a float32 descale for a kernel that indexes it by
    `heads` heads: None reads 1.0 from `placeholder`; (1,) gets strides 0; a (batch, heads //
    group) q_descale (FA3's shape: one per kv head) is repeated over each group's query heads."""
    if descale is None:
        return placeholder, 0, 0
    if descale.dim() == 1:
        return descale, 0, 0
    if descale.shape[1] != heads:
        descale = descale.repeat_interleave(group, dim=1)
    return descale, descale.stride(0), descale.stride(1)


@triton.jit
def _fp8_scores_kernel(Q, K, S, stride_qb, stride_qs, stride_qh, stride_qd, stride_kb, stride_ks,
                       stride_kh, stride_kd, stride_sb, stride_sh, stride_sm, nheads, group,
                       seqlen_q, seqlen_k, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """S[b, h, m, n] = q8[b, m, h] . k8[b, n, h // group] for a [BLOCK_M, BLOCK_N] block, with
    the forward kernel's own dot (_fp8_tiles: the head dim zero-padded to BLOCK_D, one tl.dot)."""
    off_bh = tl.program_id(2)
    off_b, off_h = off_bh // nheads, off_bh % nheads
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = head_ptr(Q, off_b, off_h, 0, stride_qb, stride_qh, stride_qs)
    k_base = head_ptr(K, off_b, off_h // group, 0, stride_kb, stride_kh, stride_ks)
    q_tile = load_tile(tile_ptrs(q_base, offs_m, offs_d, stride_qs, stride_qd), offs_m, seqlen_q,
                       offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)
    k_tile = load_tile(tile_ptrs(k_base, offs_n, offs_d, stride_ks, stride_kd), offs_n, seqlen_k,
                       offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)
    s = tl.dot(q_tile, tl.trans(k_tile))
    s_base = S + off_b * stride_sb + off_h * stride_sh
    tl.store(tile_ptrs(s_base, offs_m, offs_n, stride_sm, 1), s,
             mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k))


def tensor_core_scores(q8: torch.Tensor, k8: torch.Tensor) -> torch.Tensor:
    """q8 . k8 per head, (batch, nheads, seqlen_q, seqlen_k) float32, summed by the FP8 tensor
    cores exactly as the forward kernel sums its scores (the same dot over the same padded head
    dim; each score's reduction does not depend on the tile around it). The testing baseline
    (flashkit.fp8.rounded_reference) takes its scores from here on a GPU: no model of the
    accumulator reproduces the hardware's rounding bit for bit."""
    batch, seqlen_q, nheads, head_dim = q8.shape
    seqlen_k, nheads_k = k8.shape[1], k8.shape[2]
    s = torch.empty((batch, nheads, seqlen_q, seqlen_k), dtype=torch.float32, device=q8.device)
    block_m = block_n = 64
    grid = (cdiv(seqlen_q, block_m), cdiv(seqlen_k, block_n), batch * nheads)
    settle_cache_keys(_fp8_scores_kernel)
    _fp8_scores_kernel[grid](q8, k8, s, *q8.stride(), *k8.stride(), *s.stride()[:3], nheads,
                             nheads // nheads_k, seqlen_q, seqlen_k, HEAD_DIM=head_dim,
                             BLOCK_D=max(MIN_BLOCK_D, triton.next_power_of_2(head_dim)),
                             BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    return s


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams,
                      q_descale: torch.Tensor | None = None,
                      k_descale: torch.Tensor | None = None,
                      v_descale: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                      tile: tuple[int, int, int, int] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the FP8 forward. Returns (out bf16, lse float32); out/lse may be preallocated.

    q, k, v share one float8 dtype (checked by the API); descales are float32 (1,) or
    (batch, nheads_k), q_descale also (batch, nheads); None means 1. tile = (BLOCK_M, BLOCK_N,
    num_warps, num_stages) overrides the table (the benchmark's sweep).
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_k, head_dim_v = v.shape
    group = nheads // nheads_k
    if out is None:
        out = torch.empty((batch, seqlen_q, nheads, head_dim_v), dtype=torch.bfloat16,
                          device=q.device)
    if lse is None:
        lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    block_d = max(MIN_BLOCK_D, triton.next_power_of_2(head_dim))
    block_dv = max(MIN_BLOCK_D, triton.next_power_of_2(head_dim_v))
    block_m, block_n, num_warps, num_stages = tile or tile_for(max(block_d, block_dv))
    v = key_major(v)
    one = torch.ones(1, dtype=torch.float32, device=q.device)
    q_desc = descale_args(q_descale, nheads, group, one)
    k_desc = descale_args(k_descale, nheads_k, 1, one)
    v_desc = descale_args(v_descale, nheads_k, 1, one)
    f = kernel_features(params, q, v, lse, flags=DENSE_FLAGS)  # dtype None: exact tanh
    grid = (cdiv(seqlen_q, block_m), batch * nheads)
    settle_cache_keys(_fp8_fwd_kernel)
    _fp8_fwd_kernel[grid](
        q, k, v, out, lse, q_desc[0], k_desc[0], v_desc[0],
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        *q_desc[1:], *k_desc[1:], *v_desc[1:],
        nheads, group, *f.band, f.score_tensors, f.score_values, f.sink,
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_M=block_m, BLOCK_N=block_n, P_SCALE=P_SCALE[q.dtype],
        **f.flags, EVEN_M=seqlen_q % block_m == 0, num_warps=num_warps,
        num_stages=num_stages)
    return out, lse
