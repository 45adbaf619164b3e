"""Plain-text tables, the one format every `flashkit simulate` command prints.

Numbers are right-aligned and text left-aligned, so columns of counts line up the way the essay
documents print them.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table", "thousands"]


def thousands(value: int) -> str:
    """12345 -> '12,345' (the essay's cycle tables group digits this way)."""
    return f"{value:,}"


def _is_number(text: str) -> bool:
    """'12,345', '20.1%', '1.19x' and '-3' count as numbers (right-aligned)."""
    try:
        float(text.replace(",", "").rstrip("%x"))
    except ValueError:
        return False
    return True


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> str:
    """Render `rows` under `headers` as an aligned text table (cells are str()-ed)."""
    cells = [[str(c) for c in row] for row in rows]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"row {row} has {len(row)} cells, headers have {len(headers)}")
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if _is_number(c) else c.ljust(w)
                 for c, w in zip(row, widths, strict=True)]
        return "  ".join(parts).rstrip()

    out = [title] if title else []
    out.append(line(list(headers)))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(row) for row in cells)
    return "\n".join(out)
