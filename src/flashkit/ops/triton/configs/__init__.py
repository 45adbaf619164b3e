"""Tile tables and tuning constants of the Triton backend, as data (importable without triton).

One module per kernel family, one row per configuration with a line naming the measurement that
chose it; the measurements themselves are described in benchmarks/notes/kernel-choices.md.
    portable  the Triton kernels of forward.py / backward.py (every GPU, fp32, the interpreter)
    gluon     the sm_90 Gluon kernels of forward_hopper.py / backward_hopper.py
    decode    the decode kernel of decode.py and the kv-cache prefill route
"""

from __future__ import annotations

from flashkit.ops.triton.configs.gluon import (
    GLUON_BACKWARD,
    GLUON_BACKWARD_ACROSS_HEADS_PER_SM,
    GLUON_BACKWARD_DKDV,
    GLUON_BACKWARD_DQ,
    GLUON_COPIES_MIN_QUERIES,
    GLUON_FORWARD,
    GLUON_FORWARD_BLOCK_MASK,
    GLUON_FORWARD_TILES,
    gluon_forward_tile,
)
from flashkit.ops.triton.configs.portable import (
    FP32,
    INTERPRETER,
    SM90,
    VARIANT,
    padded_head_dim,
    tile_config,
)

__all__ = ["FP32", "GLUON_BACKWARD", "GLUON_BACKWARD_ACROSS_HEADS_PER_SM", "GLUON_BACKWARD_DKDV",
           "GLUON_BACKWARD_DQ", "GLUON_COPIES_MIN_QUERIES", "GLUON_FORWARD",
           "GLUON_FORWARD_BLOCK_MASK", "GLUON_FORWARD_TILES", "INTERPRETER", "SM90", "VARIANT",
           "gluon_forward_tile", "padded_head_dim", "tile_config"]
