"""Tile configurations of the Triton attention kernels, as data (importable without triton).

One row per padded head dim (the head dim rounded up to a power of two, at least 16). Each
entry is (BLOCK_M, BLOCK_N, num_warps, num_stages):
    forward  one program per BLOCK_M query rows, looping over BLOCK_N key columns
    dkdv     one program per BLOCK_N key columns, looping over BLOCK_M query rows
    dq       one program per BLOCK_M query rows, looping over BLOCK_N key columns

HOPPER: chosen on one H200 (torch 2.11, triton 3.6.0) by the config sweep of
`benchmarks/bench_triton.py --sweep` (bf16, 16k tokens, nheads * headdim = 2048, seqlen 4096,
causal and not): the fastest entry of the sweep's candidate list per head dim, see
benchmarks/NOTES_triton.md and benchmarks/results/triton_sweep_*.json.

INTERPRETER: small, unequal tiles so that CPU tests at seqlen ~50 cross several tiles in both
directions and exercise every loop split (masked / unmasked / partial); speed is irrelevant there.
"""

from __future__ import annotations

HOPPER = {
    "forward": {
        16: (128, 64, 4, 3),
        32: (128, 64, 4, 3),
        64: (128, 64, 4, 3),  # sweep 2026-11-21 02:06: 1.266 + 0.729 ms (next: 128,64,8,3)
        128: (128, 128, 8, 3),  # 1.113 + 0.647 ms (next: 64,64,4,3 at 1.114 + 0.657)
        256: (128, 64, 8, 2),  # 02:38 d256 sweep: 1.057 + 0.620 ms (64,64,4,2: 1.310 + 0.766)
    },
    "dkdv": {
        16: (32, 128, 4, 3),
        32: (32, 128, 4, 3),
        64: (32, 128, 4, 3),  # whole backward 4.048 + 2.284 ms (next: 32,64,4,3)
        128: (64, 128, 8, 3),  # 3.55 + 2.023 ms (02:17 sweep; 32,64,4,3: 3.616 + 2.076)
        256: (64, 64, 8, 2),  # 02:38 d256 sweep: 8.239 + 4.585 ms (32,64,8,2: 9.697 + 5.017)
    },
    "dkdv_atomic": {  # 02:26 sweep, whole backward full + causal at 4k
        16: (64, 64, 4, 3),
        32: (64, 64, 4, 3),
        64: (64, 64, 4, 3),  # 4.123 + 2.473 ms (32,128,4,3: 4.199 + 2.428)
        128: (64, 128, 8, 3),  # 3.655 + 2.083 ms
        256: (32, 64, 8, 2),
    },
    "dq": {
        16: (128, 64, 8, 3),
        32: (128, 64, 8, 3),
        64: (128, 64, 8, 3),  # whole backward 3.718 + 2.145 ms
        128: (128, 32, 8, 3),  # 3.491 + 2.12 ms (02:17 sweep; 128,64,8,3: 3.68 + 2.049)
        256: (64, 16, 4, 3),  # 02:38 d256 sweep: 7.125 + 3.656 ms (64,32,8,2: 9.703 + 5.018)
    },
}

# Calls with a score_mod / mask_mod / block mask (flashkit.variants) run these portable
# kernels (the Gluon kernels decline them). Their tiles differ from HOPPER's for two measured
# reasons (offline sm_90 compiles with the launch's own alignment specialisation, ptxas
# counts; tests/variants/test_variants_sm90.py checks the shared memory of every built-in):
# a modifier's table read (tl.load of a captured tensor at q_idx / kv_idx) is an elementwise
# [BLOCK_M, BLOCK_N] fp32 gather that Triton's pipeliner buffers in shared memory per stage,
# so HOPPER's d128 forward (128, 128, 8, 3) needs 360448 bytes with relative_bias (232448 on
# sm_90) and 230400 with the document mask; and the modifier's code adds registers, so the
# d128 forward spilled 300-1384 bytes there and dK/dV 228-344 with alibi / softcap. At d128
# the forward's (128, 64, 8, 2) compiles every built-in without spills in 98-131 KB (and in
# half the compile time), dK/dV's (32, 128, 8, 2) without spills except relative_bias (144
# bytes; (64, 64, 8, 2): 84-216, (64, 64, 4, 2): 312-1172), dQ's (128, 32, 8, 2) without.
# d64 / d256 rows: checked for shared memory only. Speed of the candidates:
# benchmarks/suites/variants.py --parts configs.
VARIANT = {
    "forward": {
        16: (128, 64, 4, 2),
        32: (128, 64, 4, 2),
        64: (128, 64, 4, 2),
        128: (128, 64, 8, 2),
        256: (64, 64, 8, 2),
    },
    "dkdv": {
        16: (32, 128, 4, 2),
        32: (32, 128, 4, 2),
        64: (32, 128, 4, 2),
        128: (32, 128, 8, 2),
        256: (64, 64, 8, 1),
    },
    "dq": {
        16: (128, 64, 8, 2),
        32: (128, 64, 8, 2),
        64: (128, 64, 8, 2),
        128: (128, 32, 8, 2),
        256: (64, 16, 4, 2),
    },
}

