"""Rebuild benchmarks/README.md from the latest result file of each suite.

    python3 benchmarks/make_readme.py [--check]

For every folder of benchmarks/results/ (one per suite) it takes the newest JSON file (by the
date stamp in its name), states its date, device and versions, and shows its numbers: the
markdown summary the suite wrote beside it, or else a table of its first list of rows. A suite
whose runs measure its parts one at a time (one that declares `PARTS = (...)`, its --parts)
gets, after the newest file, each part that file lacks from the newest file of the same
configuration that has it, with that file's date. Plots (PNG) in the folder are linked.
--check exits 1 if README.md is not what this would write.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS, README = HERE / "results", HERE / "README.md"
MAX_ROWS, MAX_COLUMNS = 40, 12
VERSION_KEYS = ("torch", "triton", "jax", "jaxlib", "cuda", "cudnn", "python", "flashkit")


def stamp(path: Path) -> str:
    """YYYYMMDDHHMM from a result file's name ('0000' when it names no time)."""
    name = path.stem.replace("-", "")
    m = re.search(r"(20\d{6})[_T]?(\d{4})?", name)
    return (m.group(1) + (m.group(2) or "0000")) if m else "0"


def by_date(folder: Path) -> list[Path]:
    """The folder's JSON result files, oldest first."""
    return sorted(folder.glob("*.json"), key=lambda p: (stamp(p), p.name))


def latest(folder: Path) -> Path | None:
    files = by_date(folder)
    return files[-1] if files else None


NOT_PARTS = ("env", "environment", "config", "versions")


def parts(data) -> list[str]:
    """The top-level lists of rows in a result (a suite's parts: `examples`, `packed`, ...)."""
    if not isinstance(data, dict):
        return []
    return [key for key, value in data.items() if key not in NOT_PARTS
            and isinstance(value, list) and value and all(isinstance(r, dict) for r in value)]


def part_summary(path: Path, part: str, data: dict) -> str:
    """A part's section of the markdown summary beside path (`## part` up to the next `## `),
    or else a table of its rows."""
    summary = path.with_suffix(".md")
    if summary.exists():
        found = re.search(rf"^## {re.escape(part)}\n(.*?)(?=^## |\Z)", summary.read_text(),
                          re.S | re.M)
        if found:
            return demoted(found.group(1).strip()) + "\n"
    return rows_table(data[part])


def demoted(markdown: str) -> str:
    """A suite's summary with its headings moved down to start at level 3: its sections sit
    inside the suite's (level 2)."""
    levels = [len(m) for m in re.findall(r"^(#+) ", markdown, flags=re.M)]
    if not levels:
        return markdown
    shift = 3 - min(levels)
    return re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + shift) + " ", markdown,
                  flags=re.M)


def environment(data: dict) -> dict:
    """date, device and versions wherever a suite (or an older script) stored them."""
    env = dict(data.get("versions") or {})
    env.update({k: v for k, v in data.items() if k in ("date", "device", *VERSION_KEYS)})
    env.update(data.get("environment") or {})
    env.update(data.get("env") or {})
    return env


def flatten(row: dict) -> dict:
    """Scalars of a row, nested dicts one level down as 'key.sub'."""
    flat = {}
    for key, value in row.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()
                         if isinstance(v, (int, float, str, bool)) or v is None})
        elif isinstance(value, (int, float, str, bool)) or value is None:
            flat[key] = value
    return flat


def first_rows(data, depth=0):
    """(name, rows) of the first list of dicts in data (two levels deep at most)."""
    if isinstance(data, dict) and depth < 2:
        for key, value in data.items():
            if key in ("env", "environment", "config", "versions"):
                continue
            if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
                return key, value
            found = first_rows(value, depth + 1)
            if found:
                return (f"{key}.{found[0]}", found[1])
    return None


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value).replace("|", "/")


def rows_table(rows: list[dict]) -> str:
    flat = [flatten(r) for r in rows[:MAX_ROWS]]
    columns = list(dict.fromkeys(c for r in flat for c in r))[:MAX_COLUMNS]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in flat]
    more = f"\n({len(rows) - MAX_ROWS} more rows in the file)\n" if len(rows) > MAX_ROWS else ""
    return "\n".join(lines) + "\n" + more


