"""One Triton launch before attention: check the cache indices, rotate, append.

flash_attn_with_kvcache on CUDA tensors runs this instead of ~40 small tensor ops and a host
read of the index tensors (a device sync): a decoding loop pays one launch per call, and the
check needs no other graph node (no flag to fill beforehand, no torch._assert_async after).
A decoding step with the decode tile and few new keys does not launch it: the decode kernel
checks, rotates and appends itself (decode.Step, with this module's rotation and checks).

Notation as in decode.py, plus:
    n_b          cache_seqlens[b]: filled slots of sequence b before the append (a tensor, or
                 one int for every sequence: then no tensor is made for it)
    pos_b        n_b - leftpad_b: the keys sequence b holds before the append
    n_b          is also the rotary position of its first new token (absolute slots, as
                 flash-attn), and of its query rows [n_b, n_b + seqlen_q), or all at n_b (q_rows)
    program      (b, i): token i of the new keys (i < seqlen_new) is rotated and written; query
                 row i (i < seqlen_q) is rotated into q_out; program (b, 0) also checks
                 sequence b's indices and writes seqlens_k[b]
    checks       sequence b's scalars (0 <= n_b, n_b + seqlen_new <= capacity, 0 <= leftpad_b <=
                 n_b, the cache row in range, the rotary table long enough) and every
                 block-table entry of the pages it uses. Program (b, 0) checks them all and, if
                 one fails, stops the stream with a device-side assertion (compiled in with
                 debug=True: kernels queued behind it never run, and the CUDA context ends) and
                 writes seqlens_k[b] = -1 (the interpreter, which skips device assertions, leaves
                 that mark for tests). Every program checks the scalars and the page of the slot
                 it writes before it writes, so no write leaves the cache whatever the order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashkit.ops.triton.common import next_power_of_2
from flashkit.ops.triton.configs import padded_head_dim
from flashkit.ops.triton.launch import launch

TABLE_CHUNK = 1024  # block-table entries checked per step of program (b, 0)
ROW_ELEMENTS = 4096  # heads x BLOCK_D elements per rotation step (registers of 4 warps)
CHECK_MESSAGE = tl.constexpr(  # the device assertion of a failed index check
    "flash_attn_with_kvcache: cache_seqlens, cache_leftpad, cache_batch_idx, block_table or "
    "rotary_cos length out of range (nothing written out of bounds); sync_checks=True says "
    "which")


@triton.jit
def rotary_layout(offs_d, ROTARY_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """(partner, freq, first, rotated) of head dims offs_d: pairs (2f, 2f + 1) interleaved, else
    (f, f + ROTARY_HALF); x[d] becomes x[d] cos_f + sign_d x[partner_d] sin_f, sign -1 for a
    pair's first element; dims from 2 * ROTARY_HALF on are not rotated."""
    if INTERLEAVED:
        partner = offs_d ^ 1
        freq = offs_d // 2
        first = offs_d % 2 == 0
    else:
        partner = tl.where(offs_d < ROTARY_HALF, offs_d + ROTARY_HALF, offs_d - ROTARY_HALF)
        freq = offs_d % ROTARY_HALF if ROTARY_HALF > 0 else offs_d
        first = offs_d < ROTARY_HALF
    return partner, freq, first, offs_d < 2 * ROTARY_HALF


@triton.jit
def rotate(x, x_partner, cos, sin, first, rotated):
    """x rotated in float32 (as tiled.kvcache.rotary) where `rotated`, else x, in float32; cos,
    sin, first and rotated broadcast against x (cos/sin as loaded from the tables)."""
    sin = tl.where(first, -sin.to(tl.float32), sin.to(tl.float32))
    y = x.to(tl.float32) * cos.to(tl.float32) + x_partner.to(tl.float32) * sin
    return tl.where(rotated, y, x.to(tl.float32))


