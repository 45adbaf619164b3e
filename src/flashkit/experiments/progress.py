"""A one-line progress bar on stderr, so long experiments show they are alive.

    for n in track(lengths, "memory"):
        ...

draws `memory [########------------]  3/8  seqlen=4096  12.4s` and rewrites it in place. It writes
only to stderr, so tables printed to stdout stay clean when redirected to a file.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

WIDTH = 24


def track(items: Iterable[T], label: str, describe=str) -> Iterator[T]:
    """Yield the items, redrawing the bar before each; describe(item) names the step in progress."""
    items = list(items)
    start = time.perf_counter()
    for n, item in enumerate(items):
        _draw(label, n, len(items), describe(item), start)
        yield item
    _draw(label, len(items), len(items), "done", start)
    sys.stderr.write("\n")
    sys.stderr.flush()


def _draw(label: str, done: int, total: int, note: str, start: float) -> None:
    filled = WIDTH * done // max(total, 1)
    bar = "#" * filled + "-" * (WIDTH - filled)
    elapsed = time.perf_counter() - start
    line = f"{label} [{bar}] {done:>{len(str(total))}}/{total}  {note}  {elapsed:.1f}s"
    sys.stderr.write("\r" + line[:120].ljust(120))
    sys.stderr.flush()
