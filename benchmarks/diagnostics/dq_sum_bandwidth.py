"""How fast a GPU adds float32 tiles to memory with TMA reduce-adds, as a backward that sums dQ
inside its dK/dV kernel would: every program (one key block of one head) adds a [64, d] tile to
each query tile's rows of float32 sums, (seqlen / 64) tiles in turn. Times the adds alone, with
nothing computed, against plain TMA stores of the same tiles.

    PYTHONPATH=src python3 benchmarks/diagnostics/dq_sum_bandwidth.py [--out x.json]

Shape: 16k tokens, 16 heads, d128 (the backward grid's d128 16k cell). Rows: keys per program
(64: 256 programs per head; 128: 128 per head), each program's walk in query-tile order or
rotated (program p starts at tile p), reduce-add or store. GB counts the bytes the tiles carry.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

SEQLEN, HEADS, HEAD_DIM, ROWS = 16384, 16, 128, 64


@triton.jit
def _add_tiles(desc, n_tiles, ROWS: tl.constexpr, D: tl.constexpr, ROTATE: tl.constexpr,
               STORE: tl.constexpr):
    """Program (key block, head): add (or store) a [ROWS, D] tile at each query tile's rows
    of the head's columns, n_tiles tiles, in order or starting at tile `key block`."""
    block = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.full([ROWS, D], 1.0, tl.float32)
    for t in range(n_tiles):
        m = (t + block) % n_tiles if ROTATE else t
        if STORE:
            desc.store([m * ROWS, head * D], tile)
        else:
            desc.atomic_add([m * ROWS, head * D], tile)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args()
    from triton.testing import do_bench
    from triton.tools.tensor_descriptor import TensorDescriptor

    sums = torch.zeros(SEQLEN, HEADS * HEAD_DIM, device="cuda", dtype=torch.float32)
    desc = TensorDescriptor.from_tensor(sums, [ROWS, HEAD_DIM])
    n_tiles = SEQLEN // ROWS
    rows = []
    for keys in (64, 128):
        for rotate in (False, True):
            for store in (False, True):
                grid = (SEQLEN // keys, HEADS)

                def adds(grid=grid, rotate=rotate, store=store):
                    _add_tiles[grid](desc, n_tiles, ROWS, HEAD_DIM, rotate, store)

                ms = do_bench(adds, warmup=25, rep=200)
                gb = grid[0] * grid[1] * n_tiles * ROWS * HEAD_DIM * 4 / 1e9
                rows.append(dict(keys_per_program=keys, rotated=rotate,
                                 op="store" if store else "reduce-add", GB=round(gb, 1),
                                 ms=round(ms, 3), TB_per_s=round(gb / ms, 2)))
                print(rows[-1], flush=True)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
