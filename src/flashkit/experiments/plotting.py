"""Matplotlib, imported only when a plot is drawn (it is the optional `plot` extra).

Without it the experiments still print their tables and write JSON/CSV; `pyplot()` returns None
and says once how to get the PNGs.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path


@functools.cache
def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (with a note) if not installed."""
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed, so no PNG plots are written; "
              "pip install 'flashkit-attn[plot]' to get them", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: Path) -> Path:
    """Write the figure as PNG and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path
