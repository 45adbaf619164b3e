"""How a sequence is cut into per-rank shards, and the helpers that cut and reassemble it.

Ring attention gives each of the W ranks of a group one shard of every sequence. Two layouts:

contiguous: rank r holds tokens [r * n, (r + 1) * n) of a sequence of W * n tokens.

zigzag: the sequence is cut into 2W equal chunks and rank r holds chunks r and 2W - 1 - r, in
that order. Under a causal mask a query sees the keys before it, so late chunks cost more than
early ones; pairing an early chunk with a late one gives every rank the same work:

    W = 4, 8 chunks:     0    1    2    3    4    5    6    7
                       [r0] [r1] [r2] [r3] [r3] [r2] [r1] [r0]

    rank 0 holds [0 | 7], rank 1 [1 | 6], rank 2 [2 | 5], rank 3 [3 | 4]

A shard is described by its Segments: runs of tokens that are consecutive both in the shard and
in the global sequence (one for contiguous, two for zigzag). `flashkit.distributed.plan` turns
pairs of segments into kernel calls.

The helpers work on any dim of any tensor:
    shard(x, dim, rank, world, layout)                 this rank's shard of a full tensor
    unshard(shards, dim, layout)                       the full tensor from every rank's shard
    gather_unshard(x, dim, layout, group)              the same through an all-gather
    shard_varlen(x, cu_seqlens, rank, world, layout)   shard each packed sequence (dim 0)
    unshard_varlen(shards, cu_seqlens, layout)         and reassemble the packed tokens
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = ["LAYOUTS", "Segment", "segments", "shard", "unshard", "gather_unshard",
           "shard_varlen", "unshard_varlen", "check_layout"]

LAYOUTS = ("contiguous", "zigzag")


class Segment(NamedTuple):
    """`length` tokens at `local` in a rank's shard that sit at `start` in the global sequence."""

    local: int
    start: int
    length: int


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return layout


def _chunks_per_rank(layout: str) -> int:
    return 1 if check_layout(layout) == "contiguous" else 2


def _chunk_ids(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """The global chunk indices rank holds, in shard order (world chunks, or 2 * world)."""
    return (rank,) if _chunks_per_rank(layout) == 1 else (rank, 2 * world - 1 - rank)


def segments(layout: str, rank: int, world: int, shard_len: int,
             offset: int = 0) -> list[Segment]:
    """The segments of rank's shard of shard_len tokens, stored from `offset` in the local tensor.

    shard_len must split into the layout's chunks (even for zigzag); the caller checks that.
    """
    chunk = shard_len // _chunks_per_rank(layout)
    return [Segment(offset + n * chunk, c * chunk, chunk)
            for n, c in enumerate(_chunk_ids(layout, rank, world))]


def _split(name: str, length: int, parts: int) -> int:
    if length % parts:
        raise ValueError(f"{name}: length {length} does not split into {parts} equal chunks")
    return length // parts


def shard(x: torch.Tensor, dim: int, rank: int, world: int, layout: str) -> torch.Tensor:
    """Rank's shard of x along dim (x.shape[dim] must split into world, or 2 * world, chunks)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < world = {world}, got {rank}")
    parts = world * _chunks_per_rank(layout)
    _split(f"x (dim {dim})", x.shape[dim], parts)
    chunks = x.chunk(parts, dim)
    return torch.cat([chunks[c] for c in _chunk_ids(layout, rank, world)], dim)


def unshard(shards: list[torch.Tensor], dim: int, layout: str) -> torch.Tensor:
    """The full tensor from every rank's shard, shards[r] being rank r's."""
    world, per_rank = len(shards), _chunks_per_rank(layout)
    chunks: list[torch.Tensor | None] = [None] * (world * per_rank)
    for rank, s in enumerate(shards):
        _split(f"shards[{rank}] (dim {dim})", s.shape[dim], per_rank)
        for c, piece in zip(_chunk_ids(layout, rank, world), s.chunk(per_rank, dim),
                            strict=True):
            chunks[c] = piece
    return torch.cat(chunks, dim)


def gather_unshard(x: torch.Tensor, dim: int, layout: str, group=None) -> torch.Tensor:
    """The full tensor on every rank: all-gather each rank's shard x, then `unshard`.

    A collective: every rank of the group must call it with a shard of the same shape. Not
    differentiable (it is meant for checking and for evaluation).
    """
    shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, x.contiguous(), group=group)
    return unshard(shards, dim, layout)


def _sequence_slices(cu_seqlens: torch.Tensor):
    cu = cu_seqlens.tolist()
    return [slice(a, b) for a, b in zip(cu, cu[1:], strict=False)]


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int, world: int,
                 layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard every sequence packed in x (dim 0, global int32 cu_seqlens) with the same layout.

    Returns (x_local, cu_seqlens_local): rank's shard of each sequence, packed in order, and the
    local prefix sums (every sequence length must split into world, or 2 * world, chunks, so
    all ranks get the same local cu_seqlens = cu_seqlens / world).
    """
    pieces = [shard(x[s], 0, rank, world, layout) for s in _sequence_slices(cu_seqlens)]
    return torch.cat(pieces, 0), torch.div(cu_seqlens, world, rounding_mode="floor")


def unshard_varlen(shards: list[torch.Tensor], cu_seqlens_local: torch.Tensor,
                   layout: str) -> torch.Tensor:
    """The packed global tokens from every rank's packed shard (inverse of shard_varlen)."""
    slices = _sequence_slices(cu_seqlens_local)
    return torch.cat([unshard([x[s] for x in shards], 0, layout) for s in slices], 0)
