"""The Triton backend's dropout keep-mask: counter-based Philox, regenerated wherever it is needed.

The mask is a pure function of (seed, batch, head, i, j), so the forward kernel, both backward
kernels and `keep_mask` below (the testing helper's kernel) all draw it through the one jit
helper `dropout_keep` and agree bit for bit, whatever their tiles.

Philox4x32-10 (tl.philox): key = the call's 64-bit seed (params.dropout_seed < 2**62), counter =
(j // 8, i, head, batch), four 32-bit words, so no index is ever folded into one overflowing
offset (batch * heads * seqlen_q * seqlen_k passes 2**32 at real sizes). One call yields four
32-bit words = eight 16-bit draws, for the eight columns 8g..8g+7 of row i: column 8g + c takes
the low (c even) or high (c odd) half of word c // 2. Element (i, j) is kept iff its draw >=
threshold = round(p * 2**16): a keep probability of 1 - p to within 2**-17.
The tiled backend uses its own hash (ops/tiled/dropout.py): the two backends drop different
elements for the same seed.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

DRAW_BITS = 16  # bits of one uniform draw: eight draws per Philox call


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
def _interleave(a, b):
    """[R, C] and [R, C] -> [R, 2C] with a in the even columns and b in the odd ones."""
    return tl.reshape(tl.join(a, b), [a.shape[0], 2 * a.shape[1]])


@triton.jit
def dropout_keep(seed_lo, seed_hi, off_b, off_h, offs_m, start_n, threshold,
                 BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool: keep (i, j) for rows offs_m and columns start_n + [0, BLOCK_N)
    of (batch off_b, head off_h); start_n is a multiple of 8."""
    seed = (seed_hi.to(tl.uint64) << 32) | seed_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
    # one Philox call per 8 columns (every BLOCK_N is a multiple of 8)
    zero = tl.zeros([offs_m.shape[0], BLOCK_N // 8], dtype=tl.uint32)
    groups = start_n // 8 + tl.arange(0, BLOCK_N // 8)
    c0 = zero + groups[None, :].to(tl.uint32)
    c1 = zero + offs_m[:, None].to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, zero + off_h.to(tl.uint32),
                               zero + off_b.to(tl.uint32))
    # Draws 0..7 into columns 0..7 of each group: three rounds of pairwise interleaving.
    words = _interleave(_interleave(r0, r2), _interleave(r1, r3))  # [R, 4C]: r0 r1 r2 r3 per group
    draws = _interleave((words & 0xFFFF).to(tl.int32), (words >> 16).to(tl.int32))
    return draws >= threshold


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
    block_m, block_n = 16, 64
    grid = (triton.cdiv(seqlen_q, block_m), triton.cdiv(seqlen_k, block_n), batch * nheads)
    if mask.numel():
        with torch.cuda.device(mask.device) if mask.is_cuda else contextlib.nullcontext():
            _keep_mask_kernel[grid](mask, seed_lo, seed_hi, threshold, nheads, seqlen_q,
                                    seqlen_k, *mask.stride()[:3], BLOCK_M=block_m,
                                    BLOCK_N=block_n)
    return mask.bool()

