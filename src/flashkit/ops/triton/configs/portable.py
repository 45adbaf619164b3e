"""Tiles of the portable Triton kernels (forward.py, backward.py).

One row per padded head dim (the head dim rounded up to a power of two, at least 16), each
(BLOCK_M, BLOCK_N, num_warps, num_stages):
    forward  one program per BLOCK_M query rows, looping over BLOCK_N key columns
    dkdv     one program per BLOCK_N key columns, looping over BLOCK_M query rows
    dq       one program per BLOCK_M query rows, looping over BLOCK_N key columns
SM90 rows: the fastest candidate of `benchmarks/bench_triton.py --sweep` on one H200 (bf16, 16k
tokens, nheads * headdim = 2048, seqlen 4096, full + causal summed; see
benchmarks/notes/kernel-choices.md); the times quoted are full + causal.
"""

from __future__ import annotations

SM90 = {
    "forward": {
        16: (128, 64, 4, 3),  # as d64 (not swept)
        32: (128, 64, 4, 3),  # as d64 (not swept)
        64: (128, 64, 4, 3),  # sweep: 1.266 + 0.729 ms (next: 128,64,8,3)
        128: (128, 128, 8, 3),  # sweep: 1.113 + 0.647 ms (next: 64,64,4,3 1.114 + 0.657)
        256: (128, 64, 8, 2),  # d256 sweep: 1.057 + 0.620 ms (64,64,4,2: 1.310 + 0.766)
    },
    "dkdv": {  # times of the whole backward
        16: (32, 128, 4, 3),  # as d64 (not swept)
        32: (32, 128, 4, 3),  # as d64 (not swept)
        64: (32, 128, 4, 3),  # sweep: 4.048 + 2.284 ms (next: 32,64,4,3)
        128: (64, 128, 8, 3),  # sweep: 3.55 + 2.023 ms (32,64,4,3: 3.616 + 2.076)
        256: (64, 64, 8, 2),  # d256 sweep: 8.239 + 4.585 ms (32,64,8,2: 9.697 + 5.017)
    },
    "dq": {  # times of the whole backward
        16: (128, 64, 8, 3),  # as d64 (not swept)
        32: (128, 64, 8, 3),  # as d64 (not swept)
        64: (128, 64, 8, 3),  # sweep: 3.718 + 2.145 ms
        128: (128, 32, 8, 3),  # sweep: 3.491 + 2.12 ms (128,64,8,3: 3.68 + 2.049)
        # d256: 2 stages, not the sweep's 3 (7.125 + 3.656 ms): with 3, a call with one key
        # (b4, 239 queries, 9 heads, window (0, 0)) faulted with an illegal address within a
        # few repeated backwards on an H200 (never under compute-sanitizer); every 2-stage
        # and smaller tile ran clean (tests/ops/test_triton.py, one-key repeated backward)
        256: (64, 16, 4, 2),
    },
}

# Calls with a score_mod / mask_mod / block mask (flashkit.variants; the Gluon kernels decline
# them): a modifier's table read is an elementwise fp32 gather that the pipeliner buffers in
# shared memory per stage, and its code adds registers, so SM90's d128 tiles overflow or spill
# there. Every row fits sm_90's shared memory with every built-in (offline compiles, checked by
# tests/variants/test_variants_sm90.py). d128: the fastest of five whole (forward, dK/dV, dQ)
# sets over the six built-in examples on one H200 (bf16, 4 x 4096 tokens, 16 heads; step
# 2-19% faster than the spill-free set before; benchmarks/results/variants/
# tiles_20261128_h200.md); d64 / d256 for shared memory only.
VARIANT = {
    "forward": {
        16: (128, 64, 4, 2),  # as d64
        32: (128, 64, 4, 2),  # as d64
        64: (128, 64, 4, 2),  # fits shared memory with every built-in
        128: (128, 128, 8, 2),  # up to 100 B spills; SM90's 3 stages overflow (relative_bias)
        256: (64, 64, 8, 2),  # fits shared memory
    },
    "dkdv": {
        16: (32, 128, 4, 2),  # as d64
        32: (32, 128, 4, 2),  # as d64
        64: (32, 128, 4, 2),  # fits shared memory
        128: (64, 128, 8, 2),  # up to 524 B spills, faster than (32, 128, 8, 2)'s none
        256: (64, 64, 8, 1),  # fits shared memory
    },
    "dq": {
        16: (128, 64, 8, 2),  # as d64
        32: (128, 64, 8, 2),  # as d64
        64: (128, 64, 8, 2),  # fits shared memory
        128: (128, 64, 8, 2),
        256: (64, 16, 4, 2),  # fits shared memory
    },
}

# fp32 inputs (a correctness path, IEEE dots): one small single-stage tile for every head dim,
# so head dim 256 fits in shared memory (dq: 64x256 Q and dO plus 32x256 K and V, 192 KiB).
FP32 = {
    "forward": (64, 32, 4, 1),
    "dkdv": (32, 32, 4, 1),
    "dq": (64, 32, 4, 1),
}

# The CPU interpreter: small, unequal tiles so that tests at seqlen ~50 cross several tiles in
# both directions and run every loop split (masked / unmasked / partial); speed is irrelevant.
INTERPRETER = {
    "forward": (32, 16, 1, 1),
    "dkdv": (16, 32, 1, 1),
    "dq": (32, 16, 1, 1),
}


def padded_head_dim(d: int) -> int:
    """The head dim the kernels compute with: the next power of two, at least 16 (tl.dot's
    minimum)."""
    return max(16, 1 << (d - 1).bit_length())


def tile_config(kernel: str, head_dim: int, element_size: int, interpreter: bool,
                variant: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for `kernel` at a head dim and element size;
    variant: the call has a score_mod, mask_mod or block mask (the VARIANT table)."""
    if interpreter:
        return INTERPRETER[kernel]
    if element_size > 2:
        return FP32[kernel]
    if variant:
        return VARIANT[kernel][padded_head_dim(head_dim)]
    return SM90[kernel][padded_head_dim(head_dim)]
