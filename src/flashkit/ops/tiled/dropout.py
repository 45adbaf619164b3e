"""The tiled backend's dropout keep-mask: a pure function of (seed, batch, head, i, j).

Backward must drop exactly what forward dropped without storing a (seqlen_q, seqlen_k) mask, so
the mask is recomputed from coordinates with a counter-based hash: each coordinate is mixed into
a 32-bit state by an integer finaliser (the "lowbias32" hash), and the final state, read as a
uniform number in [0, 1), keeps the element iff it is >= p. The Triton kernels use Philox instead
(tl.rand), so the two backends drop different elements for the same seed; each one is exactly
reproducible, and flashkit.testing.dropout_keep_mask rebuilds either.
"""

from __future__ import annotations

import torch

from flashkit.ops.params import AttentionParams

_MASK32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijective 32-bit finaliser with good avalanche (int64 holds the products)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def keep_mask(seed: int, batch_idx, head_idx, rows, cols, dropout_p: float) -> torch.Tensor:
    """Bool keep-mask broadcast over the index tensors' shapes (each an int64 tensor)."""
    state = _mix(torch.as_tensor(seed & _MASK32) ^ _mix(torch.as_tensor(seed >> 32 & _MASK32)))
    for coord in (batch_idx, head_idx, rows, cols):
        state = _mix(state ^ (coord & _MASK32))
    return state.to(torch.float64) * 2.0**-32 >= dropout_p


def tile_scale(params: AttentionParams, batch0: int, heads: tuple, i0, i1, j0, j1, dtype,
               device):
    """keep / (1 - p) for one tile, (b, hk, g, BM, BN), or None without dropout.

    heads = (batch, nheads_k, group) of the tile's state; batch indices start at batch0.
    """
    if params.dropout_p == 0:
        return None
    nbatch, nheads_k, group = heads
    b = torch.arange(batch0, batch0 + nbatch, device=device).view(-1, 1, 1, 1, 1)
    h = torch.arange(nheads_k * group, device=device).view(1, nheads_k, group, 1, 1)
    i = torch.arange(i0, i1, device=device).view(-1, 1)
    j = torch.arange(j0, j1, device=device).view(1, -1)
    keep = keep_mask(params.dropout_seed, b, h, i, j, params.dropout_p)
    return keep.to(dtype) / (1.0 - params.dropout_p)
