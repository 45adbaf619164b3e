"""Views that put tensors in the tile code's shape, and the varlen loop over sequences."""

from __future__ import annotations

import torch

from flashkit.ops.params import AttentionParams


def group_heads(x: torch.Tensor, nheads_k: int) -> torch.Tensor:
    """(b, s, h, d) -> (b, hk, h // hk, s, d), a view: query head h reads kv head h // group."""
    return x.unflatten(2, (nheads_k, -1)).permute(0, 2, 3, 1, 4)


def group_slopes(slopes: torch.Tensor | None, nheads_k: int, dtype) -> torch.Tensor | None:
    """ALiBi slopes (h,) or (b, h) -> (b|1, hk, g)."""
    if slopes is None:
        return None
    return slopes.to(dtype).reshape(-1, nheads_k, slopes.shape[-1] // nheads_k)


def group_bias(bias: torch.Tensor | None, nheads_k: int) -> torch.Tensor | None:
    """SDPA bias broadcastable to (b, h, sq, sk) -> a view broadcastable to (b, hk, g, sq, sk)."""
    if bias is None:
        return None
    if bias.shape[1] == 1:
        return bias.unsqueeze(1)
    return bias.unflatten(1, (nheads_k, -1))


def sequences(params: AttentionParams):
    """Yield (index, q slice, k slice) of each sequence packed in a varlen batch."""
    cu_q, cu_k = params.cu_seqlens_q.tolist(), params.cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        yield b, slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])


def sequence_slopes(params: AttentionParams, b: int) -> torch.Tensor | None:
    """The ALiBi slopes sequence b of a varlen batch uses, shaped (1, h)."""
    slopes = params.alibi_slopes
    if slopes is None:
        return None
    return (slopes[b] if slopes.dim() == 2 else slopes)[None]
