"""Run flash-attn 2.8.4's test suite against flashkit's drop-in on a CUDA GPU and record per
test function the counts passed / failed / skipped / not applicable as JSON.

    PYTHONPATH=src python3 tests/flash_attn_upstream/run_upstream.py --sample 400 --out $OUT

--sample N keeps every Nth parametrization of each function (deterministic; each function's
first one always runs); --sample 1 runs the whole file (over 500k cases: hours).
"""

import argparse
import collections
import json
import os
import pathlib
import platform
import sys
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent


class Counter:
    def __init__(self):
        self.counts = collections.defaultdict(collections.Counter)
        self.failures = collections.defaultdict(list)

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.split("::")[-1].split("[")[0]
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            if report.skipped:
                reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
                outcome = "not_applicable" if "not applicable" in reason else "skipped"
            else:
                outcome = report.outcome
            self.counts[name][outcome] += 1
            if outcome == "failed" and len(self.failures[name]) < 5:
                self.failures[name].append(
                    {"id": report.nodeid.split("::")[-1],
                     "error": str(report.longrepr).strip().splitlines()[-1][:400]})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=400)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("-k", default=None, help="pytest -k expression")
    args = parser.parse_args()
    import torch

    counter = Counter()
    start = time.time()
    pytest_args = [str(HERE / "test_flash_attn.py"), "-q", "-p", "no:cacheprovider",
                   "--sample", str(args.sample), "-o", "addopts=", "--tb=line"]
    if args.k:
        pytest_args += ["-k", args.k]
    code = pytest.main(pytest_args, plugins=[counter])
    result = {
        "suite": "flash-attn 2.8.4 tests/test_flash_attn.py through flashkit.flash_attn",
        "sample_every": args.sample, "pytest_exit_code": int(code),
        "seconds": round(time.time() - start, 1),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "per_function": {k: dict(v) for k, v in sorted(counter.counts.items())},
        "totals": dict(sum(counter.counts.values(), collections.Counter())),
        "failures": dict(counter.failures),
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flash_attn_upstream.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("totals", "per_function", "seconds")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
