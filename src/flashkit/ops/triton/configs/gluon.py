"""Tiles of the sm_90 Gluon kernels (forward_hopper.py, backward_hopper.py).

Measured on one H200 (torch 2.11, triton 3.6.0), bf16, TFLOP/s full / causal unless a line
says otherwise, by the tile sweeps of benchmarks/bench_speed.py (forward) and
benchmarks/bench_backward.py (backward); benchmarks/notes/kernel-choices.md gives the runs
and the candidates they beat.
"""

from __future__ import annotations

# Forward on sm_90 through the Gluon kernel (fp16/bf16, head dim 64/128/256, every feature,
# varlen and paged too): async wgmma lets the softmax of one tile overlap the P V matmul of the
# previous one.
GLUON_FORWARD = True

# Forward tiles (BLOCK_N, NUM_STAGES, CONSUMERS, SPECIALIZED, PINGPONG, PERSISTENT); every
# consumer is one warpgroup owning 64 query rows. SPECIALIZED: a producer warp issues the TMA
# loads and CONSUMERS warpgroups share each K/V tile (FA3's layout); else one warpgroup issues
# its own loads and two or three programs share an SM. PINGPONG: consumers take turns issuing
# their wgmmas. PERSISTENT: one program per SM (two at one consumer) loops over (query tile,
# head) items, longest causal items first.
# Rows (head_dim, banded, longest seqlen_q or None, tile), the first match wins; banded: a right
# bound (causal or a window).
GLUON_FORWARD_TILES = (
    # one warpgroup up to 2k full: 1k 389 vs 329 for three consumers (tile sweep)
    (64, False, 2048, (128, 2, 1, False, False, False)),
    # one warpgroup up to 4k causal: 4k 380 vs 356 for three consumers (tile sweep)
    (64, True, 4096, (128, 2, 1, False, False, False)),
    # three consumers + producer, ping-pong: 8k/16k full 499/515 vs 453/454 (tile sweep)
    (64, None, None, (128, 2, 3, True, True, False)),
    # one warpgroup, 64-key tiles, up to 1k causal: 340 vs 313 (tile sweep)
    (128, True, 1024, (64, 3, 1, False, False, False)),
    # two consumers, ping-pong, persistent up to 2k full: 1k 552 vs 477 (tile sweep)
    (128, False, 2048, (128, 2, 2, True, True, True)),
    # two consumers + producer, ping-pong: 4k 599 / 518 vs one warpgroup 512 / 461 (tile sweep)
    (128, None, None, (128, 2, 2, True, True, False)),
    # causal, no ping-pong: 1k-16k 381/487/552/670 vs 380/475/543/668 (tile sweep)
    (256, True, None, (64, 2, 2, True, False, False)),
    # full, ping-pong: 1k-16k 553/664/710/702 vs 542/618/672/696 (tile sweep)
    (256, None, None, (64, 2, 2, True, True, False)),
)


# Tiles of a call with a user's block mask (flashkit.variants.BlockMask), per head dim: its
# blocks must hold whole tiles (query blocks of 128 rows: two consumers; key blocks of 128
# keys, 64 at d256). Not swept: the plain kernel's long-sequence tiles, not persistent (one
# item's tiles are its mask row's listed blocks).
GLUON_FORWARD_BLOCK_MASK = {
    64: (128, 2, 2, True, True, False),  # the plain d64 tile has three consumers (192 rows)
    128: (128, 2, 2, True, True, False),  # document, 4k: 0.297-0.50 ms vs Flex 0.315 (variants)
    256: (64, 2, 2, True, True, False),
}


def gluon_forward_tile(head_dim: int, seqlen_q: int, banded: bool) -> tuple:
    """The Gluon forward's tile for a head dim (64, 128 or 256), query length and band."""
    for row_dim, row_banded, longest, tile in GLUON_FORWARD_TILES:
        if (row_dim == head_dim and row_banded in (None, banded)
                and (longest is None or seqlen_q <= longest)):
            return tile
    raise KeyError(f"no Gluon forward tile for head dim {head_dim}")


# Backward of the plain case through the Gluon dK/dV and dQ kernels on sm_90: K/V (dK/dV) or
# Q/dO (dQ) resident in shared memory, the other pair streamed by TMA, async wgmma.
GLUON_BACKWARD = True

# (BLOCK_M, BLOCK_N, num_warps, NUM_STAGES) per head dim. dK and dV stay in registers ([BLOCK_N,
# D] fp32 each): one warpgroup holds 64 * 128 of each, so head dim 256 takes two, each owning
# half of the columns.
GLUON_BACKWARD_DKDV = {
    64: (128, 64, 4, 2),  # 4k whole backward 397 / 365 vs (64, 64, 4, 2) 395 / 350 (tile sweep)
    128: (64, 64, 4, 2),  # 4k 418 / 381 vs 8 warps (64, 128) 411 / 362 (tile sweep)
    # two warpgroups: 4k 370 / 341 vs (64, 64, 8, 1) 346 / 325, (128, 64, 8, 1) 342 / 334
    256: (64, 64, 8, 2),
}
# Query rows per sequence from which a call whose q, k or v the Gluon kernels cannot read in
# place (hopper_common.tma_layout) runs them on contiguous copies (dispatch.ON_COPIES); below,
# the portable kernels read its strides. Measured on SDPA-layout tensors before the kernels read
# those in place: H200, causal bf16 d128, 16 / 4 heads, 4096 tokens, copies over the portable
# kernels, forward / step: 4096 rows 1.00 / 0.73, 1024 rows 0.96 / 0.96, 512 rows 1.10 / 1.30,
# 256 rows 1.11 / 1.15, one row (decoding) 1.07 / -.
GLUON_COPIES_MIN_QUERIES = 1024

# A banded (causal or windowed) backward launch with at most this many programs per SM starts
# every head's heaviest tile first (backward_hopper.tile_order); a larger launch runs each head's
# tiles together, where they share the head's streamed tiles in L2. H200, backward alone, causal
# bf16 d128 (diagnostics/tree_ab.py --cases backward): a transformers Llama's GQA call (batch 2,
# 4096 tokens, 16 / 4 heads, 512 dK/dV programs) 1.275 -> 1.022 and 1.200 -> 0.999 ms in two runs
# heaviest first; with 4096 programs or more the head-by-head order was 0-13% faster.
GLUON_BACKWARD_ACROSS_HEADS_PER_SM = 8
GLUON_BACKWARD_DQ = {
    64: (64, 64, 4, 2),  # 4k whole backward 408 / 357 vs (64, 64, 4, 3) 387 / 346 (tile sweep)
    128: (64, 64, 4, 2),  # 4k 441 / 391 vs (64, 128, 4, 2) 404 / 371 (tile sweep)
    # 4k whole backward (then backward.py's dK/dV) 263 / 233 vs (64, 32, 4, 2) 244 / 218,
    # (128, 32, 8, 2) 254 / 224, the portable dQ 218 / 193 (tile sweep)
    256: (64, 64, 4, 2),
}