def suite_summaries() -> dict[str, str]:
    out = {}
    for path in sorted((HERE / "suites").glob("*.py")):
        if not path.stem.startswith("_"):
            doc = (ast.get_docstring(ast.parse(path.read_text())) or "").strip()
            out[path.stem] = doc.splitlines()[0].removeprefix(path.stem + ":").strip() if doc \
                else ""
    return out


def declared_parts(suite: str) -> tuple:
    """The suite's PARTS (a tuple of names at its module's top level), or ()."""
    path = HERE / "suites" / f"{suite}.py"
    if not path.exists():
        return ()
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "PARTS"):
            return tuple(ast.literal_eval(node.value))
    return ()


def section(folder: Path) -> str:
    path = latest(folder)
    count = len(list(folder.glob("*.json")))
    head = f"## {folder.name}\n\n"
    if path is None:
        docs = [f"[`{p.name}`](results/{folder.name}/{p.name})"
                for p in sorted(folder.glob("*.md"))]
        return head + ("See " + ", ".join(docs) + ".\n" if docs else "No result files yet.\n")
    data = json.loads(path.read_text())
    env = environment(data) if isinstance(data, dict) else {}
    versions = ", ".join(f"{k} {env[k]}" for k in VERSION_KEYS if env.get(k))
    text = (head + f"Latest: [`{path.name}`](results/{folder.name}/{path.name}) "
            f"({count} result files in [`results/{folder.name}/`](results/{folder.name}/)). "
            f"Date {env.get('date', stamp(path)[:8])}, device {env.get('device', 'unknown')}"
            + (f"; {versions}" if versions else "") + ".\n\n")
    summary = path.with_suffix(".md")
    if summary.exists():
        text += demoted(summary.read_text().strip()) + "\n"
    else:
        found = first_rows(data)
        if found:
            text += f"`{found[0]}`:\n\n" + rows_table(found[1])
        elif isinstance(data, dict):
            text += "Sections: " + ", ".join(f"`{k}`" for k in data) + "\n"
    text += older_parts(folder, data)
    for plot in sorted(folder.glob("*.png")):
        text += f"\n![{plot.stem}](results/{folder.name}/{plot.name})\n"
    return text


def older_parts(folder: Path, data) -> str:
    """For a suite that declares its parts: each one the newest file lacks, from the newest
    file of the same suite and configuration that has it."""
    declared = declared_parts(folder.name)
    if not declared or not isinstance(data, dict) or "suite" not in data:
        return ""
    shown, text = set(parts(data)), ""
    for path in reversed(by_date(folder)[:-1]):
        older = json.loads(path.read_text())
        if (not isinstance(older, dict) or older.get("suite") != data["suite"]
                or older.get("config") != data.get("config")):
            continue
        for part in parts(older):
            if part in shown or part not in declared:
                continue
            shown.add(part)
            env = environment(older)
            text += (f"\n### {part}\n\nFrom [`{path.name}`](results/{folder.name}/{path.name}), "
                     f"date {env.get('date', stamp(path)[:8])}, device "
                     f"{env.get('device', 'unknown')}.\n\n" + part_summary(path, part, older))
    return text


def render() -> str:
    summaries = suite_summaries()
    notes = sorted((HERE / "notes").glob("*.md"))
    parts = [
        "# Benchmarks\n",
        "Generated by `python3 benchmarks/make_readme.py` from the newest result file of each "
        "suite; do not edit by hand.\n",
        "Run a suite with `PYTHONPATH=src python3 benchmarks/run.py SUITE [--out DIR]` "
        "(`run.py` alone lists them, `run.py SUITE --help` gives a suite's arguments). Every "
        "suite measures the public API as a user calls it, with the anchors (PyTorch SDPA's "
        "cuDNN, FA2 and efficient backends, FlexAttention compiled) in the same process, and "
        "writes `results/<suite>/<date>_<device>.json` with its date, device and versions. "
        "Kernel-level probes live in `diagnostics/`.\n",
        "| suite | what it measures |\n|---|---|\n"
        + "".join(f"| `{name}` | {doc} |\n" for name, doc in summaries.items()),
    ]
    if notes:
        parts.append("Notes by topic (what is current and why, what was tried and lost): "
                     + ", ".join(f"[{p.stem}](notes/{p.name})" for p in notes) + ".\n")
    for folder in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        parts.append(section(folder))
    return "\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md is out of date")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        return 0 if README.exists() and README.read_text() == text else 1
    README.write_text(text)
    print(f"wrote {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
