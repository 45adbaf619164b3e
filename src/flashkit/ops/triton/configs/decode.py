"""Launch shapes and tuning constants of the decode kernel (decode.py) and of the kv-cache's
prefill route through the Gluon forward.

Measured on one H200 (torch 2.11, triton 3.6.0), bf16, d128, by benchmarks/bench_decode.py
(graph replays of the public call unless a line says otherwise); the runs and the candidates
each value beat are in benchmarks/notes/kernel-choices.md ("Decode").
"""

from __future__ import annotations

from typing import NamedTuple


class Tile(NamedTuple):
    """A launch shape. per_sm: programs per SM that auto splitting fills the GPU with (one where
    that would make short splits: SHORT_SPLIT_TILES); resident: programs per SM that fit at once
    (shared memory and registers of the sm_90 build of the q-length-1, d128 tile), for whole
    waves once the programs exceed one round of them. subtiles: key sub-tiles per key tile, each
    with its own running softmax (decode._key_subtiles), one per warp on the GPU; 1:
    decode._key_tiles. subtiled_from: splits of fewer key tiles keep subtiles 1
    (decode.launch_shape). round_split_tiles: the fewest key tiles per split when splitting for
    whole rounds (decode.auto_num_splits)."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    per_sm: int
    resident: int
    subtiles: int = 1
    subtiled_from: int = 1
    round_split_tiles: int = 1


# "decode": up to BLOCK_M packed query rows (q length 1-8 at GQA 8:1), BLOCK_M fitted to the
# rows; memory bound. "prefill": more rows; compute bound.
DECODE_SM90 = {
    # (64, 4, 3): best of a 27-tile sweep (85-110% of copy bandwidth at b16/16k GQA 8:1, b64/8k
    # MHA); per_sm 2: geomean 57.1 us against 60.5 / 59.0 for 1 / 3 over 12 small-batch shapes;
    # resident 3 (70-72 KB of shared memory); 4 sub-tiles of 16 keys, one per warp: 10-15%
    # faster on splits of 4-16 tiles, 3-7% slower on 1-2 (subtiled_from 4); round_split_tiles
    # 16: b16 1k MHA one split 66.4 us against 68.8-69.9 for 2-4.
    "decode": Tile(64, 64, 4, 3, 2, 3, 4, 4, 16),
    # the dense forward's d128 tile, within 2% of (64, 64, 4, 3); 224 KB of shared memory
    "prefill": Tile(128, 128, 8, 3, 1, 1),
}
# A dense flash_attn_func call with every kv head's query rows in one decode tile (decoding
# through flash_attn_func, as transformers' generate does) runs the decode kernel from this many
# keys: split over the keys where the forward kernels run one program per query tile and head.
# H200, bf16 d128, 32 query / 8 kv heads, causal, without grad, the decode kernels' time over
# the forward kernels' (diagnostics/tree_ab.py --cases decode), one query row: 1k keys 1.29
# (host-bound: two launches and a partials buffer against one launch), 4k 0.85 (batch 8: 0.93),
# 16k 0.35 (0.66), 64k 0.17; keys in SDPA's layout 4k 0.41, batch 8 16k 0.26; 4 rows over 16k 0.32.
DENSE_MIN_KEYS = 4096
# CPU interpreter: tiny tiles so tests at ~50 keys cross tiles and splits, decode tiles of 32
# keys span two 16-slot pages, and 2 sub-tiles run both tile loops.
DECODE_INTERPRETER = {"decode": Tile(16, 32, 1, 1, 2, 3, 2, 2),
                      "prefill": Tile(16, 16, 1, 1, 1, 1)}

# Auto num_splits: splits as short as one key tile, at most MAX_SPLITS (the merge reads all of a
# row's splits at once), per_sm programs per SM, or one per SM where per_sm would cut the keys
# into splits of fewer than SHORT_SPLIT_TILES tiles (latency bound; fewer programs, a cheaper
# merge). 32 against 16: b1 64k GQA 61 -> 31 splits 39.1 -> 38.4 us, b4 16k 38.2 -> 36.7.
MAX_SPLITS = 128
SHORT_SPLIT_TILES = 32
# No splits once the programs cover this share of the SMs (flash-attn's 0.8): b4 MHA 4k 62.0 us
# with 1 split against 65.3 with the 2 it took before.
FULL_SMS = 0.8
# The fewest splits within this share of the best wave efficiency (flash-attn: 0.85): b1 64k
# GQA 8:1 57 splits 81% of copy bandwidth, 66 (all slots) 83%.
FILL_EFFICIENCY = 0.95
# Paged caches: the block-table load is one more level of Triton's software pipeline; K/V are
# double-buffered behind it only from num_stages + 2 (sm_90 TTGIR of the decode tile).
PAGED_EXTRA_STAGES = 2
# Pages that BLOCK_N divides: one block-table load per key tile instead of per key row (page 256,
# % of copy bandwidth: b1/4k 15 -> 21, b16/1k MHA 68 -> 86), with 2 extra stages (0 or 1 lost 5-15
# points at 16k-64k keys).
PAGE_TILE_LOOKUP = True
PAGE_TILE_EXTRA_STAGES = 2
# Sub-tiled builds that spill under the 3-programs-per-SM register cap (interleaved rotary, per-row
# page lookups) lift it for launches of up to this many programs per SM, else drop sub-tiles.
CAP_LIFT_PER_SM = 2
# The merge kernel as a programmatic dependent launch where the GPU has it: folding the merge into
# the decode kernel was slower at every split count (4 splits b1 1k GQA 8.6 -> 9.9 us).
LAUNCH_PDL = True
STEP_MAX_NEW = 16  # a decoding step's kernel appends up to this many new keys per sequence
# Output columns per merge program (latency bound): b1 16k-128k, 29-64 splits, the merge alone
# 3.7-3.9 us with whole 128-column rows, 2.6 us with 32.
MERGE_BLOCK_DV = 32

# kv-cache prefill through the Gluon forward (sm_90) from this many query rows and this much work
# (batch x heads x queries x keys): 128 queries stay on the decode kernels (1.4-1.7x the dense
# forward's speed at 4k/16k keys against 0.7-1.0 routed); 256 x 16.6k keys (1.4e8) is routed's
# (1.00 against 0.93-0.95 contiguous).
GLUON_PREFILL_MIN_QUERIES = 256
GLUON_PREFILL_MIN_WORK = 2**27
