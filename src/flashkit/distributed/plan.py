r"""Which kernel calls one ring step needs: the visible part of a (query shard, key shard) block.

At each ring step a rank holds its own query shard and the key/value shard of some rank `src`.
Both are made of segments (see `layout`): runs of tokens consecutive in the global sequence. The
global mask (docs/design.md section 1) is a band on the diagonal offset d = i - j of global
positions:

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

ALiBi subtracts slope * |x| from a score, x = i - j + shift being the GLOBAL offset from the
diagonal, but a backend call measures |x''| from its own bottom-right diagonal: x'' = x - off
inside one rectangle, off the value of x at the call's bottom-right corner. So with ALiBi each
rectangle is cut along x = 0 and x'' = 0 into bands where both keep one sign (sx, s''); there
|x| = sx (x'' + off) and the call, run with slopes times sx * s'', gives -slope sx x'' = the
true bias + slope * sx * off: a per-head constant, which `alibi_offset` = sx * off carries to
the engine (it adds -slope * alibi_offset to the call's lse, and takes it off the lse it hands
the backward). In exact arithmetic that is the same attention; in floating point the kernel sees
scores shifted by up to slope * (rectangle size) and rounds at that size. bf16/fp16 inputs'
own rounding dominates and float64 stays exact, but float32 inputs with large shards and steep
slopes miss the tolerance rule (measured on the CPU: 1024 tokens per rank, W = 4, slopes
up to 1, causal: 1.4-2x the bound). A backend parameter adding an offset inside ALiBi's |.|
would make each rectangle one call with exact distances.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import NamedTuple

from flashkit.distributed.layout import Segment, segments

__all__ = ["Call", "plan_block", "ring_plans"]

INF = math.inf


class Call(NamedTuple):
    """One backend call: local query rows q, key rows k, and the window of that sub-block.

    sequence: which packed sequence (varlen) the call belongs to. alibi_sign, alibi_offset: run
    ALiBi with slopes * alibi_sign, then add -slope * alibi_offset to the lse (see the top).
    """

    q: slice
    k: slice
    window_left: int | None
    window_right: int | None
    sequence: int = 0
    alibi_sign: int = 1
    alibi_offset: int = 0


class _Rect(NamedTuple):
    """Rows [r0, r1) x columns [c0, c1) of the local block, with its band on d = i' - j'.

    x0: the global offset x = i - j + shift where d = 0 (x = d + x0 inside the rectangle).
    """

    r0: int
    r1: int
    c0: int
    c1: int
    lo: float
    hi: float
    x0: int = 0

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
               window_left: int | None, window_right: int | None,
               alibi: bool = False) -> list[Call]:
    """The calls computing every visible (query, key) pair of the block exactly once.

    q_segs/k_segs: the segments of the local query shard and of the key shard held this step;
    shift, window_left/right: the GLOBAL problem's (None = unbounded). alibi: cut the calls so
    that ALiBi's distances can be rebuilt from the calls' own (see the top). Empty list:
    nothing seen.
    """
    g_lo = -INF if window_right is None else -shift - window_right
    g_hi = INF if window_left is None else -shift + window_left
    rects = []
    for qs in q_segs:
        for ks in k_segs:
            # Global offset i - j = local offset i' - j' + delta.
            delta = (qs.start - qs.local) - (ks.start - ks.local)
            rects.append(_Rect(qs.local, qs.local + qs.length, ks.local, ks.local + ks.length,
                               g_lo - delta, g_hi - delta, delta + shift))
    seen = [r.trimmed() for r in rects if not _empty(r.visible())]
    if not seen:
        return []
    if alibi:
        return [call for r in seen for call in _alibi_calls(r)]
    box = _Rect(min(r.r0 for r in seen), max(r.r1 for r in seen),
                min(r.c0 for r in seen), max(r.c1 for r in seen), -INF, INF)
    lo, hi = min(r.visible()[0] for r in seen), max(r.visible()[1] for r in seen)
    if all(_same_visibility(r.clip(box), lo, hi) for r in rects):
        return [_call(box, lo, hi)]
    return [_call(r, *r.visible()) for r in seen]


def _alibi_calls(rect: _Rect) -> list[Call]:
    """rect's visible band cut where the global offset x or the call's own x'' changes sign.

    Every piece keeps rect's box (so x'' = d + c1 - r1 and off = x - x'' stay fixed); its rows
    or columns that see nothing cost the kernel only skipped tiles.
    """
    lo, hi = (int(v) for v in rect.visible())
    x_zero, own_zero = -rect.x0, rect.r1 - rect.c1  # the d where x = 0 and where x'' = 0
    cuts = sorted({c for c in (x_zero, own_zero) if lo < c <= hi})
    off = rect.x0 - (rect.c1 - rect.r1)
    calls = []
    for a, b in zip([lo, *cuts], [c - 1 for c in cuts] + [hi], strict=True):
        sx, sd = (1 if a >= x_zero else -1), (1 if a >= own_zero else -1)
        calls.append(_call(rect, a, b)._replace(alibi_sign=sx * sd, alibi_offset=sx * off))
    return calls


def ring_plans(layout: str, rank: int, world: int, q_lens: list[int], k_lens: list[int],
               window_left: int | None, window_right: int | None,
               alibi: bool = False) -> tuple[tuple[Call, ...], ...]:
    """plans[t]: the calls of ring step t, when rank holds the keys of rank (rank - t) % world.

    q_lens/k_lens: the local length of each sequence packed one after another in the shards (one
    entry for dense inputs); each sequence is sharded with `layout` across the world ranks, and
    its global mask is bottom-right aligned on its own global lengths. alibi: see plan_block.
    """
    q_offsets = list(accumulate(q_lens, initial=0))  # where each packed sequence starts
    k_offsets = list(accumulate(k_lens, initial=0))
    plans = []
    for step in range(world):
        src, calls = (rank - step) % world, []
        for seq, (lq, lk, oq, ok) in enumerate(zip(q_lens, k_lens, q_offsets[:-1],
                                                   k_offsets[:-1], strict=True)):
            block = plan_block(segments(layout, rank, world, lq, oq),
                               segments(layout, src, world, lk, ok),
                               world * (lk - lq), window_left, window_right, alibi)
            calls += [call._replace(sequence=seq) for call in block]
        plans.append(tuple(calls))
    return tuple(plans)
