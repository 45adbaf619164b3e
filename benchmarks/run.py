"""One entry point for every benchmark suite: benchmarks/run.py SUITE [suite arguments].

    PYTHONPATH=src python3 benchmarks/run.py                 # list the suites
    PYTHONPATH=src python3 benchmarks/run.py speed --help    # a suite's own arguments
    PYTHONPATH=src python3 benchmarks/run.py decode --out DIR --quick

A suite is a module benchmarks/suites/<name>.py, runnable alone too
(`PYTHONPATH=src python3 benchmarks/suites/<name>.py --out DIR`); its docstring's first line
describes it. Results go to --out, default $OUT/<suite> or benchmarks/results/<suite>;
benchmarks/make_readme.py then rebuilds benchmarks/README.md from the latest result of each.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

SUITES = Path(__file__).resolve().parent / "suites"


def suites() -> dict[str, Path]:
    """name -> path of every suite module (files not starting with '_')."""
    return {p.stem: p for p in sorted(SUITES.glob("*.py")) if not p.stem.startswith("_")}


def summary(path: Path) -> str:
    """The first line of a suite's docstring, read without importing it."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    found = suites()
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__.strip().splitlines()[0] + "\n\nsuites:")
        for name, path in found.items():
            print(f"  {name:14s} {summary(path).removeprefix(name + ':').strip()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in found:
        print(f"run.py: unknown suite {name!r}; suites: {', '.join(found)}", file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = [str(found[name]), *rest]
    try:
        runpy.run_path(str(found[name]), run_name="__main__")
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
