"""The Triton backend's dropout keep-mask: counter-based Philox, regenerated wherever it is needed.

The mask is a pure function of (seed, batch, head, i, j), so the forward kernel, both backward
kernels and `keep_mask` below (the testing helper's kernel) all draw it through the one jit
helper `dropout_keep` and agree bit for bit, whatever their tiles. Its core (philox_calls,
byte_keep, bytes_ge, packed_keep) takes index tensors the caller built, so the Gluon kernels
draw through the same functions in their own layouts (dropout_gluon.py).

Philox4x32-7 (tl.philox's function with n_rounds = PHILOX_ROUNDS = 7, written out in
philox_calls so each round's two products are wide multiplies; flash-attn's philox.cuh count;
Salmon et al., SC'11, report that Philox4x32-7 passes BigCrush, tl.philox's default of 10 being
their safety margin; going from 10 to 7 changed the mask of every seed, which stays a pure
function of (seed, b, h, i, j) that every kernel and keep_mask draw alike): key = the call's
64-bit seed (params.dropout_seed < 2**62), counter = (g, i, head, batch), four 32-bit words, so
no index is ever folded into one overflowing offset (batch * heads * seqlen_q * seqlen_k passes
2**32 at real sizes). One call yields 16 bytes, one 8-bit draw each (flash-attn's width), for 16
columns of row i: the columns are cut into chunks of 128, and column j takes call g = 8 * (j //
128) + j % 8 and byte c = (j % 128) // 8 of it, i.e. bits 8 (c % 4) .. 8 (c % 4) + 7 of word
c // 4. Why this order: in the accumulator layout of a tensor-core score tile a thread holds,
per row, the column pairs 2t, 2t + 1 of every 8, so the thread that owns an element also owns
all 16 of its call's draws (tiles of >= 128 columns): the draws land where the scores are, with
no shuffle through shared memory and no call computed twice. Element (i, j) is kept iff its
draw >= threshold = round(p * 256): dropout_p is quantized to a multiple of 1/256 (as
flash-attn's uint8 compare) while the kept values are still scaled by 1 / (1 - p); p < 1/512
keeps everything.
The tiled backend uses its own hash (ops/tiled/dropout.py): the two backends drop different
elements for the same seed.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from flashkit.ops.triton.common import interpreting
from flashkit.ops.triton.launch import settle_cache_keys

DRAW_BITS = 8  # bits of one uniform draw: sixteen draws per Philox call
PHILOX_ROUNDS = tl.constexpr(7)  # rounds per Philox4x32 call (see the module docstring)
# Philox4x32's round multipliers and key increments (Salmon et al.; tl.philox's for uint32)
PHILOX_ROUND_A = tl.constexpr(0xD2511F53)
PHILOX_ROUND_B = tl.constexpr(0xCD9E8D57)
PHILOX_KEY_A = tl.constexpr(0x9E3779B9)
PHILOX_KEY_B = tl.constexpr(0xBB67AE85)
# Inline PTX (wide multiplies, lop3) on the GPU; plain Triton in the CPU interpreter, which has
# no inline assembly. Read when triton.jit decorates (as Triton itself reads TRITON_INTERPRET).
PTX = tl.constexpr(not interpreting())
CHUNK = 128  # columns whose draws come from one row's eight Philox calls


def dropout_args(dropout_p: float, seed: int) -> tuple[int, int, int, float, bool]:
    """(seed_lo, seed_hi, threshold, 1 / (1 - p), DROPOUT) as the kernels take them.

    The seed travels as two int32 halves (seed_lo reinterpreted as signed), so every seed gives
    the kernel the same argument types and one compiled variant.
    """
    if dropout_p == 0:
        return 0, 0, 0, 1.0, False
    seed_lo = seed & 0xFFFFFFFF
    seed_lo -= (seed_lo >> 31) << 32
    threshold = min(round(dropout_p * 2**DRAW_BITS), 2**DRAW_BITS)
    return seed_lo, seed >> 32, threshold, 1.0 / (1.0 - dropout_p), True


@triton.jit
def philox_calls(seed_lo, seed_hi, off_b, off_h, rows, calls):
    """The four uint32 words of Philox calls (seed; call, row, head, batch): rows and calls are
    uint32 index tensors of the calls' full shape, built by the caller (Triton without a layout,
    Gluon in its own), so every kernel generation draws through this one function.

    Philox4x32-7 bit for bit as tl.philox(seed, calls, rows, head, batch, n_rounds=7), with each
    round's two 32 x 32 -> 64-bit products as one wide multiply (_mul_wide)."""
    zero = calls * 0
    c0, c1, c2, c3 = calls, rows, zero + off_h.to(tl.uint32), zero + off_b.to(tl.uint32)
    k0 = seed_lo.to(tl.uint32, bitcast=True)
    k1 = seed_hi.to(tl.uint32)
    for _ in tl.static_range(PHILOX_ROUNDS):
        lo_a, hi_a = _mul_wide(c0, PHILOX_ROUND_A)
        lo_b, hi_b = _mul_wide(c2, PHILOX_ROUND_B)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = tl.add(k0, PHILOX_KEY_A, sanitize_overflow=False)
        k1 = tl.add(k1, PHILOX_KEY_B, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.constexpr_function
def _mul_wide_asm(multiplier):
    """PTX of (lo, hi) = x * multiplier (a uint32 constant) as one 32 x 32 -> 64-bit product."""
    return "{ .reg .b64 w; mul.wide.u32 w, $2, " + hex(multiplier) + "; mov.b64 {$0, $1}, w; }"


@triton.jit
def _mul_wide(x, MULTIPLIER: tl.constexpr):
    """(lo, hi) 32-bit halves of x * MULTIPLIER (x uint32): one mul.wide.u32 on the GPU, i.e. one
    IMAD.WIDE.U32 where mul.lo and mul.hi (tl.philox's) are two IMADs (ptxas does not fuse
    them); in the interpreter the two products themselves."""
    if PTX:
        lo, hi = tl.inline_asm_elementwise(_mul_wide_asm(MULTIPLIER), "=r,=r,r", [x],
                                           dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        lo, hi = tl.mul(x, MULTIPLIER, sanitize_overflow=False), tl.umulhi(x, MULTIPLIER)
    return lo, hi


@triton.jit
def byte_keep(words, byte, threshold):
    """Keep decisions: byte `byte` (0..15) of each call's words >= threshold, for words (the
    four of philox_calls) and byte already expanded to broadcast against each other."""
    r0, r1, r2, r3 = words
    word = tl.where(byte < 8, tl.where(byte < 4, r0, r1), tl.where(byte < 12, r2, r3))
    return ((word >> ((byte % 4) * 8).to(tl.uint32)) & 0xFF).to(tl.int32) >= threshold


@triton.jit
def tile_words(words, start_n, BLOCK_N: tl.constexpr):
    """The words of each call (of philox_calls' four) that hold the draws of the tile of
    columns start_n + [0, BLOCK_N) (start_n a multiple of BLOCK_N): all four from 128 columns
    on, else the BLOCK_N / 32 (at least one) that hold its bytes."""
    if BLOCK_N >= 128:
        chosen = words
    else:
        first = (start_n % 128) // 32
        if BLOCK_N == 64:
            chosen = (tl.where(first == 0, words[0], words[2]),
                      tl.where(first == 0, words[1], words[3]))
        else:
            chosen = (tl.where(first < 2, tl.where(first == 0, words[0], words[1]),
                               tl.where(first == 2, words[2], words[3])), )
    return chosen


@triton.jit
def tile_bytes_in_words(start_n, BLOCK_N: tl.constexpr):
    """[min(16, BLOCK_N / 8)]: the tile's bytes counted within tile_words' words."""
    if BLOCK_N >= 32:
        byte = tl.arange(0, min(BLOCK_N // 8, 16))
    else:
        byte = (start_n % 32) // 8 + tl.arange(0, BLOCK_N // 8)
    return byte


@triton.jit
def packed_bit(byte):
    """The bit of packed_keep's int32 that holds the decision of byte `byte` of its words."""
    return 8 * (byte % 4) + 7 - byte // 4


@triton.jit
def bytes_ge(x, threshold):
    """Four keep decisions per instruction (SWAR): bit 8 c + 7 of the result is set iff byte c
    of the uint32 x is >= threshold (0..256, uniform); the other bits are unspecified.

    With H the bytes' high bits, r = (x | H) - low7(t) (t = threshold, low7 per byte) subtracts
    without a borrow between bytes, so r's high bit says low7(x) >= low7(t). Then x >= t is
    x_hi | r_hi for t < 128 and x_hi & r_hi for t >= 128: the majority of x, r and a uniform
    mask (all ones for t < 128), one lop3 (ptxas makes a select of two from the and/or form).
    t = 256 keeps nothing: it subtracts H instead (r = low7(x), so r_hi = 0) with the and-form.
    Three instructions per word, none with a second uniform operand (a LOP3 takes one)."""
    high = 0x80808080
    sub = tl.where(threshold < 256, (threshold & 0x7F).to(tl.uint32) * 0x01010101, high)
    r = (x | high) - sub.to(tl.uint32)
    or_form = tl.where(threshold < 128, 0xFFFFFFFF, 0).to(tl.uint32)
    if PTX:
        ge = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xE8;", "=r,r,r,r",
                                       [x, r, or_form], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        ge = (x & r) | ((x | r) & or_form)
    return ge


@triton.jit
def packed_keep(words, threshold):
    """int32 per call: the keep decisions of every byte of `words` (a tuple of up to four of a
    call's words, e.g. tile_words'), byte c at bit packed_bit(c), other bits 0, for a tile whose
    elements sit far from their calls (see dropout_keep_t). Word w's decisions (bytes_ge) land
    on the high bits and move right by w, so four words fill bits 4..7 of each byte."""
    high = 0x80808080
    for w in tl.static_range(len(words)):
        ge = bytes_ge(words[w], threshold) & high
        if w == 0:
            bits = ge
        else:
            bits = bits | (ge >> w)
    return bits.to(tl.int32, bitcast=True)


@triton.jit
def _philox_words(seed_lo, seed_hi, off_b, off_h, offs_m, start_n, BLOCK_N: tl.constexpr):
    """The four words [BLOCK_M, CHUNKS, 8] of the calls (chunk, g) of rows offs_m that the tile
    of columns start_n + [0, BLOCK_N) needs: CHUNKS = ceil(BLOCK_N / 128)."""
    CHUNKS: tl.constexpr = (BLOCK_N + 127) // 128
    zero = tl.zeros([offs_m.shape[0], CHUNKS, 8], dtype=tl.uint32)
    chunk = start_n // 128 + tl.arange(0, CHUNKS)
    call = chunk[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    return philox_calls(seed_lo, seed_hi, off_b, off_h,
                        zero + offs_m[:, None, None].to(tl.uint32), zero + call.to(tl.uint32))


@triton.jit
def _tile_bytes(start_n, BLOCK_N: tl.constexpr):
    """[min(16, BLOCK_N / 8)]: the bytes of each call that the tile of columns start_n +
    [0, BLOCK_N) uses (all 16, or the middle of the calls for a tile narrower than a chunk)."""
    if BLOCK_N >= 128:
        byte = tl.arange(0, 16)
    else:
        byte = (start_n % 128) // 8 + tl.arange(0, BLOCK_N // 8)
    return byte


@triton.jit
def dropout_keep(seed_lo, seed_hi, off_b, off_h, offs_m, start_n, threshold,
                 BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool: keep (i, j) for rows offs_m and columns start_n + [0, BLOCK_N)
    of (batch off_b, head off_h); start_n is a multiple of BLOCK_N, itself a multiple of 8.

    Built as [BLOCK_M, CHUNKS, BYTES, 8] (column = start_n + 128 chunk + 8 byte + g) so one
    Philox call per (row, chunk, g) broadcasts over its bytes; the reshape to [BLOCK_M, BLOCK_N]
    keeps the order, and in a score tile's layout every thread computes just its own calls.
    """
    byte = _tile_bytes(start_n, BLOCK_N)
    r0, r1, r2, r3 = _philox_words(seed_lo, seed_hi, off_b, off_h, offs_m, start_n, BLOCK_N)
    words = (r0[:, :, None, :], r1[:, :, None, :], r2[:, :, None, :], r3[:, :, None, :])
    keep = byte_keep(words, byte[None, None, :, None], threshold)  # [BLOCK_M, CHUNKS, BYTES, 8]
    return tl.reshape(keep, [offs_m.shape[0], BLOCK_N])


@triton.jit
def dropout_keep_t(seed_lo, seed_hi, off_b, off_h, offs_m, start_n, threshold,
                   BLOCK_N: tl.constexpr):
    """dropout_keep transposed, [BLOCK_N, BLOCK_M], for a tile whose rows are keys.

    There a thread holds two keys of a call, not sixteen, so drawing in place would repeat each
    call 8 times. Instead each call packs its tile's decisions into one int32 where the calls
    are (one per element of [BLOCK_M, CHUNKS, 8]); a sum over a unit axis keeps the compiler
    from moving the draws into the transposed layout, so only the packed words change layout.
    """
    byte = tile_bytes_in_words(start_n, BLOCK_N)
    r0, r1, r2, r3 = _philox_words(seed_lo, seed_hi, off_b, off_h, offs_m, start_n, BLOCK_N)
    bits = packed_keep(tile_words((r0, r1, r2, r3), start_n, BLOCK_N), threshold)
    bits = tl.sum(bits[:, :, :, None], axis=3)  # the layout firewall
    bits_t = tl.permute(bits, (1, 2, 0))  # [CHUNKS, 8, BLOCK_M]
    keep = (bits_t[:, None, :, :] >> packed_bit(byte)[None, :, None, None]) & 1
    return tl.reshape(keep != 0, [BLOCK_N, offs_m.shape[0]])  # from [CHUNKS, BYTES, 8, M]


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "threshold"])
def _keep_mask_kernel(Mask, seed_lo, seed_hi, threshold, nheads, seqlen_q, seqlen_k,
                      stride_b, stride_h, stride_m,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Mask (batch, nheads, seqlen_q, seqlen_k) int8, contiguous in the key dim."""
    off_b = tl.program_id(2) // nheads
    off_h = tl.program_id(2) % nheads
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    start_n = tl.program_id(1) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    keep = dropout_keep(seed_lo, seed_hi, off_b, off_h, offs_m, start_n, threshold, BLOCK_N)
    ptrs = (Mask + off_b.to(tl.int64) * stride_b + off_h * stride_h
            + offs_m[:, None] * stride_m + offs_n[None, :])
    tl.store(ptrs, keep.to(tl.int8),
             mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k))


def keep_mask(seed: int, dropout_p: float, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
              device) -> torch.Tensor:
    """The bool keep-mask (batch, nheads, seqlen_q, seqlen_k) the kernels draw for (seed,
    dropout_p > 0), computed on `device` (a CUDA device, or the CPU under TRITON_INTERPRET=1) by
    the kernels' own helper."""
    seed_lo, seed_hi, threshold, _, _ = dropout_args(dropout_p, seed)
    mask = torch.empty((batch, nheads, seqlen_q, seqlen_k), dtype=torch.int8, device=device)
    block_m, block_n = 16, 128
    grid = (triton.cdiv(seqlen_q, block_m), triton.cdiv(seqlen_k, block_n), batch * nheads)
    if mask.numel():
        settle_cache_keys(_keep_mask_kernel)
        with torch.cuda.device(mask.device) if mask.is_cuda else contextlib.nullcontext():
            _keep_mask_kernel[grid](mask, seed_lo, seed_hi, threshold, nheads, seqlen_q,
                                    seqlen_k, *mask.stride()[:3], BLOCK_M=block_m,
                                    BLOCK_N=block_n)
    return mask.bool()