# Forward K/V loads through TMA descriptors where the layout allows (common.kv_descriptor).
# Off: the 02:17 sweep measured no gain (d128 4k: 1.144 ms with TMA vs 1.119 with pointers,
# d64: 1.373 vs 1.310), Triton 3.6 already pipelines the pointer loads with cp.async.
USE_TMA = False

# Forward on sm_90 through the Gluon kernel of forward_hopper.py (fp16/bf16, head dim 64/128/256,
# every feature, varlen too): async wgmma lets the softmax of one tile overlap the
# P V matmul of the previous one. Measured: see benchmarks/NOTES_triton.md.
GLUON_FORWARD = True

# Its tiles: (BLOCK_N, NUM_STAGES, CONSUMERS, SPECIALIZED, PINGPONG, PERSISTENT). Every
# consumer is one warpgroup owning 64 query rows. SPECIALIZED: a producer warp issues the TMA
# loads and CONSUMERS warpgroups share each K/V tile (FA3's layout, one program per SM at two or
# three consumers); else one warpgroup issues its own loads and two or three programs share an
# SM (session 2's kernel). PINGPONG (two or more consumers): they take turns issuing their
# wgmmas. PERSISTENT (specialized): one program per SM (two at one consumer) loops over
# (query tile, head) items, its producer loading the next item's Q and K/V while the consumers
# finish the last; causal items are dealt longest first.
# Sweep 2026-11-21 05:10 (speed_20261121_0510.json, 4k, bf16, TFLOP/s full / causal): d128
# two consumers + producer, BLOCK_N 128, ping-pong 599 / 518 (no ping-pong 597 / 513; session 2's
# one-warpgroup (64, 3, 1) 512 / 461); d64 the one-warpgroup kernel stays best: (128, 2, 1)
# 442 / 390, (128, 3, 1) 449 / 389, two consumers 436 / 378. Per cell (05:31,
# speed_20261121_0531.json, 1k..16k): d128 1k causal one warpgroup 340 vs two consumers 313;
# d64 three consumers + producer from 4k full / 8k causal (4k/8k/16k full 439/483/504 vs one
# warpgroup 429/438/450; causal 376/441/481 vs 373/409/428; 05:36: full 460/499/515 vs
# 436/453/454, causal 356/428/473 vs 380/408/423), one warpgroup up to 2k (1k 389/278 vs
# 329/197); BLOCK_N 256 (one warpgroup, 250 registers) 133-256 everywhere.
# d256 (session 5): with two consumers only 64-key tiles fit (Q 64 KB + 2 stages of K and V at
# 32 KB each = 192 KB of shared memory; 240 registers per consumer thread hold O's 128 and S's
# 32 without spills, offline sm_90). Sweep 2026-11-21 08:38 (speed_20261121_083*_d256_s*.json,
# bf16, 1k/2k/4k/16k TFLOP/s): full, (64, 2, 2) ping-pong 553/664/710/702 (no ping-pong
# 542/618/672/696; (32, 4, 2) 422-517; one warpgroup (64, 2, 1) 325-420; cuDNN 611/643/670/669);
# causal, no ping-pong 381/487/552/670 (ping-pong 380/475/543/668; cuDNN 455/528/556/616).
# Short lengths, 08:41 (speed_20261121_084*_d{64,128}_s*.json, 1k/2k full / causal): the rows
# above stay best in 7 of 8 cells against a producer with one consumer (two programs per SM:
# d128 (64, 2, 1) 454/351 at 1k, 492/416 at 2k; (64, 3, 1) 452/346, 497/410; d64 (128, 2, 1)
# 367/256, 411/327) and two consumers on 64-key tiles (d128 425/304, 480/387; d64 (128, 2, 2)
# 331/221, 390/303); configured d128 479/344, 580/433, d64 404/285, 448/341; cuDNN d128
# 581/435, 635/504, d64 438/335, 464/390. The one win, d128 1k causal (64, 2, 1) +2%, is
# within noise and not taken: the <= 2k gap is no tile choice (FA3 closes it with a persistent
# grid, see benchmarks/NOTES_triton.md).
# Persistent grid, 08:55 (speed_20261121_0855_persistent.json, bf16, TFLOP/s persistent vs the
# per-item grid of the same tile, full / causal; GPU tests of 1/3/5-program grids passed first):
# d128 (128, 2, 2) full 552 vs 477 at 1k, 588 vs 579 at 2k, 621 vs 642 at 4k; causal (items
# dealt longest first) 333/411/483 vs 321/430/507 and the configured 344 at 1k; d64 full (128,
# 2, 3) 384/462/480 vs 342/437/493 (configured (128, 2, 1) 402/449 at 1k/2k, (128, 2, 2)
# persistent 394/427), causal 225-378, below the configured 286/338/383. Repeated 08:56
# (_repeat1/2.json): d128 full 1k 555/554 vs 477/476 (0.96x cuDNN, 1.69x FA2), 2k 575/587 vs
# 548/548. So d128 full up to 2k takes it (1k +16%, 2k +2/+5/+7%); everywhere else the per-item
# grid stays (likely: causal work dealt statically balances worse than the hardware's dynamic
# block scheduling, and from 4k the per-item prologue/epilogue it hides weighs little).
# Rows (head_dim, banded, longest seqlen_q or None, tile), the first match wins; banded: a right
# bound (causal or a window).
GLUON_FORWARD_TILES = (
    (64, False, 2048, (128, 2, 1, False, False, False)),
    (64, True, 4096, (128, 2, 1, False, False, False)),
    (64, None, None, (128, 2, 3, True, True, False)),
    (128, True, 1024, (64, 3, 1, False, False, False)),
    (128, False, 2048, (128, 2, 2, True, True, True)),
    (128, None, None, (128, 2, 2, True, True, False)),
    (256, True, None, (64, 2, 2, True, False, False)),
    (256, None, None, (64, 2, 2, True, True, False)),
)


