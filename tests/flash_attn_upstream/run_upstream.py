"""Run flash-attn 2.8.4's test suite (test_flash_attn.py) against flashkit's drop-in on a CUDA GPU
and record, per test function, how many cases passed, failed or were skipped, the failures
grouped by cause and the skips by reason (flash_attn_upstream.json and .md under --out).

    PYTHONPATH=src python3 tests/flash_attn_upstream/run_upstream.py --cases 3000 -n 6 --out $OUT

Cases are drawn at parametrize time (seeded: the same cases every run), every test function
getting an equal share of --cases capped at its own size; `--cases all` runs the whole file
(508,777 cases: hours). Cases that would start after --budget seconds are counted as not run,
so the run ends on time with honest counts. Without a GPU, `--co --cpu-collect` lists the cases.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import upstream_summary  # noqa: E402  (beside this script)

WRITE_EVERY = 200  # reports between rewrites of the summary, so a killed run still leaves one


class Recorder:
    """A pytest plugin: tallies every report and keeps the summary files up to date."""

    def __init__(self, args, out: pathlib.Path, plan_file: pathlib.Path):
        self.args, self.out, self.plan_file = args, out, plan_file
        self.tally = upstream_summary.Tally((HERE / upstream_summary.UPSTREAM_FILE)
                                            .read_text().splitlines())
        self.start = time.time()
        self.cached_kernels = _cached_kernels()
        self.reports = 0
        self.exit_code = None

    def pytest_runtest_logreport(self, report):
        self.tally.add(report)
        self.reports += 1
        if self.reports % WRITE_EVERY == 0:
            self.write()

    def summary(self) -> dict:
        import torch
        import triton

        args = self.args
        plan = json.loads(self.plan_file.read_text()) if self.plan_file.exists() else {}
        selection = (f"{args.cases} cases" if args.cases == "all" else
                     f"{sum(plan.get('drawn', {}).values()) or args.cases} cases drawn")
        selection += f" (seed {args.seed}"
        if args.max_seqlen is not None:
            selection += f", sequence lengths up to {args.max_seqlen}"
        if args.functions:
            selection += f", functions {args.functions}"
        if args.k:
            selection += f", -k {args.k!r}"
        selection += f", budget {args.budget} s)"
        return {
            "suite": "flash-attn 2.8.4 tests/test_flash_attn.py through flashkit.flash_attn",
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": triton.__version__, "flashkit commit": _commit()},
            "selection": selection, "workers": args.workers,
            "seconds": round(time.time() - self.start, 1),
            "kernels_compiled": _cached_kernels() - self.cached_kernels,
            "pytest_exit_code": self.exit_code,
            "plan": plan,
            "lost_context": _lost_context(self.plan_file.parent / LOST_CONTEXT),
            **self.tally.as_dict(),
        }

    def write(self) -> dict:
        summary = self.summary()
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "flash_attn_upstream.json").write_text(json.dumps(summary, indent=1))
        (self.out / "flash_attn_upstream.md").write_text(upstream_summary.markdown(summary))
        return summary


LOST_CONTEXT = "lost_context.jsonl"  # the cases that broke their worker's CUDA context


def _lost_context(path: pathlib.Path) -> list:
    """[{"id", "error"}] of the cases after which the CUDA context was broken (conftest's
    --fa-lost-context), in the order they happened."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cached_kernels() -> int:
    """Entries in Triton's on-disk kernel cache (one per compiled kernel); the growth over a run
    is how many kernels it compiled, the cost that dominates a first run on a fresh machine."""
    import triton

    cache = pathlib.Path(triton.knobs.cache.dir)
    return sum(1 for _ in cache.iterdir()) if cache.is_dir() else 0


def _commit() -> str:
    """The checkout's commit, "-dirty" when its files differ from it (a copied working tree)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=HERE, text=True,
                              capture_output=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def pytest_args(args, plan_file) -> list[str]:
    """The pytest command line for args (also what --co runs)."""
    command = [str(HERE / upstream_summary.UPSTREAM_FILE), "-q", "-p", "no:cacheprovider",
               "-o", "addopts=", "--tb=short", "--fa-cases", str(args.cases),
               "--fa-seed", str(args.seed), "--fa-plan-out", str(plan_file)]
    if args.functions:
        command += ["--fa-functions", args.functions]
    if args.max_seqlen is not None:
        command += ["--fa-max-seqlen", str(args.max_seqlen)]
    if args.k:
        command += ["-k", args.k]
    if args.co:
        command += ["--collect-only", "-q"]  # with the -q above: a count per file
        if args.cpu_collect:
            command += ["--fa-cpu-collect"]
    else:
        command += ["--fa-deadline", str(time.time() + args.budget),
                    "--fa-lost-context", str(plan_file.parent / LOST_CONTEXT)]
        if args.workers:
            command += ["-n", str(args.workers)]
    return command


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="3000",
                        help="cases to draw over all selected functions, or 'all' (default 3000)")
    parser.add_argument("--seed", type=int, default=0, help="which cases are drawn (default 0)")
    parser.add_argument("--functions", default=None,
                        help="comma-separated test function names (default: every one)")
    parser.add_argument("--max-seqlen", type=int, default=None,
                        help="leave out cases with a sequence length above this, before drawing")
    parser.add_argument("-k", default=None, help="pytest -k expression (applied after drawing)")
    parser.add_argument("-n", "--workers", type=int, default=0,
                        help="pytest-xdist worker processes (default 0: this process)")
    parser.add_argument("--budget", type=float, default=200.0,
                        help="seconds after which cases not yet started count as not run")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--co", action="store_true", help="only collect: count the cases")
    parser.add_argument("--cpu-collect", action="store_true",
                        help="with --co on a machine without CUDA: pretend an sm_90 device")
    args = parser.parse_args(argv)
    if args.cases != "all" and not args.cases.isdigit():
        parser.error(f"--cases: a number or 'all', got {args.cases!r}")
    if args.cpu_collect and not args.co:
        parser.error("--cpu-collect lists cases: it needs --co")
    if args.workers and importlib.util.find_spec("xdist") is None:
        parser.error("-n needs pytest-xdist (pip install pytest-xdist), or run with -n 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan_file = out / "flash_attn_upstream_plan.json"
    plan_file.unlink(missing_ok=True)
    (out / LOST_CONTEXT).unlink(missing_ok=True)
    if args.co:
        start = time.time()
        code = pytest.main(pytest_args(args, plan_file))
        plan = json.loads(plan_file.read_text()) if plan_file.exists() else {}
        print(json.dumps({"collect_seconds": round(time.time() - start, 2), **plan}, indent=1))
        return int(code)
    recorder = Recorder(args, out, plan_file)
    recorder.exit_code = int(pytest.main(pytest_args(args, plan_file), plugins=[recorder]))
    summary = recorder.write()
    print(upstream_summary.markdown(summary))
    totals = summary["totals"]
    if not totals:
        return 2
    return 1 if totals.get("failed") or totals.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
