"""Split-KV attention over a (paged) KV cache in Triton: a decode kernel and an lse merge kernel.

Notation as in common.py, plus:
    b, hk        the batch row and kv head of a program
    r            packed query row r = t * group + g: query position t in [0, seqlen_q) of head
                 h = hk * group + g. A program holds BLOCK_M packed rows, so the K/V tiles of a
                 kv head are read once for its whole query group (GQA/MQA decoding is memory
                 bound: every K/V byte should be loaded once)
    seqlen_k     L_b, keys of sequence b (from SeqlensK); shift = L_b - seqlen_q
    slot         where key j lives: contiguous caches row CacheBatchIdx[b], slot Leftpad[b] + j;
                 paged caches page BlockTable[b, j // PAGE_SIZE], slot j % PAGE_SIZE (BLOCK_N
                 divides PAGE_SIZE, so one page per key tile)
    split        program axis 0: keys [split * chunk, (split + 1) * chunk), chunk a multiple of
                 BLOCK_N; each split writes a partial (out, lse) that _merge_kernel combines:
                 lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s
    sink         a logit without a value, in split 0's starting state (m = sink, l = 1)

Layouts: q (b, sq, h, d); caches (rows | pages, slots, hk, d); out (b, sq, h, dv); lse (b, h, sq)
float32. Partial results (num_splits > 1): out_part (S, b, sq, h, dv), lse_part (S, b, h, sq)
float32. Only key slots below L_b are read, so block_table entries past a sequence's last page
are never touched.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flashkit.ops.params import AttentionParams
from flashkit.ops.triton.common import (
    DOT_PRECISION,
    LN2_JIT,
    LOG2E_JIT,
    interpreting,
    online_softmax_update,
    visible,
    window_args,
)
from flashkit.ops.triton.configs import padded_head_dim

# (BLOCK_M, BLOCK_N, num_warps, num_stages) by whether the packed query rows fit one 16-row
# tile (decoding) or not (prefill). HOPPER decode: the most even of the 27 tiles that
# `benchmarks/bench_decode.py --sweep` timed (benchmarks/results/decode_20261121T022233.json,
# bf16, d128, H200: 85-110% of copy bandwidth at b16/16k GQA 8:1 and b64/8k MHA; the old
# (64, 4, 4) gave 74% on the first). Prefill: not swept. INTERPRETER: tiny tiles so CPU tests
# at ~50 keys cross tiles, pages and splits.
HOPPER = {"decode": (16, 64, 4, 3), "prefill": (64, 64, 4, 3)}
INTERPRETER = {"decode": (16, 16, 1, 1), "prefill": (16, 16, 1, 1)}
MIN_KEYS_PER_SPLIT = 256  # auto num_splits never makes a split shorter than this


@triton.jit
def _key_tile(acc, m_i, l_i, q_tile, start_n, hi, k_base, v_base, slot0, K, V, table_row,
              stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, off_kh, off_vh,
              offs_t, offs_d, offs_dv, slopes, seqlen_q, seqlen_k, shift, window_left,
              window_right, qk_scale, softcap,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
              PAGE_SIZE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, PRECISION: tl.constexpr):
    """Fold key tile [start_n, start_n + BLOCK_N) (keys >= hi masked) into (acc, m_i, l_i)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if PAGE_SIZE == 0:
        slots = slot0 + offs_n
    else:  # BLOCK_N divides PAGE_SIZE: the whole tile sits in one page
        page = tl.load(table_row + start_n // PAGE_SIZE, mask=start_n < hi, other=0)
        k_base = K + page.to(tl.int64) * stride_kb + off_kh
        v_base = V + page.to(tl.int64) * stride_vb + off_vh
        slots = start_n % PAGE_SIZE + tl.arange(0, BLOCK_N)
    key_ok = offs_n < hi
    k_tile = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                     mask=key_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    # [BLOCK_M, BLOCK_N] = [BLOCK_M, BLOCK_D] @ [BLOCK_D, BLOCK_N]
    s = tl.dot(q_tile, tl.trans(k_tile), input_precision=PRECISION)
    if HAS_SOFTCAP:  # cap * tanh(scale * qk / cap), tanh(x) = 1 - 2 / (exp(2x) + 1)
        x = s * (qk_scale / softcap)
        s = softcap * LOG2E_JIT * (1.0 - 2.0 / (tl.math.exp2(2.0 * LOG2E_JIT * x) + 1.0))
    else:
        s = s * (qk_scale * LOG2E_JIT)
    if HAS_ALIBI:
        dist = tl.abs(offs_t[:, None] + shift - offs_n[None, :]).to(tl.float32)
        s = s - slopes[:, None] * dist
    keep = visible(offs_t[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left,
                   window_right, HAS_LEFT, HAS_RIGHT) & key_ok[None, :]
    s = tl.where(keep, s, float("-inf"))
    p, alpha, m_i, l_i = online_softmax_update(m_i, l_i, s, True)
    v_tile = tl.load(v_base + slots[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
                     mask=key_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    # [BLOCK_M, BLOCK_DV] = [BLOCK_M, BLOCK_N] @ [BLOCK_N, BLOCK_DV]
    acc = tl.dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_i, l_i


@triton.jit
def _decode_kernel(Q, K, V, Out, Lse, BlockTable, CacheBatchIdx, Leftpad, SeqlensK, Slopes, Sink,
                   stride_qb, stride_qs, stride_qh, stride_qd,
                   stride_kb, stride_ks, stride_kh, stride_kd,
                   stride_vb, stride_vs, stride_vh, stride_vd,
                   stride_osplit, stride_ob, stride_os, stride_oh, stride_od,
                   stride_lsplit, stride_lb, stride_lh, stride_ls,
                   stride_bt, stride_slopes_b,
                   nheads_k, group, seqlen_q, num_splits, window_left, window_right, qk_scale,
                   softcap,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINK: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid_split = tl.program_id(0)
    pid_bhk = tl.program_id(1)
    pid_m = tl.program_id(2)
    off_b = pid_bhk // nheads_k
    off_hk = pid_bhk % nheads_k
    seqlen_k = tl.load(SeqlensK + off_b)
    shift = seqlen_k - seqlen_q

    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed rows
    row_ok = offs_r < seqlen_q * group
    offs_t = offs_r // group  # query position of each row
    offs_h = off_hk * group + offs_r % group  # query head of each row
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    off_b64 = off_b.to(tl.int64)

    q_ptrs = (Q + off_b64 * stride_qb + offs_t[:, None] * stride_qs + offs_h[:, None] * stride_qh
              + offs_d[None, :] * stride_qd)
    q_tile = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)

    # This split's keys, narrowed to the band of the rows' query positions [t_lo, t_hi].
    blocks_per_split = tl.cdiv(tl.cdiv(seqlen_k, BLOCK_N), num_splits)
    lo = pid_split * blocks_per_split * BLOCK_N
    hi = tl.minimum(lo + blocks_per_split * BLOCK_N, seqlen_k)
    t_lo = pid_m * BLOCK_M // group
    t_hi = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // group, seqlen_q - 1)
    if HAS_LEFT:
        lo = tl.maximum(lo, tl.maximum(t_lo + shift - window_left, 0) // BLOCK_N * BLOCK_N)
    if HAS_RIGHT:
        hi = tl.minimum(hi, t_hi + shift + window_right + 1)

    slopes = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slopes = tl.load(Slopes + off_b * stride_slopes_b + offs_h, mask=row_ok,
                         other=0.0) * LOG2E_JIT
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINK:
        if pid_split == 0:
            m_i = tl.load(Sink + offs_h, mask=row_ok, other=0.0).to(tl.float32) * LOG2E_JIT
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Contiguous: the sequence's cache row and first slot; paged: the tile finds its page.
    k_base = K + off_hk * stride_kh
    v_base = V + off_hk * stride_vh
    slot0 = 0
    if PAGE_SIZE == 0:
        row = tl.load(CacheBatchIdx + off_b).to(tl.int64)
        k_base += row * stride_kb
        v_base += row * stride_vb
        slot0 = tl.load(Leftpad + off_b)
    table_row = BlockTable + off_b * stride_bt
    for start_n in tl.range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _key_tile(
            acc, m_i, l_i, q_tile, start_n, hi, k_base, v_base, slot0, K, V, table_row,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
            off_hk * stride_kh, off_hk * stride_vh, offs_t, offs_d, offs_dv, slopes,
            seqlen_q, seqlen_k, shift, window_left, window_right, qk_scale, softcap,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, PAGE_SIZE, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
            HAS_ALIBI, PRECISION)

    # A row with no mass (no visible key in this split, no sink) gives out 0 and lse -inf.
    has_mass = l_i > 0.0
    l_safe = tl.where(has_mass, l_i, 1.0)
    out_tile = acc / l_safe[:, None]
    lse = tl.where(has_mass, (m_i + tl.math.log2(l_safe)) * LN2_JIT, float("-inf"))
    o_ptrs = (Out + pid_split * stride_osplit + off_b64 * stride_ob + offs_t[:, None] * stride_os
              + offs_h[:, None] * stride_oh + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, out_tile.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    l_ptrs = (Lse + pid_split * stride_lsplit + off_b64 * stride_lb + offs_h * stride_lh
              + offs_t * stride_ls)
    tl.store(l_ptrs, lse, mask=row_ok)


@triton.jit
def _merge_kernel(OutPart, LsePart, Out, Lse,
                  stride_psplit, stride_pb, stride_ps, stride_ph, stride_pd,
                  stride_lpsplit, stride_lpb, stride_lph, stride_lps,
                  stride_ob, stride_os, stride_oh, stride_od,
                  stride_lb, stride_lh, stride_ls,
                  nheads, seqlen_q, num_splits,
                  HEAD_DIM_V: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One program per query row (b, t, h): fold the splits' (out, lse) by their lse."""
    row = tl.program_id(0)
    off_h = row % nheads
    off_t = (row // nheads) % seqlen_q
    off_b = (row // (nheads * seqlen_q)).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    lse_s = tl.load(LsePart + offs_s * stride_lpsplit + off_b * stride_lpb + off_h * stride_lph
                    + off_t * stride_lps, mask=offs_s < num_splits, other=float("-inf"))
    lse_max = tl.max(lse_s, 0)
    lse_ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.math.exp2((lse_s - lse_ref) * LOG2E_JIT)  # [BLOCK_S], 0 for empty splits
    w_sum = tl.sum(w, 0)
    o_part = tl.load(OutPart + offs_s[:, None] * stride_psplit + off_b * stride_pb
                     + off_t * stride_ps + off_h * stride_ph + offs_dv[None, :] * stride_pd,
                     mask=(offs_s[:, None] < num_splits) & (offs_dv[None, :] < HEAD_DIM_V),
                     other=0.0)
    out = tl.sum(w[:, None] * o_part, 0) / tl.where(w_sum > 0.0, w_sum, 1.0)
    lse = tl.where(w_sum > 0.0, lse_ref + tl.math.log2(w_sum) * LN2_JIT, float("-inf"))
    tl.store(Out + off_b * stride_ob + off_t * stride_os + off_h * stride_oh
             + offs_dv * stride_od, out.to(Out.dtype.element_ty), mask=offs_dv < HEAD_DIM_V)
    tl.store(Lse + off_b * stride_lb + off_h * stride_lh + off_t * stride_ls, lse)


def tile_config(packed_rows: int, page_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_N divides a paged cache's page_size."""
    table = INTERPRETER if interpreting() else HOPPER
    block_m, block_n, warps, stages = table["decode" if packed_rows <= 16 else "prefill"]
    if page_size:
        block_n = min(block_n, page_size & -page_size)  # largest power of two dividing it
    return block_m, block_n, warps, stages


def auto_num_splits(programs: int, max_seqlen_k: int, device: torch.device) -> int:
    """Enough splits to give every SM about two programs, none shorter than MIN_KEYS_PER_SPLIT.

    Decoding at batch x nheads_k below the SM count leaves most of the GPU idle without splits;
    at or above it, splitting only adds the merge.
    """
    sms = _sm_count(device.index) if device.type == "cuda" else 4
    if programs >= sms:
        return 1
    by_occupancy = triton.cdiv(2 * sms, programs)
    by_length = max(1, max_seqlen_k // MIN_KEYS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, 128))


def check_supported(dtype: torch.dtype, params: AttentionParams) -> None:
    """NotImplementedError for what these kernels do not do (before the caller mutates the
    cache)."""
    if params.attn_bias is not None or params.dropout_p > 0:
        raise NotImplementedError("triton decode: attn_bias and dropout are not supported")
    if dtype == torch.float64:
        raise NotImplementedError("triton decode: float64 is not supported; use backend='torch'")


@functools.lru_cache
def _sm_count(index: int | None) -> int:
    index = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_properties(index).multi_processor_count


def forward(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table,
            params: AttentionParams, num_splits: int, max_seqlen_k: int | None = None, *,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """(out, lse) as flashkit.ops.tiled.kvcache.forward; num_splits 0 = auto_num_splits.
    max_seqlen_k (the longest seqlens_k) saves a device sync when auto splitting; out and lse
    may be given preallocated."""
    check_supported(q.dtype, params)
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k, head_dim_v = v_cache.shape[2], v_cache.shape[3]
    group = nheads // nheads_k
    page_size = 0 if block_table is None else k_cache.shape[1]
    block_m, block_n, num_warps, num_stages = tile_config(seqlen_q * group, page_size)
    m_blocks = triton.cdiv(seqlen_q * group, block_m)
    if num_splits == 0:
        if max_seqlen_k is None:
            max_seqlen_k = int(seqlens_k.max())
        num_splits = auto_num_splits(batch * nheads_k * m_blocks, max_seqlen_k, q.device)

    if out is None:
        out = torch.empty(batch, seqlen_q, nheads, head_dim_v, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(batch, nheads, seqlen_q, dtype=torch.float32, device=q.device)
    if num_splits == 1:
        out_part, lse_part = out[None], lse[None]
    else:
        out_part = torch.empty(num_splits, *out.shape, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(num_splits, *lse.shape, dtype=torch.float32, device=q.device)

    slopes = params.alibi_slopes
    window_left, window_right, has_left, has_right = window_args(params)
    dummy = seqlens_k  # stands in for absent pointer arguments; never read
    _decode_kernel[(num_splits, batch * nheads_k, m_blocks)](
        q, k_cache, v_cache, out_part, lse_part,
        dummy if block_table is None else block_table, cache_batch_idx, cache_leftpad,
        seqlens_k, dummy if slopes is None else slopes,
        dummy if params.sink is None else params.sink,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out_part.stride(),
        *lse_part.stride(), 0 if block_table is None else block_table.stride(0),
        slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0,
        nheads_k, group, seqlen_q, num_splits, window_left, window_right,
        params.softmax_scale, params.softcap,
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=padded_head_dim(head_dim),
        BLOCK_DV=padded_head_dim(head_dim_v), BLOCK_M=block_m, BLOCK_N=block_n,
        PAGE_SIZE=page_size, HAS_LEFT=has_left, HAS_RIGHT=has_right,
        HAS_SOFTCAP=params.softcap > 0, HAS_ALIBI=slopes is not None,
        HAS_SINK=params.sink is not None, PRECISION=DOT_PRECISION,
        num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _merge_kernel[(batch * seqlen_q * nheads,)](
            out_part, lse_part, out, lse, *out_part.stride(), *lse_part.stride(),
            *out.stride(), *lse.stride(), nheads, seqlen_q, num_splits,
            HEAD_DIM_V=head_dim_v, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            BLOCK_DV=padded_head_dim(head_dim_v), num_warps=4)
    return out, lse
