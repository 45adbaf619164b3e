"""Shared pieces of the sm_90 Gluon kernels (forward_hopper.py, backward_hopper.py): the TMA
descriptors of q, k, v and dO on the host (the flash layout, tokens a pitch apart as in a packed
qkv, or SDPA's heads-major memory seen as flash-attn's shape: view_2d, view_geometry), and on the
device where a head's rows start in them (view_origin); on the device, a K/V tile's rows (contiguous
or paged), its TMA load into a ring buffer, the zeroing of a tile's rows past a sequence's end, and
a work item's tiles under a user's block mask (block_lists on the host; block_listing, listed_tile,
tile_start), and a user's score and mask modifiers as both kernels apply them (user_scores,
visible_with_mod).

A block mask (flashkit.variants.BlockMask) lists, per row of blocks (a query block's key
blocks, or transposed a key block's query blocks), its partial blocks and its full ones; a
kernel whose tiles divide the blocks walks one row: the partial blocks' tiles (masked), then
the full blocks' (not masked), 2^shift tiles per block (tiles and blocks are powers of two:
a shift and a bit mask find a tile's block where a division by a runtime count would cost a
few dozen instructions per tile).

A paged cache (num_blocks, page_size, hk, d) is read as the 2-D view (num_blocks * page_size,
hk * d): key j of a sequence is row table[j >> log2(page_size)] * page_size + j % page_size, and
a tile of BLOCK_N keys is loaded in min(page_size, BLOCK_N)-row pieces, each in one page.
(decode.py's Triton kernel pages the same cache through pointers: element offsets
page * stride_b + slot * stride_s, with masked and clamped table reads; the two address
computations serve different load instructions and are kept apart.)
"""

from __future__ import annotations

import functools

import torch

from flashkit.ops.triton.common import (
    block_args,
    mod_indices,
    user_score,
    user_score_grad,
    user_visible,
    visible,
)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon: the Triton kernels do everything
    gluon = None


def flash_layout_2d(x: torch.Tensor) -> bool:
    """x (batch, seqlen, heads, d) or varlen (total, heads, d) is contiguous, so
    (batch * seqlen or total, heads * d) is a view."""
    return x.is_contiguous() and x.data_ptr() % 16 == 0


def token_rows(x: torch.Tensor) -> bool:
    """x (batch, seqlen, heads, d) or varlen (total, heads, d), more than one token per
    sequence, whose (heads, d) are contiguous and whose tokens are evenly spaced rows of a
    2-D view (tokens, heads * d) with a row pitch of at least heads * d elements, 16-byte
    aligned: the flash layout, or q, k, v unbound from one packed qkv (the pitch 3 heads *
    d)."""
    if x.dim() not in (3, 4) or x.shape[-3] < 2:
        return False
    heads, head_dim = x.shape[-2:]
    pitch = x.stride(-3)
    return (x.stride(-1) == 1 and (heads == 1 or x.stride(-2) == head_dim)
            and (x.dim() == 3 or x.shape[0] == 1 or x.stride(0) == x.shape[1] * pitch)
            and pitch >= heads * head_dim and pitch * x.element_size() % 16 == 0
            and x.data_ptr() % 16 == 0)


def heads_major(x: torch.Tensor) -> bool:
    """Dense x (batch, seqlen, heads, d) whose memory is (batch, heads, seqlen, d), contiguous
    and 16-byte aligned: PyTorch SDPA's layout seen through .transpose(1, 2), as a model hands
    its q, k, v to flash-attn's API. (batch * heads * seqlen, d) is then a view."""
    return (x.dim() == 4 and not x.is_contiguous() and x.transpose(1, 2).is_contiguous()
            and x.data_ptr() % 16 == 0)


def tma_layout(x: torch.Tensor) -> bool:
    """Whether the Gluon kernels read x in place through a 2-D TMA view (view_2d): the flash
    layout (contiguous), token_rows, or a dense tensor heads_major."""
    return flash_layout_2d(x) or token_rows(x) or heads_major(x)


