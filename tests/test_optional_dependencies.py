"""The core package and the `flashkit` command work without triton and without jax.

`pip install flashkit-attn` on a machine without a GPU brings neither (they are the `gpu` and
`jax` extras), so every check here runs in a fresh interpreter where both are unimportable:
`sys.modules[name] = None` makes `import name` raise ImportError and `find_spec(name)` return
None, exactly as when the package is not installed.
"""

import os
import subprocess
import sys
from pathlib import Path

from tests.experiments.conftest import assert_png_if_matplotlib, load_json

import flashkit

BLOCK = ("import sys\n"
         "sys.modules.update(dict.fromkeys(('triton', 'jax', 'jaxlib')))\n")


def run_without_triton_and_jax(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run Python `code` in a subprocess where triton and jax cannot be imported."""
    src = str(Path(flashkit.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", BLOCK + code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def check(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_demo_smoke_runs_without_triton_and_jax(tmp_path):
    check(run_without_triton_and_jax(
        "from flashkit.cli import main\n"
        f"assert main(['demo', '--smoke', '--device', 'cpu', '--out', {str(tmp_path)!r}]) == 0\n"
        "assert sys.modules['triton'] is None and sys.modules['jax'] is None\n", tmp_path))
    report = (tmp_path / "README.md").read_text()
    for heading in ("oracle", "Memory", "BREAK IT", "Training", "Throughput", "## Skipped"):
        assert heading in report
    assert "FAIL" not in report
    for name in ("memory.json", "break_it.json", "train.json", "bench.json"):
        load_json(tmp_path / name)
    for png in ("memory.png", "train.png", "bench_float32.png"):
        assert_png_if_matplotlib(tmp_path / png)


# Prints every command path (`demo`, `simulate hbm`, ...) after its --help ran with exit 0.
HELP_EVERY_COMMAND = """\
import argparse, contextlib, io
from flashkit.cli import build_parser

def commands(parser, path):
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, path + [name])

for path in commands(build_parser(), []):
    with contextlib.redirect_stdout(io.StringIO()) as text:
        try:
            build_parser().parse_args(path + ['--help'])
        except SystemExit as done:
            assert done.code == 0, path
    assert 'usage: flashkit' in text.getvalue(), path
    print(' '.join(path))
"""


def test_every_help_and_every_simulation_runs_without_triton_and_jax(tmp_path):
    paths = check(run_without_triton_and_jax(HELP_EVERY_COMMAND, tmp_path)).splitlines()
    for command in ("demo", "memory", "bench", "break-it", "train", "learn", "simulate",
                    "simulate machine", "simulate hbm"):
        assert command in paths
    machines = [p.split()[1] for p in paths if p.startswith("simulate ")]
    out = check(run_without_triton_and_jax(
        "from flashkit.cli import main\n"
        f"for machine in {machines!r}:\n"
        "    assert main(['simulate', machine]) == 0, machine\n"
        "assert main(['simulate']) == 0\n", tmp_path))
    assert "pip install triton" in out  # `simulate hbm` says how to see flashkit's own tile


def test_what_needs_triton_or_jax_says_how_to_install_it(tmp_path):
    out = check(run_without_triton_and_jax(
        "import torch, flashkit\n"
        "q = torch.randn(1, 4, 1, 8)\n"
        "import flashkit.variants\n"
        "for attempt in (lambda: flashkit.flash_attn_func(q, q, q, backend='triton'),\n"
        "                lambda: __import__('flashkit.jax'),\n"
        "                lambda: flashkit.variants.document_mask):\n"
        "    try:\n"
        "        attempt()\n"
        "    except ImportError as error:\n"
        "        print(error)\n"
        "print(flashkit.flash_attn_func(q, q, q).shape)\n", tmp_path))
    lines = out.splitlines()
    assert "pip install" in lines[0] and "triton" in lines[0]
    assert "pip install" in lines[1] and "jax" in lines[1].lower()
    assert "pip install" in lines[2] and "Triton" in lines[2]
    assert lines[3] == "torch.Size([1, 4, 1, 8])"
