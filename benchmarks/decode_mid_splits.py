"""Mid-sized decode cells (issue 5: where cuDNN leads by 2-10 points): the attention kernel alone
(bench_decode.kernel_fn, CUDA-graph replays, % of the copy bandwidth) at forced split counts,
for each decode `subtiles` setting in turn within one process, against cuDNN SDPA on the
same work.

    PYTHONPATH=../src:. python3 decode_mid_splits.py [--subtiles 4,1] [--out DIR]

--subtiles: values of decode.DECODE_SM90["decode"].subtiles to time, alternating per split count
(a tree without the field times its own tile once: pass --subtiles 0).
"""

from __future__ import annotations

import argparse
import json
import os

import bench_decode as bd
import torch

from flashkit.ops.params import AttentionParams
from flashkit.ops.triton import decode

# (batch, cached keys, kv heads): GQA 8:1 (4 kv heads of 32 query heads) and MHA
CELLS = [(16, 1024, 4), (4, 4096, 4), (16, 1024, 32), (4, 1024, 32), (16, 4096, 4),
         (4, 16384, 4), (1, 4096, 32), (64, 1024, 4)]
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def use_subtiles(subtiles: int) -> None:
    """Decode launches from now on with this many key sub-tiles (0: leave the tree's tile)."""
    if subtiles:
        decode.DECODE_SM90["decode"] = decode.DECODE_SM90["decode"]._replace(subtiles=subtiles)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--subtiles", default="4,1")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    variants = [int(s) for s in args.subtiles.split(",")]
    copy_bw = bd.copy_bandwidth()
    params = AttentionParams(bd.HEAD_DIM ** -0.5)
    rows = []
    for batch, seqlen_k, nheads_k in CELLS:
        k_cache, v_cache, table = bd.make_cache(batch, seqlen_k, nheads_k, None)
        q = torch.randn(batch, 1, bd.NHEADS, bd.HEAD_DIM, dtype=bd.DTYPE, device="cuda")
        kv = bd.kv_bytes_of(batch, seqlen_k, nheads_k)

        def pct(ms, kv=kv):
            return round(100 * kv / (ms * 1e-3) / copy_bw, 1)

        auto = bd.auto_splits(batch, seqlen_k, nheads_k, None)
        row = dict(batch=batch, seqlen_k=seqlen_k, nheads_k=nheads_k, auto=auto,
                   pct={v: {} for v in variants})
        for s in sorted({*SPLITS, auto} & set(range(1, seqlen_k // 64 + 1))):
            for v in variants:
                use_subtiles(v)
                fn = bd.kernel_fn(q, k_cache, v_cache, table, seqlen_k, params, s)
                row["pct"][v][s] = pct(bd.bench_graph(fn))
        row["cudnn"] = pct(bd.bench_graph(bd.sdpa_fn(q, k_cache, v_cache, "CUDNN_ATTENTION")))
        rows.append(row)
        print(json.dumps(row), flush=True)
        del k_cache, v_cache
        torch.cuda.empty_cache()
    json.dump(dict(env=bd.environment(), copy_bw=copy_bw, variants=variants, rows=rows),
              open(os.path.join(args.out, f"decode_mid_splits{args.tag}.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
