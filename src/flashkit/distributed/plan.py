r"""Which kernel calls one ring step needs: the visible part of a (query shard, key shard) block.

At each ring step a rank holds its own query shard and the key/value shard of some rank `src`.
Both are made of segments (see `layout`): runs of tokens consecutive in the global sequence. The
global mask of DESIGN section 1 is a band on the diagonal offset d = i - j of global positions:

    key j visible from query i  <=>  -shift - right <= i - j <= -shift + left

(shift = global seqlen_k - seqlen_q; None/unbounded sides are infinite). Seen from the local
tensors, a pair of segments is an axis-aligned rectangle in which the same band holds on the
local offset i' - j', moved by how far the two segments sit from their global places. So every
(q segment, k segment) rectangle is either empty, or one call of the backend with a window
(AttentionParams' window is relative to the call's bottom-right diagonal and may be any int).

The plan trims each rectangle to the rows and columns that see something, then tries to cover
all of them with ONE call: that works when a single band on i' - j' reproduces the visibility of
every rectangle inside the bounding box, as it does for zigzag + causal. W = 2, c tokens per
chunk, rank 0 holds chunks [0 | 3] and rank 1 [1 | 2]; local query rows down, local key columns
across (\ = visible diagonal, # = visible, . = masked):

    rank 0, own keys [0 | 3]   rank 0, rank 1's keys [1 | 2]   rank 1, rank 0's keys [0 | 3]
         \ .  | .  .                .  . | .  .                     #  # | .  .
         # \  | .  .                .  . | .  .                     #  # | .  .
         -----+-----                -----+-----                     -----+-----
         #  # | \  .                #  # | #  #                     #  # | .  .
         #  # | #  \                #  # | #  #                     #  # | .  .
    one causal 2c x 2c call    one full call: last c queries    one full call: all 2c
                               x all 2c keys                    queries x first c keys

Each rank does the same work at every step: that is the point of the zigzag layout. When no
single band fits (sliding windows across zigzag chunks), the plan makes one call per rectangle.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import NamedTuple

from flashkit.distributed.layout import Segment, segments

__all__ = ["Call", "plan_block", "ring_plans"]

INF = math.inf


class Call(NamedTuple):
    """One backend call: local query rows q, key rows k, and the window of that sub-block."""

    q: slice
    k: slice
    window_left: int | None
    window_right: int | None


class _Rect(NamedTuple):
    """Rows [r0, r1) x columns [c0, c1) of the local block, with its band on d = i' - j'."""

    r0: int
    r1: int
    c0: int
    c1: int
    lo: float
    hi: float

    def offsets(self) -> tuple[float, float]:
        """The range [first, last] of i' - j' over the rectangle; (INF, -INF) when it is empty."""
        if self.r0 >= self.r1 or self.c0 >= self.c1:
            return INF, -INF
        return self.r0 - (self.c1 - 1), self.r1 - 1 - self.c0

    def visible(self) -> tuple[float, float]:
        """The offsets inside the rectangle that are visible."""
        d0, d1 = self.offsets()
        return max(d0, self.lo), min(d1, self.hi)

    def trimmed(self) -> _Rect:
        """The rectangle cut down to the rows and columns that see something."""
        return self._replace(r0=max(self.r0, self.c0 + self.lo), r1=min(self.r1, self.c1 + self.hi),
                             c0=max(self.c0, self.r0 - self.hi), c1=min(self.c1, self.r1 - self.lo))

    def clip(self, box: _Rect) -> _Rect:
        return self._replace(r0=max(self.r0, box.r0), r1=min(self.r1, box.r1),
                             c0=max(self.c0, box.c0), c1=min(self.c1, box.c1))


def _empty(interval) -> bool:
    return interval[0] > interval[1]


def _same_visibility(rect: _Rect, lo: float, hi: float) -> bool:
    """Does the band [lo, hi] show exactly what rect's own band shows inside rect?"""
    d0, d1 = rect.offsets()
    own, candidate = rect.visible(), (max(d0, lo), min(d1, hi))
    return own == candidate or (_empty(own) and _empty(candidate))


def _call(box: _Rect, lo: float, hi: float) -> Call:
    """The backend call computing band [lo, hi] on box, window relative to box's diagonal."""
    r0, r1, c0, c1 = (int(x) for x in box[:4])
    shift = (c1 - c0) - (r1 - r0)
    d0, d1 = box.offsets()
    # In the call's coordinates d'' = d - r0 + c0, and its band is [-shift - right, -shift + left].
    right = None if lo <= d0 else int(-shift - (lo - r0 + c0))
    left = None if hi >= d1 else int(hi - r0 + c0 + shift)
    return Call(slice(r0, r1), slice(c0, c1), left, right)


def plan_block(q_segs: list[Segment], k_segs: list[Segment], shift: int,
               window_left: int | None, window_right: int | None) -> list[Call]:
    """The calls computing every visible (query, key) pair of the block exactly once.

    q_segs/k_segs: the segments of the local query shard and of the key shard held this step;
    shift, window_left/right: the GLOBAL problem's (None = unbounded). Empty list: nothing seen.
    """
    g_lo = -INF if window_right is None else -shift - window_right
    g_hi = INF if window_left is None else -shift + window_left
    rects = []
    for qs in q_segs:
        for ks in k_segs:
            # Global offset i - j = local offset i' - j' + delta.
            delta = (qs.start - qs.local) - (ks.start - ks.local)
            rects.append(_Rect(qs.local, qs.local + qs.length, ks.local, ks.local + ks.length,
                               g_lo - delta, g_hi - delta))
    seen = [r.trimmed() for r in rects if not _empty(r.visible())]
    if not seen:
        return []
    box = _Rect(min(r.r0 for r in seen), max(r.r1 for r in seen),
                min(r.c0 for r in seen), max(r.c1 for r in seen), -INF, INF)
    lo, hi = min(r.visible()[0] for r in seen), max(r.visible()[1] for r in seen)
    if all(_same_visibility(r.clip(box), lo, hi) for r in rects):
        return [_call(box, lo, hi)]
    return [_call(r, *r.visible()) for r in seen]


def ring_plans(layout: str, rank: int, world: int, q_lens: list[int], k_lens: list[int],
               window_left: int | None, window_right: int | None) -> tuple[tuple[Call, ...], ...]:
    """plans[t]: the calls of ring step t, when rank holds the keys of rank (rank - t) % world.

    q_lens/k_lens: the local length of each sequence packed one after another in the shards (one
    entry for dense inputs); each sequence is sharded with `layout` across the world ranks, and
    its global mask is bottom-right aligned on its own global lengths.
    """
    q_offsets = list(accumulate(q_lens, initial=0))  # where each packed sequence starts
    k_offsets = list(accumulate(k_lens, initial=0))
    plans = []
    for step in range(world):
        src, calls = (rank - step) % world, []
        for lq, lk, oq, ok in zip(q_lens, k_lens, q_offsets[:-1], k_offsets[:-1],
                                  strict=True):
            calls += plan_block(segments(layout, rank, world, lq, oq),
                                segments(layout, src, world, lk, ok),
                                world * (lk - lq), window_left, window_right)
        plans.append(tuple(calls))
    return tuple(plans)

