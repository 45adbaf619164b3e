"""A one-line progress bar on stderr, so long experiments show they are alive.

    for n in track(lengths, "memory"):
        ...

draws `memory [########----------------]  3/8  seqlen=4096  12.4s` and rewrites it in place (at
most a few times a second). It writes only to stderr, so tables printed to stdout stay clean when
redirected to a file.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

WIDTH = 24
REDRAW_SECONDS = 0.25


def track(items: Iterable[T], label: str, describe=str) -> Iterator[T]:
    """Yield the items, redrawing the bar before each; describe(item) names the step in progress."""
    items = list(items)
    bar = _Bar(label, len(items))
    for n, item in enumerate(items):
        bar.draw(n, describe(item))
        yield item
    bar.draw(len(items), "done", force=True)
    sys.stderr.write("\n")
    sys.stderr.flush()


class _Bar:
    def __init__(self, label: str, total: int):
        self.label, self.total = label, total
        self.start = time.perf_counter()
        self.last_draw = -REDRAW_SECONDS
        self.width = 0

    def draw(self, done: int, note: str, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and done and now - self.last_draw < REDRAW_SECONDS:
            return
        self.last_draw = now
        filled = WIDTH * done // max(self.total, 1)
        line = (f"{self.label} [{'#' * filled}{'-' * (WIDTH - filled)}] "
                f"{done:>{len(str(self.total))}}/{self.total}  {note}  {now - self.start:.1f}s")
        sys.stderr.write("\r" + line.ljust(self.width))
        sys.stderr.flush()
        self.width = len(line)