def gluon_forward_tile(head_dim: int, seqlen_q: int, banded: bool) -> tuple:
    """The Gluon forward's tile for a head dim (64, 128 or 256), query length and band."""
    for row_dim, row_banded, longest, tile in GLUON_FORWARD_TILES:
        if (row_dim == head_dim and row_banded in (None, banded)
                and (longest is None or seqlen_q <= longest)):
            return tile
    raise KeyError(f"no Gluon forward tile for head dim {head_dim}")


# Backward of the plain case (as GLUON_FORWARD) through the Gluon dK/dV kernel of
# backward_hopper.py on sm_90: K/V resident in shared memory, Q/dO streamed by TMA, async wgmma.
# GLUON_BACKWARD_ATOMIC_DQ: that kernel also computes dQ_p = dS K (5 matmuls per tile pair instead
# of 7; never under params.deterministic), stages it in fp32 in the Q/dO ring buffers its dK/dV
# wgmmas just consumed and adds it into an fp32 accumulator by bulk TMA reduce-add (FA3's way;
# backward.py then scales and converts). Off: slower than the separate dQ kernel in every cell
# (backward_20261121_0651_tma_reduce_dq.json, bf16, 16k tokens, TFLOP/s reduce-add / separate /
# cuDNN: d128 16k full 429 / 452 / 550, causal 421 / 449 / 528; d64 16k full 414 / 427 / 456;
# 0.87-0.97x over 1k/4k/16k, worst at 1k causal). Element atomics from registers (05:15) were worse:
# d128 16k full 324 / 434. Why (reasoned, not profiled): one warpgroup per program runs S^T/dP^T,
# dV/dK and both dQ halves as one dependent chain, with 32 KB of fp32 staging stores and barriers
# per tile in it (the separate kernels do 7 matmuls in the time of 5 at ~630 TFLOP/s of tensor work;
# the fused one reaches ~430), and BLOCK_N 64 makes every query tile's dQ pass through the L2 reduce
# seqlen_k / 64 times (32 GB at d128 16k full, about 2.5 TB/s). BLOCK_N 128 with two warpgroups (64,
# 128, 8, 2/3) halves that but, one program per SM without a producer warp, loses more (d128 4k full
# 400-407). Next: FA3's warp-specialized layout (producer warp, two consumer warpgroups, a dQ-writer
# warp issuing the reduce-adds).
GLUON_BACKWARD = True
GLUON_BACKWARD_ATOMIC_DQ = False

# Non-deterministic backward: dQ by fp32 atomics inside the dK/dV kernel instead of its own kernel.
# Off: slower on every case of the 02:26 grid (d128 16k full: 358 vs 392 TFLOP/s; d64 4k full:
# 289 vs 353), element atomics and TMA bulk reduce-adds alike, so deterministic is the default.
ATOMIC_DQ = False

# Backward: launch the dK/dV and dQ programs together in one grid (each with its own tiles, the
# dK/dV entry's warps and stages) instead of two kernels in a row. Off: the 02:46 grid measured
# the single launch slower at head dim 128 (16k full 372 vs 386 TFLOP/s, 1k causal 187 vs 206)
# and a wash at 64, so the two launches (same kernel, DO_DKDV / DO_DQ) are the default.
FUSED_BWD = False

# fp32 inputs (a correctness path, IEEE dots): one small tile for every head dim, single-stage,
# so head dim 256 fits in shared memory (dq: 64x256 Q and dO plus 32x256 K and V, 192 KiB).
FP32 = {
    "forward": (64, 32, 4, 1),
    "dkdv": (32, 32, 4, 1),
    "dkdv_atomic": (32, 32, 4, 1),
    "dq": (64, 32, 4, 1),
}

INTERPRETER = {
    "forward": (32, 16, 1, 1),
    "dkdv": (16, 32, 1, 1),
    "dkdv_atomic": (16, 32, 1, 1),
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
    if variant and kernel in VARIANT:
        return VARIANT[kernel][padded_head_dim(head_dim)]
    return HOPPER[kernel][padded_head_dim(head_dim)]