def view_2d(x: torch.Tensor) -> torch.Tensor:
    """The 2-D view of a tma_layout x: (tokens, heads * d) of the flash layout and of
    token_rows (its rows a pitch apart), (batch * heads * seqlen, d) of a heads_major one."""
    heads, head_dim = x.shape[-2:]
    if x.is_contiguous():
        return x.view(-1, heads * head_dim)
    if heads_major(x):
        return x.transpose(1, 2).view(-1, head_dim)
    return x.as_strided((x.numel() // (heads * head_dim), heads * head_dim), (x.stride(-3), 1))


def view_geometry(x: torch.Tensor) -> tuple[int, int, int]:
    """Where the rows of (batch entry b, head h) start in view_2d(x), as the kernels take it:
    (rows per batch entry, rows per head, columns per head); row b * rows_b + h * rows_h +
    position, column h * cols_h. The flash layout and token_rows (seqlen, 0, d) (varlen: rows
    per batch entry unused, each sequence starts at its cu_seqlens row), heads_major (heads *
    seqlen, seqlen, 0)."""
    heads, head_dim = x.shape[-2:]
    if heads_major(x):
        seqlen = x.shape[1]
        return heads * seqlen, seqlen, 0
    return (x.shape[1] if x.dim() == 4 else 0), 0, head_dim


def flash_descriptor(x, rows, box_rows=None):
    """TMA descriptor of [rows, d] tiles over a tma_layout x (batch, seqlen, heads, d) or
    varlen (total, heads, d) as its 2-D view (view_2d); box_rows < rows: [box_rows, d] pieces
    of such a tile (a paged cache's pages), in the tile's shared-memory layout."""
    head_dim = x.shape[-1]
    return descriptor(view_2d(x), (box_rows or rows, head_dim),
                      tile_layout(rows, head_dim, x.dtype))


def rows_descriptor(x, rows):
    """TMA descriptor of `rows`-element pieces of a contiguous float32 x read as one row (the
    backward's lse and delta, (batch, nheads, seqlen_q) or varlen (nheads, total_q))."""
    return descriptor(x.view(-1), (rows,), row_layout(rows))


def block_lists(params, placeholder, tile: int, transposed: bool = False,
                kernel_tile: tuple | None = None) -> tuple:
    """A call's block mask as the Gluon kernels take it (() without one): ((Num, Idx,
    FullNum, FullIdx, blocks per list row, log2 of the tiles of `tile` per block), the lists'
    batch stride, their head stride, the rows (or, transposed, keys) a list row covers), its
    rows per query block, or transposed per key block (common.block_args); block_listing reads
    the first. kernel_tile: the kernel's (query rows, keys) per tile, to walk the finest of the
    mask's lists whose blocks hold whole tiles (BlockMask.finest); else the mask's own."""
    if params.variant is None or params.variant.block_mask is None:
        return ()
    mask = params.variant.block_mask
    if kernel_tile is not None:
        mask = mask.finest(*kernel_tile)
    lists, sizes = block_args(params, placeholder, transposed, mask)
    along, across = ((sizes["SPARSE_Q"], sizes["SPARSE_KV"]) if transposed else
                     (sizes["SPARSE_KV"], sizes["SPARSE_Q"]))
    span = along // tile  # both powers of two, the tile no larger (the kernels' choice)
    return (*lists[:4], lists[6], span.bit_length() - 1), lists[4], lists[5], across


def modifier_tensors(params, placeholder, tile: int, transposed: bool = False,
                     kernel_tile: tuple | None = None) -> tuple:
    """(score_args, mask_args, packing, blocks): a user's modifiers as each launch of a Gluon
    kernel is passed them, the call's own values: score_mod's and mask_mod's captured values,
    the packing of a block mask over varlen's packed tokens ((SeqQ, Cu_q, Cu_k), else ()) and
    the block mask's lists (block_lists, for the kernel's tile; () without one). A launch
    plan fixes what the kernel compiles in (dispatch's key: the functions, the captured
    values' dtypes and numbers, the mask's geometry), never these tensors."""
    variant = params.variant
    if variant is None:
        return (), (), (), ()
    score, mask = variant.score_mod, variant.mask_mod
    return (() if score is None else score.kernel_args(),
            () if mask is None else mask.kernel_args(), variant.packing,
            block_lists(params, placeholder, tile, transposed, kernel_tile))


_checked: set = set()  # the geometries whose descriptors TensorDescriptor has checked


def descriptor(base, block: tuple, layout):
    """TensorDescriptor(base, its shape, its strides, block, layout) for a base with unit
    last stride, 16-byte aligned rows and a 16-byte aligned address (which the kernels'
    eligibility checks). TensorDescriptor checks its
    fields when made (~5-10 us on the host; a training step makes 13 descriptors); what it
    checks depends only on the rank, the strides, the dtype, the block, the layout and whether
    every dim is positive, besides that address, so the check runs once per such geometry and
    later descriptors are made without it: the same check for every length (a decoding step
    over a cache one key longer each call)."""
    shape, strides = list(base.shape), list(base.stride())
    key = (len(shape), min(shape) > 0, *strides, base.dtype, *block, layout)
    if key not in _checked:
        TensorDescriptor(base, shape, strides, list(block), layout)  # raises on a bad geometry
        if len(_checked) >= 4096:
            _checked.clear()
        _checked.add(key)
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape = base, shape, strides, list(block)
    desc.layout, desc.padding = layout, "zero"
    return desc


@functools.cache
def tile_layout(rows, head_dim, dtype):
    """The shared-memory layout of a [rows, head_dim] tile (made once: ~20 us of host time
    per descriptor otherwise)."""
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl_dtype)


@functools.cache
def row_layout(rows):
    """The shared-memory layout of `rows` float32 values (made once, as tile_layout)."""
    return gl.NVMMASharedLayout.get_default_for([rows], gl.float32)


if gluon is not None:

    @gluon.jit
    def view_origin(geo, off_b, head, seq_start, VARLEN: gl.constexpr):
        """(row, column) of position 0 of `head` in batch entry off_b in a 2-D TMA view
        (view_2d), geo its view_geometry (rows per batch entry, rows per head, columns per
        head); VARLEN: the sequence starts at row seq_start (its cu_seqlens entry) instead."""
        rows_b, rows_h, cols_h = geo
        if VARLEN:
            first = seq_start.to(gl.int32)
        else:
            first = off_b * rows_b
        return first + head * rows_h, head * cols_h

    @gluon.jit
    def kv_tile_rows(keys, tile, BLOCK_N: gl.constexpr, ROWS: gl.constexpr):
        """Rows in the 2-D view of key tile `tile`'s ROWS-row pieces (a tuple of BLOCK_N // ROWS).
        keys: the first key row of the program's range in the 2-D view (one piece), or for a
        paged cache (num_blocks * page_size rows) the tuple (first key index, the sequence's
        block_table row, its key count, log2 page_size): piece j's keys key .. key + ROWS - 1
        (ROWS = min(page_size, BLOCK_N), so they lie in one page) are rows
        table[key >> shift] * page_size + key % page_size. A piece past the last key reads the
        last key's page instead (the table may hold padding there; its rows are masked and
        zeroed as any key tail's), so only table entries of used pages are read."""
        if isinstance(keys, gl.tuple):
            key0, table, n_keys, shift = keys
            last = gl.maximum(n_keys - 1, 0)
            rows = ()
            for j in gl.static_range(BLOCK_N // ROWS):
                key = gl.minimum(key0 + tile * BLOCK_N + j * ROWS, last)
                page = gl.load(table + (key >> shift))
                rows = rows + ((page << shift) + (key & ((1 << shift) - 1)), )
        else:
            rows = (keys + tile * BLOCK_N, )
        return rows

    @gluon.jit
    def block_listing(lists, row):
        """(listing, n_tiles) of row `row` of a block mask's lists = (Num, Idx, FullNum,
        FullIdx, n_blocks, shift): Num/FullNum the partial/full block counts per row, Idx/FullIdx
        their block indices (n_blocks per row), 2^shift tiles per block. listing = (the row's
        partial indices, the partial blocks' tile count, its full indices, shift), as
        listed_tile reads it; n_tiles: every listed tile."""
        Num, Idx, FullNum, FullIdx, n_blocks, shift = lists
        n_partial = gl.load(Num + row) << shift
        n_tiles = n_partial + (gl.load(FullNum + row) << shift)
        return (Idx + row * n_blocks, n_partial, FullIdx + row * n_blocks, shift), n_tiles

    @gluon.jit
    def listed_tile(listing, t):
        """The index (in tiles from the sequence's start) of tile t of a block_listing: the
        partial blocks' tiles first, in list order, then the full blocks'."""
        partial, n_partial, full, shift = listing
        if t < n_partial:
            u = t
            block = gl.load(partial + (u >> shift))
        else:
            u = t - n_partial
            block = gl.load(full + (u >> shift))
        return (block << shift) + (u & ((1 << shift) - 1))

    @gluon.jit
    def tile_start(listing, lo, t, TILE: gl.constexpr):
        """The first row (or key) of a work item's tile t: lo + t * TILE over a range, or the
        listed tile's under a block mask (listing: block_listing)."""
        if len(listing) > 0:
            start = listed_tile(listing, t) * TILE
        else:
            start = lo + t * TILE
        return start

    @gluon.jit
    def user_scores(s, i, j, seqlen_q, seqlen_k, user, SCORE_MOD: gl.constexpr,
                    SCORE_GRAD: gl.constexpr, NATURAL: gl.constexpr = False):
        """(s, dmod): a user's score_mod (common.user_score) on the log2-unit scores s
        (natural with NATURAL, which returns natural ones too) of query rows i and key columns
        j (broadcasting), and, with SCORE_GRAD, its derivative at s, which a backward
        multiplies dS by (1.0 otherwise). user = (batch, query head,
        score_args, mask_args, packing, in_bounds): with packing (a block mask over varlen's
        packed tokens, run as one sequence) the modifier sees each pair's sequence and positions
        in it (common.mod_indices); in_bounds (bounds_flags) whether the positions need a clamp
        (never with packing: positions within a sequence)."""
        off_b, off_h, score_args, mask_args, packing, in_bounds = user
        QUERIES_IN: gl.constexpr = len(in_bounds[0]) > 0
        KEYS_IN: gl.constexpr = len(in_bounds[1]) > 0
        dmod = 1.0
        if SCORE_MOD is not None:
            if len(packing) > 0:
                off_b, i, j, seqlen_q, seqlen_k, _ = mod_indices(off_b, i, j, seqlen_q,
                                                                 seqlen_k, packing, True)
            if SCORE_GRAD is not None:
                dmod = user_score_grad(s, off_b, off_h, i, j, seqlen_q, seqlen_k, SCORE_GRAD,
                                       score_args, NATURAL, QUERIES_IN, KEYS_IN)
            s = user_score(s, off_b, off_h, i, j, seqlen_q, seqlen_k, SCORE_MOD, score_args,
                           NATURAL, QUERIES_IN, KEYS_IN)
        return s, dmod

    @gluon.jit
    def bounds_flags(QUERIES_IN: gl.constexpr, KEYS_IN: gl.constexpr):
        """`user`'s in_bounds (user_scores): whether a kernel's query (key) tiles all end within
        the sequence, so the positions a modifier sees need no clamp (common.mod_positions). A
        tuple turns its flags into tensors but keeps its shape, so each flag travels as a
        tuple's length: (0,) for True, () for False."""
        queries = ()
        keys = ()
        if QUERIES_IN:
            queries = (0, )
        if KEYS_IN:
            keys = (0, )
        return queries, keys

    @gluon.jit
    def visible_with_mod(i, j, seqlen_q, seqlen_k, window_left, window_right, user,
                         HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                         MASK_MOD: gl.constexpr):
        """common.visible and a user's mask_mod (common.user_visible; user as in user_scores:
        with packing, pairs of two sequences are hidden and the mask_mod sees positions within
        the query's sequence). With every key in bounds and no band, the mask_mod alone:
        visible's one test, j < seqlen_k, holds (a select per score less)."""
        off_b, off_h, score_args, mask_args, packing, in_bounds = user
        QUERIES_IN: gl.constexpr = len(in_bounds[0]) > 0
        KEYS_IN: gl.constexpr = len(in_bounds[1]) > 0
        if MASK_MOD is not None and KEYS_IN and not HAS_LEFT and not HAS_RIGHT:
            keep = user_visible(off_b, off_h, i, j, seqlen_q, seqlen_k, MASK_MOD, mask_args,
                                QUERIES_IN, KEYS_IN)
        else:
            keep = visible(i, j, seqlen_q, seqlen_k, window_left, window_right, HAS_LEFT,
                           HAS_RIGHT)
            if MASK_MOD is not None:
                if len(packing) > 0:
                    off_b, i, j, seqlen_q, seqlen_k, same = mod_indices(off_b, i, j, seqlen_q,
                                                                        seqlen_k, packing, True)
                    keep = keep & same
                keep = keep & user_visible(off_b, off_h, i, j, seqlen_q, seqlen_k, MASK_MOD,
                                           mask_args, QUERIES_IN, KEYS_IN)
        return keep

    @gluon.jit
    def tma_load_tile(desc, bar, buf, rows, kv_col, pred):
        """TMA the pieces at `rows` (kv_tile_rows) into consecutive row slices of buf, one
        transaction count on bar for the whole tile."""
        ROWS: gl.constexpr = desc.block_type.shape[0]
        mbarrier.expect(bar, desc.block_type.nbytes * len(rows), pred=pred)
        if len(rows) == 1:
            tma.async_copy_global_to_shared(desc, [rows[0], kv_col], bar, buf, pred=pred)
        else:
            for j in gl.static_range(len(rows)):
                tma.async_copy_global_to_shared(desc, [rows[j], kv_col], bar,
                                                buf.slice(j * ROWS, ROWS), pred=pred)

    @gluon.jit
    def kv_load_rows(k_desc, tile, n_tiles, keys, listing, BLOCK_N: gl.constexpr):
        """The rows (kv_tile_rows) that issue_kv_load reads K/V tile `tile` from. listing: a
        block mask's tiles (block_listing; keys then the sequence's first key row), or (); a
        lookup past n_tiles stays in the listing's row (nothing loads there)."""
        ROWS: gl.constexpr = k_desc.block_type.shape[0]
        if len(listing) > 0:
            last = gl.maximum(gl.minimum(tile, n_tiles - 1), 0)
            rows = kv_tile_rows(keys + listed_tile(listing, last) * BLOCK_N, 0, BLOCK_N, ROWS)
        else:
            rows = kv_tile_rows(keys, tile, BLOCK_N, ROWS)
        return rows

    @gluon.jit
    def issue_kv_rows(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, tile, n_tiles, rows,
                      kv_col, NUM_STAGES: gl.constexpr):
        """TMA K and V tile `tile` from `rows` (kv_load_rows) into ring buffer
        tile % NUM_STAGES; skipped past n_tiles."""
        stage = tile % NUM_STAGES
        valid = tile < n_tiles
        tma_load_tile(k_desc, k_bars.index(stage), k_smem.index(stage), rows, kv_col, valid)
        tma_load_tile(v_desc, v_bars.index(stage), v_smem.index(stage), rows, kv_col, valid)

    @gluon.jit
    def issue_kv_load(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, tile, n_tiles, keys,
                       listing, kv_col, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
        """TMA K and V tile `tile` (keys: see kv_tile_rows; listing: see kv_load_rows) into
        ring buffer tile % NUM_STAGES; skipped past n_tiles."""
        issue_kv_rows(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, tile, n_tiles,
                      kv_load_rows(k_desc, tile, n_tiles, keys, listing, BLOCK_N), kv_col,
                      NUM_STAGES)

    @gluon.jit
    def zero_tile_tail(v_tile, n_keep, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                       PART: gl.constexpr, PARTS: gl.constexpr):
        """Zero rows n_keep.. of a V tile in shared memory (the keys past the sequence's end that
        TMA read with the tile: the next sequence's rows or spare cache slots). Their P is 0,
        but 0 * NaN or 0 * inf in P V is NaN, so they must hold zeros. In 16-row slices of a
        [16, HEAD_DIM] blocked layout over the caller's warps (gl.num_warps(): a partition's
        own; 8 registers per thread at d128 and one warpgroup); then a fence, so the wgmma
        (async proxy) sees the writes, and a barrier of those warps. PARTS warpgroups that
        share the tile split the slices, this one taking slices PART, PART + PARTS, ...: the
        caller then waits until every part is written before a wgmma reads the tile."""
        if n_keep < BLOCK_N:
            ROWS: gl.constexpr = 16
            COLS: gl.constexpr = HEAD_DIM // 8  # threads along a row, 8 elements each
            layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // COLS, COLS],
                                                    [gl.num_warps(), 1], [1, 0])
            for c in gl.static_range(PART, BLOCK_N // ROWS, PARTS):
                if (c + 1) * ROWS > n_keep:
                    rows = c * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
                    chunk = v_tile.slice(c * ROWS, ROWS)
                    x = chunk.load(layout)
                    chunk.store(gl.where(gl.expand_dims(rows, 1) < n_keep, x, gl.zeros_like(x)))
            fence_async_shared()
            gl.thread_barrier()