@triton.jit
def _rotate_heads(Src, Dst, nheads, stride_sh, stride_sd, stride_dh, stride_dd, cos_row, sin_row,
                  stride_cd, ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_H: tl.constexpr, ROTARY_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Dst[h, :] = Src[h, :] for every head, its first 2 * ROTARY_HALF dims rotated in float32
    by cos/sin (rows cos_row, sin_row), rounded once to Dst's dtype; nothing is written unless
    ok."""
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < HEAD_DIM
    partner, freq, first, rotated = rotary_layout(offs_d, ROTARY_HALF, INTERLEAVED)
    cos = tl.load(cos_row + freq * stride_cd, mask=rotated & ok, other=1.0)
    sin = tl.load(sin_row + freq * stride_cd, mask=rotated & ok, other=0.0)
    for h0 in range(0, nheads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = ok & (offs_h < nheads)[:, None] & in_d[None, :]
        src = Src + offs_h[:, None] * stride_sh
        x = tl.load(src + offs_d[None, :] * stride_sd, mask=mask, other=0.0)
        x_partner = tl.load(src + partner[None, :] * stride_sd, mask=mask & rotated[None, :],
                            other=0.0)
        # [BLOCK_H, BLOCK_D]: float32 as the torch path, rounded once to the cache's dtype
        y = rotate(x, x_partner, cos[None, :], sin[None, :], first[None, :], rotated[None, :])
        tl.store(Dst + offs_h[:, None] * stride_dh + offs_d[None, :] * stride_dd,
                 y.to(Dst.dtype.element_ty), mask=mask)


# Program (b, 0)'s device assertion needs debug=True; the overflow sanitiser that comes with it
# is turned off at launch (sanitize_overflow=False): index arithmetic stays as compiled before.
@triton.jit(debug=True)
def _append_kernel(Q, QOut, K, V, KCache, VCache, Cos, Sin, CacheSeqlens, CacheBatchIdx, Leftpad,
                   BlockTable, SeqlensK,
                   stride_qb, stride_qs, stride_qh, stride_qd,
                   stride_ob, stride_os, stride_oh, stride_od,
                   stride_kb, stride_ks, stride_kh, stride_kd,
                   stride_vb, stride_vs, stride_vh, stride_vd,
                   stride_kcb, stride_kcs, stride_kch, stride_kcd,
                   stride_vcb, stride_vcs, stride_vch, stride_vcd,
                   stride_cs, stride_cd, stride_bt,
                   nheads, nheads_k, seqlen_q, seqlen_new, q_rows, capacity, cache_rows,
                   table_width, seqlen_ro, seqlen_all,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HK: tl.constexpr,
                   ROTARY_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, SEQLENS_TENSOR: tl.constexpr,
                   HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
                   TABLE_CHUNK: tl.constexpr):
    off_b = tl.program_id(0)
    i = tl.program_id(1)
    n = tl.load(CacheSeqlens + off_b) if SEQLENS_TENSOR else seqlen_all
    pad = tl.load(Leftpad + off_b) if HAS_LEFTPAD else 0
    row = tl.load(CacheBatchIdx + off_b) if HAS_BATCH_IDX else off_b
    pos = n - pad
    total = n + seqlen_new
    ok = (n >= 0) & (total <= capacity) & (pad >= 0) & (pad <= n)
    if PAGE_SIZE == 0:
        ok = ok & (row >= 0) & (row < cache_rows)
    if ROTARY_HALF > 0:
        ok = ok & (n + tl.maximum(seqlen_new, q_rows) <= seqlen_ro)
    table_row = BlockTable + off_b.to(tl.int64) * stride_bt
    if i == 0:
        checked = ok
        if PAGE_SIZE > 0:  # every entry of the pages the sequence uses
            used = tl.cdiv(tl.minimum(tl.maximum(total, 0), table_width * PAGE_SIZE), PAGE_SIZE)
            bad_pages = 0
            for start in range(0, used, TABLE_CHUNK):
                offs_p = start + tl.arange(0, TABLE_CHUNK)
                pages = tl.load(table_row + offs_p, mask=offs_p < used, other=0)
                bad_pages += tl.sum(((pages < 0) | (pages >= cache_rows)).to(tl.int32), 0)
            checked = checked & (bad_pages == 0)
        tl.device_assert(checked, CHECK_MESSAGE)
        tl.store(SeqlensK + off_b, tl.where(checked, pos + seqlen_new, -1))

    if i < seqlen_new:  # new token i: rotate k into its cache slot, copy v
        slot = (n + i).to(tl.int64)
        if PAGE_SIZE == 0:
            slot_row = row.to(tl.int64)
        else:
            slot_row = tl.load(table_row + slot // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
            ok = ok & (slot_row >= 0) & (slot_row < cache_rows)
            slot = slot % PAGE_SIZE
        k_src = K + off_b.to(tl.int64) * stride_kb + i * stride_ks
        k_dst = KCache + slot_row * stride_kcb + slot * stride_kcs
        cos_row = Cos + (n + i) * stride_cs
        sin_row = Sin + (n + i) * stride_cs
        _rotate_heads(k_src, k_dst, nheads_k, stride_kh, stride_kd, stride_kch, stride_kcd,
                      cos_row, sin_row, stride_cd, ok, HEAD_DIM, BLOCK_D, BLOCK_HK, ROTARY_HALF,
                      INTERLEAVED)
        _rotate_heads(V + off_b.to(tl.int64) * stride_vb + i * stride_vs,
                      VCache + slot_row * stride_vcb + slot * stride_vcs, nheads_k, stride_vh,
                      stride_vd, stride_vch, stride_vcd, cos_row, sin_row, stride_cd, ok,
                      HEAD_DIM_V, BLOCK_DV, BLOCK_HK, 0, False)
    if ROTARY_HALF > 0:
        if i < seqlen_q:  # query row i, at n + i under a causal/local mask, else at n
            q_pos = n + tl.minimum(i, q_rows - 1)
            _rotate_heads(Q + off_b.to(tl.int64) * stride_qb + i * stride_qs,
                          QOut + off_b.to(tl.int64) * stride_ob + i * stride_os, nheads,
                          stride_qh, stride_qd, stride_oh, stride_od, Cos + q_pos * stride_cs,
                          Sin + q_pos * stride_cs, stride_cd, ok, HEAD_DIM, BLOCK_D, BLOCK_H,
                          ROTARY_HALF, INTERLEAVED)


def append(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, cache_batch_idx, cache_leftpad,
           block_table, q_rows: int, interleaved: bool):
    """(q rotated or q itself, seqlens_k int32 (b,)): checks, rotates q and the new k (with
    cos/sin), appends k, v in place at cache_seqlens. Shapes are checked by the caller; index
    values here (see the module docstring: a bad one asserts on the device, and its sequence's
    seqlens_k is -1).

    cache_seqlens: an int32 (b,) tensor or an int; cache_batch_idx / cache_leftpad may be None
    (rows 0..b-1, no padding); k, v may be None (no append; then cos is None too)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    seqlen_new = 0 if k is None else k.shape[1]
    page_size = 0 if block_table is None else k_cache.shape[1]
    capacity = k_cache.shape[1] if block_table is None else block_table.shape[1] * page_size
    table_width = 0 if block_table is None else block_table.shape[1]
    rotary_half = 0 if cos is None else cos.shape[1]
    q_out = q if cos is None else torch.empty_like(q)
    seqlens_k = torch.empty(batch, dtype=torch.int32, device=q.device)
    if k is None:  # strides of absent tensors: never read
        k, v = k_cache[:1, :0], v_cache[:1, :0]
    seqlens_tensor = isinstance(cache_seqlens, torch.Tensor)
    dummy = seqlens_k  # stands in for absent pointer arguments; never read
    block_d, block_dv = padded_head_dim(head_dim), padded_head_dim(head_dim_v)
    programs = max(1, seqlen_new, seqlen_q if cos is not None else 0)
    launch(_append_kernel, (batch, programs), (
        q, q_out, k, v, k_cache, v_cache, dummy if cos is None else cos,
        dummy if sin is None else sin, cache_seqlens if seqlens_tensor else dummy,
        dummy if cache_batch_idx is None else cache_batch_idx,
        dummy if cache_leftpad is None else cache_leftpad,
        dummy if block_table is None else block_table, seqlens_k), (
        *q.stride(), *q_out.stride(), *k.stride(), *v.stride(), *k_cache.stride(),
        *v_cache.stride(), *((0, 0) if cos is None else cos.stride()),
        0 if block_table is None else block_table.stride(0),
        nheads, nheads_k, seqlen_q, seqlen_new, q_rows, capacity, k_cache.shape[0],
        table_width, 0 if cos is None else cos.shape[0],
        0 if seqlens_tensor else int(cache_seqlens)), dict(
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_H=_block_heads(nheads, block_d), BLOCK_HK=_block_heads(nheads_k, block_d),
        ROTARY_HALF=rotary_half, INTERLEAVED=interleaved, PAGE_SIZE=page_size,
        SEQLENS_TENSOR=seqlens_tensor, HAS_BATCH_IDX=cache_batch_idx is not None,
        HAS_LEFTPAD=cache_leftpad is not None, TABLE_CHUNK=TABLE_CHUNK),
        num_warps=4, sanitize_overflow=False)
    return q_out, seqlens_k


def _block_heads(nheads: int, block_d: int) -> int:
    return min(next_power_of_2(nheads), max(1, ROW_ELEMENTS // block_d))
