"""Split-KV attention over a (paged) KV cache in Triton: a decode kernel and an lse merge kernel.

Notation as in common.py, plus:
    b, hk        the batch row and kv head of a program
    r            packed query row r = t * group + g: query position t in [0, seqlen_q) of head
                 h = hk * group + g. A program holds BLOCK_M packed rows, so the K/V tiles of a
                 kv head are read once for its whole query group (GQA/MQA decoding is memory
                 bound: every K/V byte should be loaded once)
    seqlen_k     L_b, keys of sequence b (from SeqlensK); shift = L_b - seqlen_q
    slot         where key j lives: contiguous caches row CacheBatchIdx[b] (b without it), slot
                 Leftpad[b] + j (j without it);
                 paged caches page BlockTable[b, j // PAGE_SIZE], slot j % PAGE_SIZE, looked up
                 per key row, so a key tile may span pages (any page size, any BLOCK_N)
    split        program axis 0: keys [split * chunk, (split + 1) * chunk), chunk a multiple of
                 BLOCK_N; each split writes a partial (out, lse) that _merge_kernel combines:
                 lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s
    tiles        a program's key tiles in three loops as in forward.py: masked tiles left of
                 the part every row sees whole (a left window), the unmasked middle, masked tiles
                 at the right end (the causal diagonal, a right window, the last partial tile)
    sink         a logit without a value, in split 0's starting state (m = sink, l = 1)

Layouts: q (b, sq, h, d); caches (rows | pages, slots, hk, d); out (b, sq, h, dv); lse (b, h, sq)
float32. Partial results (num_splits > 1): out_part (S, b, sq, h, dv), then lse_part (S, b, h,
sq), contiguous in one float32 buffer (Partials: one allocation; the kernels find lse_part at an
element offset). With one split the decode kernel writes out and lse directly (split stride 0).
Only key slots below L_b are read, so block_table entries past a sequence's last page
are never touched. On Hopper the merge kernel is launched programmatically dependent (PDL): it
is scheduled while the decode kernel runs and waits for its results (griddepcontrol.wait)
instead of paying a launch after it.

A decoding step (Step, flash_attn_with_kvcache with up to STEP_MAX_NEW new keys and the
decode tile) is this kernel and the merge alone, as flash-attn's Append_KV: the decode kernel
checks the indices it uses as the append kernel does (append.py: the scalars, and every
block-table entry of the pages of its split's keys; a failed check fails a device-side assertion
that stops the stream, and the interpreter, which skips assertions, marks the program's out and
lse NaN for tests), rotates q, and the program whose split holds positions cache_seqlens[b] ..
+ seqlen_new rotates the new keys and writes them and the new values into the cache (a slot only
if its sequence's scalars and page pass), then reads them back from there after a barrier: no
other program reads those slots, so there is no race and no append launch. Before the
assertion can stop anything the reads stay in bounds (a sequence with a bad scalar reads no key,
block-table entries are clamped into the cache). Sequences sharing a cache row through a
duplicated cache_batch_idx may see each other's appended keys or not (flash-attn has the same
race). Longer appends and wider query tiles take the append kernel first.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.errors import OutOfResources

from flashkit.ops.params import AttentionParams
from flashkit.ops.triton.append import CHECK_MESSAGE, TABLE_CHUNK, rotary_layout, rotate
from flashkit.ops.triton.common import (
    DOT_PRECISION,
    LN2_JIT,
    LOG2E_JIT,
    cdiv,
    interpreting,
    load_score_mods,
    load_tile,
    masked_values_product,
    next_power_of_2,
    online_softmax_update,
    score_mod,
    softmax_start,
    visible,
)
from flashkit.ops.triton.configs import padded_head_dim
from flashkit.ops.triton.configs.decode import (
    CAP_LIFT_PER_SM,
    DECODE_INTERPRETER,
    DECODE_SM90,
    DENSE_MIN_KEYS,
    FILL_EFFICIENCY,
    FULL_SMS,
    LAUNCH_PDL,
    MAX_SPLITS,
    MERGE_BLOCK_DV,
    PAGE_TILE_EXTRA_STAGES,
    PAGE_TILE_LOOKUP,
    PAGED_EXTRA_STAGES,
    SHORT_SPLIT_TILES,
    STEP_MAX_NEW,
    Tile,
)
from flashkit.ops.triton.features import DENSE_FLAGS, cuts_left, feature_tensors, kernel_features
from flashkit.ops.triton.launch import Prepared, device_facts, fold, planned, specialisation


@triton.jit
def _cache_rows(page_keys, offs_n, hi, stride_kb, stride_ks, stride_vb, stride_vs, slot0,
                table_row, num_pages, PAGE_SIZE: tl.constexpr, MASK_ENTRIES: tl.constexpr,
                CLAMP_PAGES: tl.constexpr):
    """Element offsets of keys offs_n's K and V rows from the program's k_base / v_base.

    Contiguous: (slot0 + j) * stride_s. Paged: page(j) * stride_b + (j % PAGE_SIZE) * stride_s,
    page(j) read from the block table at page_keys, which broadcast against offs_n and name one
    key of each run of keys that lies in one page: offs_n itself (one entry per key row), each
    sub-tile's first key, or the tile's start (pages that BLOCK_N divides). MASK_ENTRIES: some
    page_keys may be >= hi, whose entries are not read (a tile's start never is). CLAMP_PAGES:
    entries clamped to [0, num_pages) (a step reads before the append kernel's check of the
    table has finished)."""
    if PAGE_SIZE == 0:
        slots = (slot0 + offs_n).to(tl.int64)  # slot * stride_s passes 2^31 in long caches
        k_rows = slots * stride_ks
        v_rows = slots * stride_vs
    else:
        if MASK_ENTRIES:
            page = tl.load(table_row + page_keys // PAGE_SIZE, mask=page_keys < hi, other=0)
        else:
            page = tl.load(table_row + page_keys // PAGE_SIZE)
        if CLAMP_PAGES:
            page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
        page = page.to(tl.int64)
        slots = offs_n % PAGE_SIZE
        k_rows = page * stride_kb + slots * stride_ks
        v_rows = page * stride_vb + slots * stride_vs
    return k_rows, v_rows


@triton.jit
def _key_tiles(acc, m_i, l_i, q_tile, keys, cache, offs, band, mods,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
               PAGE_PER_TILE: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
               HAS_RIGHT: tl.constexpr, CLAMP_PAGES: tl.constexpr, SCORES: tl.constexpr,
               PRECISION: tl.constexpr):
    """Fold key tiles [start, end) into (acc, m_i, l_i), keys = (start, end, hi). MASKED: keys
    >= hi and keys outside a row's band are masked; without it every key is in bounds and
    visible from every row.
    cache = (k_base, v_base, slot0, table_row, num_pages, stride_kb, stride_ks, stride_kd,
    stride_vb, stride_vs, stride_vd); offs = (offs_t, offs_d, offs_dv); band and mods as
    common.score_mod (mods' per-head values per row, [BLOCK_M, 1])."""
    start, end, hi = keys
    (k_base, v_base, slot0, table_row, num_pages, stride_kb, stride_ks, stride_kd, stride_vb,
     stride_vs, stride_vd) = cache
    offs_t, offs_d, offs_dv = offs
    seqlen_q, seqlen_k, window_left, window_right = band
    for start_n in tl.range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        page_keys = start_n if PAGE_PER_TILE else offs_n
        k_rows, v_rows = _cache_rows(page_keys, offs_n, hi, stride_kb, stride_ks, stride_vb,
                                     stride_vs, slot0, table_row, num_pages, PAGE_SIZE,
                                     MASKED and not PAGE_PER_TILE, CLAMP_PAGES)
        k_tile = load_tile(k_base + k_rows[:, None] + offs_d[None, :] * stride_kd, offs_n, hi,
                           offs_d, HEAD_DIM, MASKED, HEAD_DIM != BLOCK_D)
        # [BLOCK_M, BLOCK_N] = [BLOCK_M, BLOCK_D] @ [BLOCK_D, BLOCK_N]
        s, _ = score_mod(tl.dot(q_tile, tl.trans(k_tile), input_precision=PRECISION),
                         offs_t[:, None], offs_n[None, :], band, mods, SCORES)
        if MASKED:
            keep = visible(offs_t[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left,
                           window_right, HAS_LEFT, HAS_RIGHT) & (offs_n < hi)[None, :]
            s = tl.where(keep, s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_update(m_i, l_i, s, MASKED)
        v_tile = load_tile(v_base + v_rows[:, None] + offs_dv[None, :] * stride_vd, offs_n, hi,
                           offs_dv, HEAD_DIM_V, MASKED, HEAD_DIM_V != BLOCK_DV)
        acc = acc * alpha[:, None]
        if MASKED and (HAS_LEFT or HAS_RIGHT):  # rows of the tile see different keys
            acc = masked_values_product(acc, p, s, v_tile, PRECISION)
        else:
            # [BLOCK_M, BLOCK_DV] = [BLOCK_M, BLOCK_N] @ [BLOCK_N, BLOCK_DV]
            acc = tl.dot(p.to(v_tile.dtype), v_tile, acc, input_precision=PRECISION)
    return acc, m_i, l_i


@triton.jit
def _key_subtiles(acc, m_i, l_i, q_tile, keys, cache, offs, band, mods,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, SUBTILES: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, PAGE_PER_TILE: tl.constexpr, MASKED: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, CLAMP_PAGES: tl.constexpr,
                  SCORES: tl.constexpr, PRECISION: tl.constexpr):
    """_key_tiles with each key tile cut into SUBTILES sub-tiles of BLOCK_N // SUBTILES keys,
    sub-tile w folded into its own running state (acc [W, M, DV], m_i, l_i [W, M]) by a batched
    dot: on the GPU warp w owns sub-tile w, so nothing crosses warps inside the loop.
    q_tile: [W, M, D], the query tile broadcast to every sub-tile; mods' per-head values per
    row, [1, BLOCK_M, 1]."""
    start, end, hi = keys
    (k_base, v_base, slot0, table_row, num_pages, stride_kb, stride_ks, stride_kd, stride_vb,
     stride_vs, stride_vd) = cache
    offs_t, offs_d, offs_dv = offs
    seqlen_q, seqlen_k, window_left, window_right = band
    SUB_N: tl.constexpr = BLOCK_N // SUBTILES
    # [W, SUB_N]: key j of sub-tile w is start_n + w * SUB_N + j
    offs_wn = tl.arange(0, SUBTILES)[:, None] * SUB_N + tl.arange(0, SUB_N)[None, :]
    for start_n in tl.range(start, end, BLOCK_N):
        offs_n = start_n + offs_wn
        # One block-table entry per tile, or per sub-tile where SUB_N divides the page (a
        # sub-tile lies in one page), else one per key row
        if PAGE_PER_TILE:
            page_keys = start_n
        elif PAGE_SIZE % SUB_N == 0:
            page_keys = start_n + tl.arange(0, SUBTILES)[:, None] * SUB_N  # [W, 1]
        else:
            page_keys = offs_n
        k_rows, v_rows = _cache_rows(page_keys, offs_n, hi, stride_kb, stride_ks, stride_vb,
                                     stride_vs, slot0, table_row, num_pages, PAGE_SIZE,
                                     MASKED and not PAGE_PER_TILE, CLAMP_PAGES)
        k_tile = load_tile(k_base + k_rows[:, :, None] + offs_d[None, None, :] * stride_kd,
                           offs_n, hi, offs_d, HEAD_DIM, MASKED, HEAD_DIM != BLOCK_D)
        # [W, BLOCK_M, SUB_N] = [W, BLOCK_M, BLOCK_D] @ [W, BLOCK_D, SUB_N]
        s, _ = score_mod(tl.dot(q_tile, tl.trans(k_tile, (0, 2, 1)), input_precision=PRECISION),
                         offs_t[None, :, None], offs_n[:, None, :], band, mods, SCORES)
        if MASKED:
            keep = visible(offs_t[None, :, None], offs_n[:, None, :], seqlen_q, seqlen_k,
                           window_left, window_right, HAS_LEFT, HAS_RIGHT)
            keep = keep & (offs_n < hi)[:, None, :]
            s = tl.where(keep, s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_update(m_i, l_i, s, MASKED)
        v_tile = load_tile(v_base + v_rows[:, :, None] + offs_dv[None, None, :] * stride_vd,
                           offs_n, hi, offs_dv, HEAD_DIM_V, MASKED, HEAD_DIM_V != BLOCK_DV)
        acc = acc * alpha[:, :, None]
        if MASKED and (HAS_LEFT or HAS_RIGHT):  # rows of the tile see different keys
            acc = masked_values_product(acc, p, s, v_tile, PRECISION)
        else:
            # [W, BLOCK_M, BLOCK_DV] = [W, BLOCK_M, SUB_N] @ [W, SUB_N, BLOCK_DV]
            acc = tl.dot(p.to(v_tile.dtype), v_tile, acc, input_precision=PRECISION)
    return acc, m_i, l_i


@triton.jit
def _fold_subtiles(acc, m_i, l_i, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
                   SUBTILES: tl.constexpr):
    """One running state (acc [M, DV], m_i, l_i [M]) from the sub-tiles' ([W, M, DV], [W, M]):
    each rescaled to the rows' largest max. The sum over sub-tiles is taken in halves by
    tl.split (one layout change through shared memory, then adds in registers; tl.sum over the
    warps' axis compiled to ~1100 sm_90 instructions)."""
    m_new = tl.max(m_i, 0)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    scale = tl.math.exp2(m_i - m_use[None, :])  # [W, M], 0 for a sub-tile without mass
    l_new = tl.sum(l_i * scale, 0)
    part = tl.permute(acc * scale[:, :, None], (1, 2, 0))  # [M, DV, W]
    for level in tl.static_range(SUBTILES):  # log2(SUBTILES) halvings (a power of two)
        if (2 << level) <= SUBTILES:
            half0, half1 = tl.split(tl.reshape(part, (BLOCK_M, BLOCK_DV,
                                                      SUBTILES // (2 << level), 2)))
            part = half0 + half1
    return tl.reshape(part, (BLOCK_M, BLOCK_DV)), m_new, l_new


@triton.jit
def _key_ranges(lo, hi, t_lo, t_hi, shift, seqlen_k, window_left, window_right,
                BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """This program's key tiles as (lo, mid_lo, mid_hi, hi), lo <= mid_lo <= mid_hi <= hi.

    [lo, hi) is the split's chunk (lo a multiple of BLOCK_N) narrowed to the band of the rows'
    query positions [t_lo, t_hi]; tiles in [mid_lo, mid_hi) are in bounds and visible from every
    row, the others need the mask. Negative values truncate to 0 under Triton's C-style
    division; the clamps make that harmless."""
    full_lo = lo
    full_hi = seqlen_k
    if HAS_LEFT:
        lo = tl.maximum(lo, tl.maximum(t_lo + shift - window_left, 0) // BLOCK_N * BLOCK_N)
        full_lo = tl.maximum(lo, t_hi + shift - window_left)
    if HAS_RIGHT:
        hi = tl.minimum(hi, t_hi + shift + window_right + 1)
        full_hi = tl.minimum(full_hi, t_lo + shift + window_right + 1)
    hi = tl.maximum(hi, lo)
    mid_lo = tl.minimum(tl.cdiv(tl.maximum(full_lo, lo), BLOCK_N) * BLOCK_N, hi)
    mid_hi = tl.maximum(tl.minimum(full_hi, hi) // BLOCK_N * BLOCK_N, mid_lo)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _append_keys(KNew, VNew, k_base, v_base, Cos, Sin, j_lo, j_hi, first_new, ok, slot0,
                 table_row, num_pages, stride_nks, stride_nkd, stride_nvs, stride_nvd,
                 stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, stride_cs,
                 stride_cd, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_NEW: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, ROTARY_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """A step's new keys j in [j_lo, j_hi) (new token j - first_new; j_hi - j_lo <= BLOCK_NEW),
    k rotated at its slot slot0 + j as the append kernel rotates it (float32, rounded once), v
    copied, into the cache slots of keys j (as _cache_rows); nothing is written unless ok, nor
    to a page outside the cache. KNew, VNew: the program's (b, kv head) of k, v (b, s_new, hk,
    d)."""
    offs_j = j_lo + tl.arange(0, BLOCK_NEW)
    write = ok & (offs_j < j_hi)
    if PAGE_SIZE == 0:
        k_rows = (slot0 + offs_j) * stride_ks
        v_rows = (slot0 + offs_j) * stride_vs
    else:
        page = tl.load(table_row + offs_j // PAGE_SIZE, mask=write, other=0)
        write = write & (page >= 0) & (page < num_pages)
        page = page.to(tl.int64)
        k_rows = page * stride_kb + (offs_j % PAGE_SIZE) * stride_ks
        v_rows = page * stride_vb + (offs_j % PAGE_SIZE) * stride_vs
    offs_i = offs_j - first_new
    offs_d = tl.arange(0, BLOCK_D)
    mask = write[:, None] & (offs_d < HEAD_DIM)[None, :]
    k_src = KNew + offs_i[:, None] * stride_nks
    # [BLOCK_NEW, BLOCK_D]
    k_new = tl.load(k_src + offs_d[None, :] * stride_nkd, mask=mask, other=0.0)
    if ROTARY_HALF > 0:
        partner, freq, first, rotated = rotary_layout(offs_d, ROTARY_HALF, INTERLEAVED)
        rotated_2d = rotated[None, :]
        k_partner = tl.load(k_src + partner[None, :] * stride_nkd, mask=mask & rotated_2d,
                            other=0.0)
        table_offs = (slot0 + offs_j)[:, None] * stride_cs + freq[None, :] * stride_cd
        cos = tl.load(Cos + table_offs, mask=mask & rotated_2d, other=1.0)
        sin = tl.load(Sin + table_offs, mask=mask & rotated_2d, other=0.0)
        k_new = rotate(k_new, k_partner, cos, sin, first[None, :], rotated_2d)
    # v is loaded before k is stored: the compiler keeps a load after a store it cannot prove
    # disjoint, which made the v load a third dependent round trip ahead of the K/V tiles
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_v = write[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    v_new = tl.load(VNew + offs_i[:, None] * stride_nvs + offs_dv[None, :] * stride_nvd,
                    mask=mask_v, other=0.0)
    tl.store(k_base + k_rows[:, None] + offs_d[None, :] * stride_kd,
             k_new.to(k_base.dtype.element_ty), mask=mask)
    tl.store(v_base + v_rows[:, None] + offs_dv[None, :] * stride_vd, v_new, mask=mask_v)


@triton.jit
def _pages_ok(table_row, lo, hi, num_pages, PAGE_SIZE: tl.constexpr, TABLE_CHUNK: tl.constexpr):
    """Whether the block-table entries of the pages of keys [lo, hi) are in [0, num_pages)."""
    bad = 0
    p_hi = tl.cdiv(hi, PAGE_SIZE)
    for p_lo in range(lo // PAGE_SIZE, p_hi, TABLE_CHUNK):
        offs_p = p_lo + tl.arange(0, TABLE_CHUNK)
        pages = tl.load(table_row + offs_p, mask=offs_p < p_hi, other=0)
        bad += tl.sum(((pages < 0) | (pages >= num_pages)).to(tl.int32), 0)
    return bad == 0


# Not specialised on: a step's int cache_seqlens (a new value every step), so one launch plan
# serves the whole decoding loop
@triton.jit(do_not_specialize=["seqlen_fixed"])
def _decode_kernel(Q, K, V, Out, Lse, BlockTable, CacheBatchIdx, Leftpad, SeqlensK, ScoreTensors,
                   Sink, Cos, Sin, KNew, VNew,
                   stride_qb, stride_qs, stride_qh, stride_qd,
                   stride_kb, stride_ks, stride_kh, stride_kd,
                   stride_vb, stride_vs, stride_vh, stride_vd,
                   stride_osplit, stride_ob, stride_os, stride_oh, stride_od,
                   stride_lsplit, stride_lb, stride_lh, stride_ls, lse_offset,
                   stride_bt, stride_cs, stride_cd,
                   stride_nkb, stride_nks, stride_nkh, stride_nkd,
                   stride_nvb, stride_nvs, stride_nvh, stride_nvd,
                   nheads_k, group, seqlen_q, num_splits, window_left, window_right,
                   score_values, seqlen_fixed, seqlen_new, q_rows, capacity, cache_rows,
                   seqlen_ro,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   SUBTILES: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE_PER_TILE: tl.constexpr,
                   HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   SCORES: tl.constexpr, SINK: tl.constexpr,
                   USE_PDL: tl.constexpr, PRECISION: tl.constexpr, STEP: tl.constexpr,
                   SEQLENS_TENSOR: tl.constexpr, ROTARY_HALF: tl.constexpr,
                   INTERLEAVED: tl.constexpr, BLOCK_NEW: tl.constexpr,
                   TABLE_CHUNK: tl.constexpr):
    if USE_PDL:  # the merge kernel may be scheduled now; it waits for this grid's results
        gdc_launch_dependents()
    # (batch, kv head) folded into grid dims y and x (launch.fold), splits fastest along x
    pid_split = tl.program_id(0) % num_splits
    pid_bhk = tl.program_id(1) + tl.program_id(0) // num_splits * tl.num_programs(1)
    # Heaviest row tiles first: under a causal band the last query rows see the most keys.
    pid_m = tl.num_programs(2) - 1 - tl.program_id(2)
    off_b = pid_bhk // nheads_k
    off_hk = pid_bhk % nheads_k
    off_b64 = off_b.to(tl.int64)
    row = off_b64  # contiguous caches: the sequence's cache row and first slot
    slot0 = 0
    if PAGE_SIZE == 0:
        if HAS_BATCH_IDX:
            row = tl.load(CacheBatchIdx + off_b).to(tl.int64)
        if HAS_LEFTPAD:
            slot0 = tl.load(Leftpad + off_b)
    pos = 0
    rotary_pos = 0  # rotary position of the first new token: its absolute slot (flash-attn)
    ok = True
    if STEP:  # the append kernel's checks: nothing is read or written out of bounds
        n = tl.load(SeqlensK + off_b) if SEQLENS_TENSOR else seqlen_fixed
        pos = n - slot0
        rotary_pos = n
        ok = (n >= 0) & (n + seqlen_new <= capacity) & (slot0 >= 0) & (pos >= 0)
        if PAGE_SIZE == 0:
            ok = ok & (row >= 0) & (row < cache_rows)
        if ROTARY_HALF > 0:
            ok = ok & (n + tl.maximum(seqlen_new, q_rows) <= seqlen_ro)
        seqlen_k = tl.where(ok, pos + seqlen_new, 0)
    else:
        seqlen_k = tl.load(SeqlensK + off_b)
    shift = seqlen_k - seqlen_q

    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed rows
    row_ok = offs_r < seqlen_q * group
    offs_t = offs_r // group  # query position of each row
    offs_h = off_hk * group + offs_r % group  # query head of each row
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_rows_base = (Q + off_b64 * stride_qb + offs_t[:, None] * stride_qs
                   + offs_h[:, None] * stride_qh)
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_tile = tl.load(q_rows_base + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
    if ROTARY_HALF > 0:  # as the append kernel rotates q: row t at n + min(t, q_rows - 1)
        partner, freq, first, rotated = rotary_layout(offs_d, ROTARY_HALF, INTERLEAVED)
        rotated_2d = rotated[None, :]
        q_partner = tl.load(q_rows_base + partner[None, :] * stride_qd, mask=q_mask & rotated_2d,
                            other=0.0)
        table_offs = ((rotary_pos + tl.minimum(offs_t, q_rows - 1))[:, None] * stride_cs
                      + freq[None, :] * stride_cd)
        table_mask = q_mask & rotated_2d & ok
        cos = tl.load(Cos + table_offs, mask=table_mask, other=1.0)
        sin = tl.load(Sin + table_offs, mask=table_mask, other=0.0)
        q_tile = rotate(q_tile, q_partner, cos, sin, first[None, :],
                        rotated_2d).to(Q.dtype.element_ty)

    # This split's keys, narrowed to the band of the rows' query positions [t_lo, t_hi].
    blocks_per_split = tl.cdiv(tl.cdiv(seqlen_k, BLOCK_N), num_splits)
    chunk_lo = pid_split * blocks_per_split * BLOCK_N
    chunk_hi = tl.minimum(chunk_lo + blocks_per_split * BLOCK_N, seqlen_k)
    t_lo = pid_m * BLOCK_M // group
    t_hi = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // group, seqlen_q - 1)
    lo, mid_lo, mid_hi, hi = _key_ranges(chunk_lo, chunk_hi, t_lo, t_hi, shift, seqlen_k,
                                         window_left, window_right, BLOCK_N, HAS_LEFT,
                                         HAS_RIGHT)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINK:  # the first split's programs start from the sink (the merge adds no other)
        if pid_split == 0:
            m_i, l_i = softmax_start(
                m_i, l_i, tl.load(Sink + offs_h, mask=row_ok, other=0.0).to(tl.float32)
                * LOG2E_JIT)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Contiguous: the sequence's cache row and first slot; paged: each key row finds its page.
    k_base = K + off_hk * stride_kh
    v_base = V + off_hk * stride_vh
    if PAGE_SIZE == 0:
        k_base += row * stride_kb
        v_base += row * stride_vb
    table_row = BlockTable + off_b * stride_bt
    if STEP:  # the new keys of this split's chunk, written here and read back below
        first_new = seqlen_k - seqlen_new
        _append_keys(KNew + off_b64 * stride_nkb + off_hk * stride_nkh,
                     VNew + off_b64 * stride_nvb + off_hk * stride_nvh, k_base, v_base, Cos, Sin,
                     tl.maximum(chunk_lo, first_new), chunk_hi, first_new, ok, slot0, table_row,
                     cache_rows, stride_nks, stride_nkd, stride_nvs, stride_nvd, stride_kb,
                     stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, stride_cs, stride_cd,
                     HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_NEW, PAGE_SIZE, ROTARY_HALF,
                     INTERLEAVED)
        tl.debug_barrier()  # the CTA's writes are visible to its loads
    bounds = (lo, mid_lo, mid_hi, hi)
    cache = (k_base, v_base, slot0, table_row, cache_rows, stride_kb, stride_ks, stride_kd,
             stride_vb, stride_vs, stride_vd)
    offs = (offs_t, offs_d, offs_dv)
    band = (seqlen_q, seqlen_k, window_left, window_right)
    # Masked edge, unmasked middle, masked edge. Without a left window the left edge is empty
    # (lo is a multiple of BLOCK_N and mid_lo = lo) and not compiled: its loop's pipeline
    # prologue alone was ~215 sm_90 instructions per program.
    if SUBTILES == 1:
        mods = load_score_mods(ScoreTensors, score_values, off_b, offs_h[:, None], SCORES,
                               heads_ok=row_ok[:, None])
        for segment in tl.static_range(3):
            if segment != 0 or HAS_LEFT:
                acc, m_i, l_i = _key_tiles(
                    acc, m_i, l_i, q_tile, (bounds[segment], bounds[segment + 1], hi), cache,
                    offs, band, mods, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N,
                    PAGE_SIZE, PAGE_PER_TILE, segment != 1, HAS_LEFT, HAS_RIGHT, STEP, SCORES,
                    PRECISION)
    else:  # sub-tile 0 starts from the state above (the sink), the others empty
        mods = load_score_mods(ScoreTensors, score_values, off_b, offs_h[None, :, None],
                               SCORES, heads_ok=row_ok[None, :, None])
        first = (tl.arange(0, SUBTILES) == 0)[:, None]
        m_sub = tl.where(first, m_i[None, :], float("-inf"))
        l_sub = tl.where(first, l_i[None, :], 0.0)
        acc_sub = tl.zeros([SUBTILES, BLOCK_M, BLOCK_DV], dtype=tl.float32)
        q_sub = tl.broadcast_to(q_tile[None, :, :], (SUBTILES, BLOCK_M, BLOCK_D))
        for segment in tl.static_range(3):
            if segment != 0 or HAS_LEFT:
                acc_sub, m_sub, l_sub = _key_subtiles(
                    acc_sub, m_sub, l_sub, q_sub, (bounds[segment], bounds[segment + 1], hi),
                    cache, offs, band, mods, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N,
                    SUBTILES, PAGE_SIZE, PAGE_PER_TILE, segment != 1, HAS_LEFT, HAS_RIGHT, STEP,
                    SCORES, PRECISION)
        acc, m_i, l_i = _fold_subtiles(acc_sub, m_sub, l_sub, BLOCK_M, BLOCK_DV, SUBTILES)

    # A row with no mass (no visible key in this split, no sink) gives out 0 and lse -inf.
    # common.softmax_denominator / softmax_lse written out: through the helpers ptxas schedules
    # this kernel differently (same instruction count and registers; offline sm_90 SASS).
    has_mass = l_i > 0.0
    l_safe = tl.where(has_mass, l_i, 1.0)
    out_tile = acc / l_safe[:, None]
    lse = tl.where(has_mass, (m_i + tl.math.log2(l_safe)) * LN2_JIT, float("-inf"))
    if STEP:  # the checks of the indices this program used (module docstring)
        checked = ok
        if PAGE_SIZE > 0:
            checked = checked & _pages_ok(table_row, chunk_lo, chunk_hi, cache_rows, PAGE_SIZE,
                                          TABLE_CHUNK)
        tl.device_assert(checked, CHECK_MESSAGE)
        out_tile = tl.where(checked, out_tile, float("nan"))
        lse = tl.where(checked, lse, float("nan"))
    o_ptrs = (Out + pid_split * stride_osplit + off_b64 * stride_ob + offs_t[:, None] * stride_os
              + offs_h[:, None] * stride_oh + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, out_tile.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    l_ptrs = (Lse + lse_offset + pid_split * stride_lsplit + off_b64 * stride_lb
              + offs_h * stride_lh + offs_t * stride_ls)
    tl.store(l_ptrs, lse, mask=row_ok)


@triton.jit
def _merge_kernel(OutPart, LsePart, Out, Lse,
                  stride_psplit, stride_pb, stride_ps, stride_ph, stride_pd,
                  stride_lpsplit, stride_lpb, stride_lph, stride_lps, lse_part_offset,
                  stride_ob, stride_os, stride_oh, stride_od,
                  stride_lb, stride_lh, stride_ls,
                  nheads, seqlen_q, num_splits,
                  HEAD_DIM_V: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
                  USE_PDL: tl.constexpr):
    """One program per query row (b, t, h) and BLOCK_DV columns of its output (more, smaller
    programs: the merge is latency bound): fold the splits' (out, lse) by their lse."""
    if USE_PDL:  # launched early: wait until the decode grid's partials are complete
        gdc_wait()
    row = tl.program_id(0)
    pid_dv = tl.program_id(1)
    off_h = row % nheads
    off_t = (row // nheads) % seqlen_q
    off_b = (row // (nheads * seqlen_q)).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = pid_dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    lse_s = tl.load(LsePart + lse_part_offset + offs_s * stride_lpsplit + off_b * stride_lpb
                    + off_h * stride_lph + off_t * stride_lps, mask=offs_s < num_splits,
                    other=float("-inf"))
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
    tl.store(Lse + off_b * stride_lb + off_h * stride_lh + off_t * stride_ls, lse,
             mask=pid_dv == 0)


def decode_tile(packed_rows: int, page_size: int) -> tuple[Tile, bool]:
    """(launch shape, page per tile) for a program's packed query rows: decode (BLOCK_M the rows
    rounded up to a power of two, 16 to the table's BLOCK_M) or prefill; paged caches
    (page_size > 0) add PAGED_EXTRA_STAGES, or PAGE_TILE_EXTRA_STAGES where the page is looked
    up once per key tile."""
    table = DECODE_INTERPRETER if interpreting() else DECODE_SM90
    tile = table["decode"]
    if packed_rows > tile.block_m:
        tile = table["prefill"]
    else:
        tile = tile._replace(block_m=max(16, next_power_of_2(packed_rows)))
    if page_size == 0:
        return tile, False
    per_tile = PAGE_TILE_LOOKUP and page_size % tile.block_n == 0
    extra = PAGE_TILE_EXTRA_STAGES if per_tile else PAGED_EXTRA_STAGES
    return tile._replace(num_stages=tile.num_stages + extra), per_tile


def spill_free(tile: Tile, programs: int, sms: int, spills_capped: bool) -> tuple[Tile, int]:
    """(tile, programs per SM for register_cap) of a launch of `programs` programs on `sms` SMs:
    tile.resident, or for a build that spills under that cap (CAP_LIFT_PER_SM) the programs per
    SM the launch has if at most CAP_LIFT_PER_SM, else the tile without sub-tiles."""
    if tile.subtiles == 1 or not spills_capped:
        return tile, tile.resident
    per_sm = min(tile.resident, cdiv(programs, sms))
    if per_sm > CAP_LIFT_PER_SM:
        return tile._replace(subtiles=1), tile.resident
    return tile, per_sm


def register_cap(tile: Tile, per_sm: int) -> dict:
    """{"maxnreg": registers per thread} that keep `per_sm` sub-tiled programs on an SM (sm_90:
    64K registers, allocated per warp in units of 8 per thread; 3: 168). {} for up to 2 (left
    to ptxas, the sub-tiled decode tile takes 250-255), subtiles 1 and under the interpreter.
    H200, uncapped against 168 where launches have <= 2 programs per SM, decode grid
    (benchmarks/notes/kernel-choices.md): contiguous GQA 8:1 b1 16k, b4 4k, b16 1k 2.5-4.5%
    faster, paged (page 256) b1 16k, b4 4k, b16 1k, b1 1k MHA 7-11% slower, b1 1k MHA 5%
    slower: the cap stays but for builds that spill under it (spill_free)."""
    if tile.subtiles == 1 or per_sm <= 2 or interpreting():
        return {}
    return {"maxnreg": 65536 // (per_sm * tile.num_warps * 32) // 8 * 8}


@functools.lru_cache(maxsize=4096)
def auto_num_splits(programs: int, key_blocks: int, max_splits: int, sms: int, tile: Tile) -> int:
    """Key-length splits for `programs` programs of `tile` without splitting, on `sms` SMs.

    - Programs on at least FULL_SMS of the SMs: 1 (flash-attn's num_splits_heuristic starts the
      same way). A program per SM streams its keys at copy bandwidth, and splits add a merge.
    - Fewer: flash-attn's heuristic, the fewest splits whose programs fill tile.per_sm programs
      per SM in whole waves to within FILL_EFFICIENCY of the best choice; one per SM where
      per_sm would cut the keys into splits of fewer than SHORT_SPLIT_TILES tiles.
    - Between one and two rounds of tile.resident programs per SM (all that fit at once): a
      partial second round runs at a fraction of the bandwidth (b16 MHA decode: 512 programs on
      396 places gave 88-92% of copy bandwidth), so up to 4 splits of at least
      tile.round_split_tiles tiles that make the rounds whole.
    - Else 1.

    key_blocks: the longest sequence's key tiles; a split count is eligible only if it changes
    the tiles per split (with 64 tiles, 11 and 12 splits both give 6 tiles per split).
    """
    if programs < FULL_SMS * sms:
        splits = _whole_waves(programs, key_blocks, min(max_splits, key_blocks),
                              sms * tile.per_sm)
        if key_blocks < SHORT_SPLIT_TILES * splits:
            splits = _whole_waves(programs, key_blocks, min(max_splits, key_blocks), sms)
        return splits
    if sms * tile.resident < programs < 2 * sms * tile.resident:
        limit = min(max_splits, key_blocks // tile.round_split_tiles, 4)
        return _whole_waves(programs, key_blocks, limit, sms * tile.resident)
    return 1


def _whole_waves(programs: int, key_blocks: int, limit: int, slots: int) -> int:
    """The fewest splits (up to limit) whose programs fill `slots` in whole waves to within
    FILL_EFFICIENCY of the best count."""
    efficiency = {}
    for splits in range(1, max(1, limit) + 1):
        if splits > 1 and -(-key_blocks // splits) == -(-key_blocks // (splits - 1)):
            continue
        waves = programs * splits / slots
        efficiency[splits] = waves / math.ceil(waves)
    best = max(efficiency.values())
    return min(s for s, e in efficiency.items() if e >= FILL_EFFICIENCY * best)


def check_supported(dtype: torch.dtype, params: AttentionParams) -> None:
    """NotImplementedError for what these kernels do not do (before the caller mutates the
    cache)."""
    if params.attn_bias is not None or params.dropout_p > 0:
        raise NotImplementedError("triton decode: attn_bias and dropout are not supported")
    if dtype == torch.float64:
        raise NotImplementedError("triton decode: float64 is not supported; use backend='torch'")


def _launch_facts(device: torch.device) -> tuple[int, bool]:
    """(SM count, whether to launch with PDL) for a launch on `device`."""
    sms, has_pdl = device_facts(device)
    return sms, has_pdl and LAUNCH_PDL


class Partials(NamedTuple):
    """Where the decode kernel writes each split's (out, lse) (module docstring): the tensors
    holding out_part and lse_part (S, ...) with their strides, and lse_part's element offset in
    its tensor. A view per part would cost a CUDA allocation's host time, hence an offset."""
    out: torch.Tensor
    lse: torch.Tensor
    out_strides: tuple
    lse_strides: tuple
    lse_offset: int

    @staticmethod
    def of(out, lse, num_splits: int) -> Partials:
        """out and lse themselves (split stride 0) for one split; else one new float32 buffer
        holding out_part, then lse_part, each contiguous."""
        if num_splits == 1:
            return Partials(out, lse, (0, *out.stride()), (0, *lse.stride()), 0)
        seqlen_q, nheads, head_dim_v = out.shape[1:]
        out_numel = out.numel()
        buffer = torch.empty(num_splits * (out_numel + lse.numel()), dtype=torch.float32,
                             device=out.device)
        rows = seqlen_q * nheads
        return Partials(buffer, buffer,
                        (out_numel, rows * head_dim_v, nheads * head_dim_v, head_dim_v, 1),
                        (lse.numel(), rows, seqlen_q, 1), num_splits * out_numel)


def merge(partials: Partials, num_splits: int, out, lse, use_pdl: bool = False,
          plan: dict | None = None, name="merge") -> None:
    """out, lse from the splits' partial results (layouts in the module docstring); plan: the
    dispatch plan's prepared launches (launch.planned), this one under name."""
    planned(plan, name, lambda: _prepare_merge(partials, num_splits, out, lse, use_pdl))(
        partials.out, partials.lse, out, lse)


def _prepare_merge(partials: Partials, num_splits: int, out, lse, use_pdl: bool) -> Prepared:
    batch, seqlen_q, nheads, head_dim_v = out.shape
    block_dv = min(MERGE_BLOCK_DV, padded_head_dim(head_dim_v))
    return Prepared(_merge_kernel, (batch * seqlen_q * nheads, cdiv(head_dim_v, block_dv)), (
        *partials.out_strides, *partials.lse_strides, partials.lse_offset, *out.stride(),
        *lse.stride(), nheads, seqlen_q, num_splits), dict(
        HEAD_DIM_V=head_dim_v, BLOCK_S=max(2, next_power_of_2(num_splits)),
        BLOCK_DV=block_dv, USE_PDL=use_pdl), num_warps=4, launch_pdl=use_pdl)


def smaller_tile(tile: Tile) -> Tile:
    """The next smaller launch shape after `tile` ran out of shared memory: one pipeline stage
    fewer down to two, then half the keys per tile (and per sub-tile, down to 16). A page size
    that BLOCK_N divided, half of it divides too."""
    if tile.num_stages > 2:
        return tile._replace(num_stages=tile.num_stages - 1)
    if tile.block_n > 16:
        return tile._replace(block_n=tile.block_n // 2,
                             subtiles=max(1, min(tile.subtiles, tile.block_n // 32)))
    raise OutOfResources(0, 0, "shared memory: no smaller decode tile")


def launch_shape(q, nheads_k: int, page_size: int, num_splits: int,
                 max_seqlen_k: int) -> tuple[Tile, bool, int, int]:
    """(tile, page per tile, query row blocks, num_splits) of a launch (page_size 0:
    contiguous); num_splits 0 = auto_num_splits over the longest sequence's max_seqlen_k keys
    (None: unknown, then the split length does not take the sub-tiles away)."""
    batch, seqlen_q, nheads = q.shape[:3]
    packed_rows = seqlen_q * (nheads // nheads_k)
    tile, per_tile = decode_tile(packed_rows, page_size)
    m_blocks = cdiv(packed_rows, tile.block_m)
    key_blocks = None if max_seqlen_k is None else cdiv(max_seqlen_k, tile.block_n)
    if num_splits == 0:
        sms, _ = _launch_facts(q.device)
        num_splits = auto_num_splits(batch * nheads_k * m_blocks, key_blocks, MAX_SPLITS, sms,
                                     tile)
    if key_blocks is not None and key_blocks < tile.subtiled_from * num_splits:
        tile = tile._replace(subtiles=1)
    return tile, per_tile, m_blocks, num_splits


# (tile, dtype, head dims, paged) -> the smaller tile that ran where the first one ran out of
# shared memory (smaller_tile), so a later call launches it directly
_fitted: dict = {}


class Step(NamedTuple):
    """A decoding step done by the decode kernel (module docstring): q not yet rotated, the
    cache lengths before the append, the new keys and values (b, seqlen_new, hk, d) or None.
    cache_seqlens: int32 (b,) or an int; cos / sin None without rotary."""
    cache_seqlens: torch.Tensor | int
    k: torch.Tensor | None
    v: torch.Tensor | None
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    interleaved: bool
    q_rows: int


def dense_declines(q, k, params: AttentionParams) -> str | None:
    """Why the decode kernel does not run a dense flash_attn_func call (`dense`), or None: it
    takes calls whose kv heads' query rows each fit one program (step_declines) over at least
    DENSE_MIN_KEYS keys, where the forward kernels would run one program per query tile and
    head over all the keys; no varlen, dropout, bias or user modifiers."""
    if params.is_varlen or params.variant is not None:
        return "varlen or a user's modifiers"
    if params.dropout_p > 0 or params.attn_bias is not None or q.dtype == torch.float64:
        return "dropout, an attention bias or float64"
    if k.shape[1] < DENSE_MIN_KEYS:
        return f"{k.shape[1]} keys < {DENSE_MIN_KEYS}"
    return step_declines(q, k.shape[2], 0)


def dense(q, k, v, params: AttentionParams, out=None, lse=None, plan: dict | None = None,
          any_length: bool = False):
    """(out, lse) of a dense call that dense_declines takes: a decoding step over k and v as a
    full cache, nothing appended (its length an int, as a step's cache_seqlens). any_length:
    the plan runs calls of every key length (forward's)."""
    seqlen_k = k.shape[1]
    return forward(q, k, v, None, None, None, None, params, 0, seqlen_k, out=out, lse=lse,
                   step=Step(seqlen_k, None, None, None, None, False, q.shape[1]), plan=plan,
                   any_length=any_length)


def step_declines(q, nheads_k: int, seqlen_new: int) -> str | None:
    """Why the decode kernel cannot do the decoding step itself (Step), or None: one program of
    the decode tile must hold all query rows of a kv head, and at most STEP_MAX_NEW new keys."""
    table = DECODE_INTERPRETER if interpreting() else DECODE_SM90
    packed_rows = q.shape[1] * (q.shape[2] // nheads_k)
    if packed_rows > table["decode"].block_m:
        return f"{packed_rows} query rows per kv head > the tile's {table['decode'].block_m}"
    if seqlen_new > STEP_MAX_NEW:
        return f"{seqlen_new} new keys > {STEP_MAX_NEW}"
    return None


class _Shape(NamedTuple):
    """A decode launch's shape (forward): the tile, page per tile, query row blocks, splits,
    programs per SM for register_cap, whether PDL is used, and the key under which a smaller
    tile that fitted is remembered (_fitted)."""
    tile: Tile
    per_tile: bool
    m_blocks: int
    num_splits: int
    per_sm: int
    use_pdl: bool
    fit_key: tuple


def _shape(q, k_cache, v_cache, block_table, num_splits: int, max_seqlen_k: int | None,
           interleaved: bool) -> _Shape:
    """The launch shape of a call from its shapes (launch_shape, spill_free, _fitted)."""
    head_dim, (nheads_k, head_dim_v) = q.shape[3], v_cache.shape[2:]
    page_size = 0 if block_table is None else k_cache.shape[1]
    tile, per_tile, m_blocks, num_splits = launch_shape(q, nheads_k, page_size, num_splits,
                                                        max_seqlen_k)
    sms, use_pdl = _launch_facts(q.device)
    # Pages looked up per key row: neither a tile nor a sub-tile lies in one page
    row_pages = (page_size > 0 and not per_tile
                 and page_size % (tile.block_n // tile.subtiles) != 0)
    tile, per_sm = spill_free(tile, q.shape[0] * nheads_k * m_blocks * num_splits, sms,
                              interleaved or row_pages)
    fit_key = (tile, q.dtype, head_dim, head_dim_v, page_size > 0)
    return _Shape(_fitted.get(fit_key, tile), per_tile, m_blocks, num_splits, per_sm, use_pdl,
                  fit_key)


def forward(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table,
            params: AttentionParams, num_splits: int, max_seqlen_k: int | None = None, *,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            step: Step | None = None, plan: dict | None = None, any_length: bool = False):
    """(out, lse) as flashkit.ops.tiled.kvcache.forward; num_splits 0 = auto_num_splits.
    max_seqlen_k (the longest seqlens_k, or a bound such as the cache capacity, as flash-attn
    uses) saves a device sync when auto splitting; cache_batch_idx / cache_leftpad None mean
    rows 0..b-1 and no padding; out and lse may be given preallocated. With `step` (where
    step_declines), the kernel appends step.k, step.v to the cache and rotates q and step.k;
    seqlens_k is not read (the kernel takes step.cache_seqlens) and max_seqlen_k is required.
    plan: the dispatch plan's prepared launches (launch.planned): a step's int cache_seqlens
    is the one scalar each call passes (varying). any_length (a dense call of `dense`, through
    dispatch.AnyLengthForward): the plan runs every cache length, its launch shape kept by the
    key-tile count (which fixes the splits and the tile), the decode and merge launches by the
    shape (key-tile counts of one shape share them) and the decode launch also by the
    specialisation of the cache's strides and capacity, which each call passes (launch's
    keyed), and by whether a window's left edge cuts the keys (features.cuts_left)."""
    check_supported(q.dtype, params)
    batch, seqlen_q, nheads, head_dim = q.shape
    head_dim_v = v_cache.shape[3]
    if num_splits == 0 and max_seqlen_k is None:
        max_seqlen_k = int(seqlens_k.max())
    interleaved = step is not None and step.cos is not None and step.interleaved
    shape_name, lengths, codes = "shape", (), ()
    if any_length:  # the shape of this key-tile count; the length's scalars passed per call
        tile_keys = planned(plan, "tile keys", lambda: decode_tile(
            seqlen_q * (nheads // k_cache.shape[2]), 0)[0].block_n)  # launch_shape's
        shape_name = ("shape", cdiv(max_seqlen_k, tile_keys))
        lengths = (*k_cache.stride(), *v_cache.stride(), k_cache.shape[1])
        codes = (*specialisation(lengths), cuts_left(params, k_cache.shape[1]))
    shape = planned(plan, shape_name, lambda: _shape(q, k_cache, v_cache, block_table,
                                                     num_splits, max_seqlen_k, interleaved))
    if step is not None and shape.m_blocks != 1:
        raise ValueError("decode.forward: a step needs one program per kv head (step_declines)")
    num_splits = shape.num_splits

    if out is None:
        out = torch.empty(batch, seqlen_q, nheads, head_dim_v, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(batch, nheads, seqlen_q, dtype=torch.float32, device=q.device)
    partials = Partials.of(out, lse, num_splits)

    cos = sin = None
    seqlen_fixed = 0  # a step's int cache_seqlens, else unread
    # absent new keys: the cache stands in, never read (an empty view of it would cost ~2 us
    # of host time a call)
    k_new = v_new = k_cache
    if step is not None:
        cos, sin = step.cos, step.sin
        if step.k is not None:
            k_new, v_new = step.k, step.v
        if isinstance(step.cache_seqlens, torch.Tensor):
            seqlens_k = step.cache_seqlens
        else:
            seqlen_fixed = step.cache_seqlens
    # seqlens_k, or q where a step takes an int cache_seqlens: stands in for absent pointer
    # arguments (never read)
    dummy = q if seqlens_k is None else seqlens_k
    score_tensors, sink, _, _ = feature_tensors(params, dummy, float32_sink=False)
    tensors = (q, k_cache, v_cache, partials.out, partials.lse,
               dummy if block_table is None else block_table,
               dummy if cache_batch_idx is None else cache_batch_idx,
               dummy if cache_leftpad is None else cache_leftpad, dummy, score_tensors, sink,
               dummy if cos is None else cos, dummy if sin is None else sin, k_new, v_new)
    while True:  # a tile asking for more shared memory than the GPU has (a float32 prefill
        # tile): fewer stages, then fewer keys per tile, remembered for the next call
        decode_name = ("decode", shape, *codes) if any_length else "decode"
        try:
            planned(plan, decode_name, lambda shape=shape: _prepare(
                q, k_cache, v_cache, block_table, cache_batch_idx, cache_leftpad, params,
                shape, partials, step, cos, k_new, v_new, dummy, any_length))(
                *tensors, varying=(seqlen_fixed, *lengths))
            break
        except OutOfResources:
            shape = shape._replace(tile=smaller_tile(shape.tile))
            _fitted[shape.fit_key] = shape.tile
            if plan is not None:
                plan[shape_name] = shape
                plan.pop(decode_name, None)
    if num_splits > 1:
        merge(partials, num_splits, out, lse, shape.use_pdl, plan,
              ("merge", shape) if any_length else "merge")
    return out, lse


# the scalar parameters of the decode kernel that depend on a dense call's key length, passed
# per call by a plan for every key length (forward's any_length)
_KEY_LENGTH = ("stride_kb", "stride_ks", "stride_kh", "stride_kd", "stride_vb", "stride_vs",
               "stride_vh", "stride_vd", "capacity")


def _prepare(q, k_cache, v_cache, block_table, cache_batch_idx, cache_leftpad,
             params: AttentionParams, shape: _Shape, partials: Partials, step: Step | None, cos,
             k_new, v_new, dummy, any_length: bool = False) -> Prepared:
    """The decode kernel's launch (launch.Prepared) of forward's call: its tensors as forward
    passes them; any_length: each call passes the cache's strides and capacity too (k_new and
    v_new, stand-ins for a dense call, keep the first call's strides: never read)."""
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k, head_dim_v = v_cache.shape[2], v_cache.shape[3]
    tile, num_splits = shape.tile, shape.num_splits
    page_size = 0 if block_table is None else k_cache.shape[1]
    seqlens_tensor = step is None or isinstance(step.cache_seqlens, torch.Tensor)
    seqlen_new = 0 if step is None or step.k is None else step.k.shape[1]
    # The step's device assertion needs debug=True; the overflow sanitiser that comes with it
    # is off (index arithmetic as compiled without it).
    checks = {} if step is None else dict(debug=True, sanitize_overflow=False)
    capacity = k_cache.shape[1] if block_table is None else block_table.shape[1] * page_size
    # log2-unit scores and the exact tanh whatever the dtype; the sink as given (the kernel
    # converts it as it loads it)
    f = kernel_features(params, q, v_cache, dummy, seqlen_k=capacity, float32_sink=False,
                        flags=DENSE_FLAGS)
    bhk_y, bhk_z = fold(batch * nheads_k)
    return Prepared(_decode_kernel, (num_splits * bhk_z, bhk_y, shape.m_blocks), (
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *partials.out_strides,
        *partials.lse_strides, partials.lse_offset,
        0 if block_table is None else block_table.stride(0),
        *((0, 0) if cos is None else cos.stride()),
        *k_new.stride(), *v_new.stride(), nheads_k, nheads // nheads_k, seqlen_q, num_splits,
        *f.band[2:], f.score_values, 0, seqlen_new,
        1 if step is None else step.q_rows, capacity, k_cache.shape[0],
        0 if cos is None else cos.shape[0]), dict(
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=padded_head_dim(head_dim),
        BLOCK_DV=padded_head_dim(head_dim_v), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        SUBTILES=tile.subtiles, PAGE_SIZE=page_size, PAGE_PER_TILE=shape.per_tile,
        HAS_BATCH_IDX=cache_batch_idx is not None, HAS_LEFTPAD=cache_leftpad is not None,
        **f.flags, USE_PDL=shape.use_pdl and num_splits > 1, PRECISION=DOT_PRECISION,
        STEP=step is not None, SEQLENS_TENSOR=seqlens_tensor,
        ROTARY_HALF=0 if cos is None else cos.shape[1],
        INTERLEAVED=step is not None and cos is not None and step.interleaved,
        BLOCK_NEW=max(1, next_power_of_2(seqlen_new)), TABLE_CHUNK=TABLE_CHUNK),
        varying=("seqlen_fixed", *(_KEY_LENGTH if any_length else ())),
        keyed=_KEY_LENGTH if any_length else (), num_warps=tile.num_warps,
        num_stages=tile.num_stages, **checks, **register_cap(tile, shape.per_sm))
