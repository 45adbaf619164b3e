"""The dropout keep-mask in the register layouts of the Gluon kernels (forward_hopper.py and
backward_hopper.py).

Every function here draws dropout.py's mask bit for bit, through its Philox core (philox_calls)
and its four-bytes-per-instruction compare (bytes_ge, packed_keep), on index tensors built in
the layout where the mask is used:
  - keep_words (the forward: compared words, which mask P two scores at a time), keep_tile
    and keep_half_tiles (the dQ kernel: a bool tile; 64-key tiles hand each call's unused half
    to the next tile): a [64, BLOCK_N] score tile in the wgmma accumulator layout of one
    warpgroup, each thread drawing the Philox calls of its own scores;
  - keep_bits_t / unpack_keep_t: a transposed [BLOCK_N, BLOCK_M] tile (the dK/dV kernel's S^T),
    drawn once per call in a blocked layout and moved, packed, to the transposed one.
"""

from __future__ import annotations

from flashkit.ops.triton.dropout import bytes_ge, packed_bit, packed_keep, philox_calls, tile_words

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # a Triton without Gluon: nothing here is used
    gluon = None

if gluon is not None:
    @gluon.constexpr_function
    def draw_layout(block_n):
        """The wgmma accumulator layout of a [64, block_n] score tile (4 warps, 16 rows each;
        per 8 columns a thread holds columns 2 (lane % 4) + 0/1 of rows lane / 4 and + 8) with
        column j split as (chunk, byte, g) = (j // 128, j % 128 // 8, j % 8), the order of
        dropout.py's draws: [64, CHUNKS, BYTES, 8]. Reshaped back it is the score layout, so
        each thread draws exactly the Philox calls (row, chunk, g) of its own scores."""
        col_bits = (block_n // 8).bit_length() - 1  # register bases of columns 8, 16, ...
        tile = lambda row, col: [row, col // 128, col % 128 // 8, col % 8]  # noqa: E731
        return gl.DistributedLinearLayout(
            reg_bases=[tile(0, 1), tile(8, 0)] + [tile(0, 8 << b) for b in range(col_bits)],
            lane_bases=[tile(0, 2), tile(0, 4), tile(1, 0), tile(2, 0), tile(4, 0)],
            warp_bases=[tile(16, 0), tile(32, 0)], block_bases=[],
            shape=[64, max(block_n // 128, 1), min(block_n // 8, 16), 8])


    @gluon.constexpr_function
    def draw_layout_t(block_n, block_m, num_warps):
        """The wgmma accumulator layout of an S^T tile [block_n, block_m] (block_n / 16 warps of
        16 key rows; with more warps, num_warps * 16 / block_n groups of them split the query
        columns; per 8 query columns a thread holds columns 2 (lane % 4) + 0/1 of key rows
        lane / 4 and + 8) with key j split as (chunk, byte, g) = (j // 128, j % 128 // 8, j % 8),
        dropout.py's order: [CHUNKS, BYTES, 8, block_m]. Reshaped back it is the S^T layout."""
        warps_m = block_n // 16
        columns = block_m * warps_m // num_warps  # query columns per warp
        col_bits = (columns // 8).bit_length() - 1  # register bases of query columns 8, 16, ...
        tile = lambda key, query: [key // 128, key % 128 // 8, key % 8, query]  # noqa: E731
        return gl.DistributedLinearLayout(
            reg_bases=[tile(0, 1), tile(8, 0)] + [tile(0, 8 << b) for b in range(col_bits)],
            lane_bases=[tile(0, 2), tile(0, 4), tile(1, 0), tile(2, 0), tile(4, 0)],
            warp_bases=[tile(16 << w, 0) for w in range(warps_m.bit_length() - 1)]
            + [tile(0, columns << w) for w in range((num_warps // warps_m).bit_length() - 1)],
            block_bases=[], shape=[max(block_n // 128, 1), min(block_n // 8, 16), 8, block_m])

    @gluon.jit
    def keep_bits_t(drop, start_m, start_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        num_warps: gl.constexpr):
        """[CHUNKS, 8, BLOCK_M] int32 in SliceLayout(1, draw_layout_t): the forward's
        keep-mask of query rows start_m + [0, BLOCK_M) and keys start_n + [0, BLOCK_N) (start_n
        a multiple of BLOCK_N), one int32 of sixteen decisions per Philox call (dropout.
        packed_keep); unpack_keep_t turns it into the S^T tile. In S^T a thread holds one g of
        sixteen queries, so drawing in place would repeat every call once per warp: instead
        each call is drawn once, in a blocked layout, and only the packed words move (through
        shared memory) to the transposed layout."""
        seed_lo, seed_hi, threshold, off_b, off_h = drop
        CHUNKS: gl.constexpr = (BLOCK_N + 127) // 128
        calls_layout: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 8, 4], [1, 1, num_warps],
                                                      [2, 1, 0])
        chunk = start_n // 128 + gl.arange(
            0, CHUNKS, layout=gl.SliceLayout(1, gl.SliceLayout(2, calls_layout)))
        g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, calls_layout)))
        rows = start_m + gl.arange(0, BLOCK_M,
                                   layout=gl.SliceLayout(0, gl.SliceLayout(1, calls_layout)))
        zero = gl.zeros([CHUNKS, 8, BLOCK_M], gl.uint32, calls_layout)
        calls = zero + gl.expand_dims(gl.expand_dims(chunk, 1) * 8 + gl.expand_dims(g, 0),
                                      2).to(gl.uint32)
        row_ids = zero + gl.expand_dims(gl.expand_dims(rows, 0), 1).to(gl.uint32)
        words = tile_words(philox_calls(seed_lo, seed_hi, off_b, off_h, row_ids, calls),
                           start_n, BLOCK_N)
        T4: gl.constexpr = draw_layout_t(BLOCK_N, BLOCK_M, num_warps)
        return gl.convert_layout(packed_keep(words, threshold), gl.SliceLayout(1, T4))

    @gluon.jit
    def unpack_keep_t(bits, start_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       st_layout: gl.constexpr, num_warps: gl.constexpr):
        """[BLOCK_N, BLOCK_M] bool in st_layout: key j = start_n + r of query column c is kept
        iff bit packed_bit(b) of bits[j // 128 - start_n // 128, j % 8, c] is set, b the byte
        of j within dropout.tile_words' words."""
        gl.static_assert(num_warps * 16 % BLOCK_N == 0, "draw_layout_t: 16 key rows per warp")
        gl.static_assert(BLOCK_N >= 32, "tile_words: whole words")
        T4: gl.constexpr = draw_layout_t(BLOCK_N, BLOCK_M, num_warps)
        BYTES: gl.constexpr = BLOCK_N // 8 if BLOCK_N < 128 else 16
        byte = gl.arange(0, BYTES, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(
            3, T4))))
        bit = gl.expand_dims(gl.expand_dims(gl.expand_dims(packed_bit(byte), 0), 2), 3)
        keep = gl.expand_dims(bits, 1) & (1 << bit)  # [CHUNKS, BYTES, 8, BLOCK_M]
        return gl.convert_layout(gl.reshape(keep, [BLOCK_N, BLOCK_M]), st_layout) != 0

    @gluon.jit
    def _tile_calls(drop, start_m, start_n, BLOCK_N: gl.constexpr):
        """The four words (philox_calls) of the calls (row, chunk, g) of query rows start_m +
        [0, 64) and the chunks of keys start_n + [0, BLOCK_N): [64, CHUNKS, 8] each in
        SliceLayout(2, draw_layout(BLOCK_N)), each thread's own calls."""
        seed_lo, seed_hi, threshold, off_b, off_h = drop
        L3: gl.constexpr = gl.SliceLayout(2, draw_layout(BLOCK_N))  # the calls [64, CHUNKS, 8]
        CHUNKS: gl.constexpr = (BLOCK_N + 127) // 128
        rows = start_m + gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        chunk = start_n // 128 + gl.arange(0, CHUNKS,
                                           layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        zero = gl.zeros([64, CHUNKS, 8], gl.uint32, L3)
        calls = zero + (gl.expand_dims(gl.expand_dims(chunk, 0), 2) * 8
                        + gl.expand_dims(gl.expand_dims(g, 0), 1)).to(gl.uint32)
        row_ids = zero + gl.expand_dims(gl.expand_dims(rows, 1), 2).to(gl.uint32)
        return philox_calls(seed_lo, seed_hi, off_b, off_h, row_ids, calls)

    @gluon.jit
    def _compare_words(words, threshold, BLOCK_N: gl.constexpr):
        """(ge, byte) from `words`, the tile's words of its calls (dropout.tile_words of
        _tile_calls), as [64, CHUNKS, BYTES, 8] in draw_layout: ge holds, for each score, the
        word of its call (word byte // 4) compared four bytes per instruction (dropout.
        bytes_ge), so the score (row, 128 chunk + 8 byte + g) is kept iff bit 8 (byte % 4) + 7
        of ge is set; byte [1, 1, BYTES, 1]."""
        gl.static_assert(BLOCK_N >= 32, "tile_words: whole words")
        L4: gl.constexpr = draw_layout(BLOCK_N)  # [64, CHUNKS, BYTES, 8]
        BYTES: gl.constexpr = BLOCK_N // 8 if BLOCK_N < 128 else 16
        byte = gl.arange(0, BYTES, layout=gl.SliceLayout(1, gl.SliceLayout(0, gl.SliceLayout(
            0, L4))))
        byte = gl.expand_dims(gl.expand_dims(gl.expand_dims(byte, 1), 0), 0)  # [1, 1, BYTES, 1]
        ge = gl.expand_dims(bytes_ge(words[0], threshold), 2)  # [64, CHUNKS, 1, 8]
        for w in gl.static_range(1, len(words)):  # byte b's word, b // 4: known per register
            ge = gl.where(byte // 4 == w, gl.expand_dims(bytes_ge(words[w], threshold), 2), ge)
        return ge, byte

    @gluon.jit
    def _keep_from_words(words, threshold, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
        """[64, BLOCK_N] bool in s_layout from the tile's words (_compare_words), an element
        testing one bit of its word."""
        ge, byte = _compare_words(words, threshold, BLOCK_N)
        keep = ge & (0x80 << (8 * (byte % 4))).to(gl.uint32)  # [64, CHUNKS, BYTES, 8]
        return gl.convert_layout(gl.reshape(keep, [64, BLOCK_N]), s_layout) != 0

    @gluon.jit
    def keep_words(drop, start_m, start_n, BLOCK_N: gl.constexpr):
        """_compare_words' (ge, byte) of dropout.dropout_keep's mask of query rows start_m +
        [0, 64) and keys start_n + [0, BLOCK_N) (start_n a multiple of BLOCK_N), one Philox
        call per (row, chunk, g) of the thread's own scores: only the words the tile uses are
        drawn and compared (the forward masks P pairs with them directly)."""
        words = tile_words(_tile_calls(drop, start_m, start_n, BLOCK_N), start_n, BLOCK_N)
        return _compare_words(words, drop[2], BLOCK_N)

    @gluon.jit
    def keep_tile(drop, start_m, start_n, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
        """[64, BLOCK_N] bool in s_layout (a one-warpgroup score tile, the dQ kernel's):
        dropout.dropout_keep's mask, bit for bit, of query rows start_m + [0, 64) and keys
        start_n + [0, BLOCK_N) (start_n a multiple of BLOCK_N), drawn in draw_layout."""
        words = tile_words(_tile_calls(drop, start_m, start_n, BLOCK_N), start_n, BLOCK_N)
        return _keep_from_words(words, drop[2], BLOCK_N, s_layout)

    @gluon.jit
    def keep_half_tiles(drop, start_m, start_n, upper, fresh, s_layout: gl.constexpr):
        """keep_tile for [64, 64] tiles walked in key order: (keep, upper'), the 64-key tile
        at start_n (a multiple of 64) and the words to hand to the next tile. A 64-key tile
        uses half of each Philox call (words 0, 1 of its 128-key chunk, or 2, 3), so a walk
        over both halves of a chunk would draw every call twice: the tile that starts a chunk
        (or starts the walk: fresh, a runtime bool) draws the calls and keeps words 2, 3 for
        its neighbour; otherwise the tile takes upper, the previous tile's words 2, 3. upper
        is two [64, 1, 8] uint32 in the calls' layout (any values on the walk's first tile)."""
        if fresh | (start_n % 128 == 0):
            words = _tile_calls(drop, start_m, start_n, 64)
            used = tile_words(words, start_n, 64)
            upper = (words[2], words[3])
        else:
            used = upper
        return _keep_from_words(used, drop[2], 64, s_layout), upper

    @gluon.jit
    def no_upper_words():
        """keep_half_tiles' upper before the walk's first tile (fresh: never read)."""
        L3: gl.constexpr = gl.SliceLayout(2, draw_layout(64))
        zero = gl.zeros([64, 1, 8], gl.uint32, L3)
        return (zero, zero)
