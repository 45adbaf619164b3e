"""Helpers for the experiment tests: run the `flashkit` command as CI would, check its files."""

import importlib.util
import json
from pathlib import Path

import pytest

from flashkit import cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def flashkit_cli():
    """Run `flashkit ARGS...` in-process; fails the test on a non-zero exit status."""
    def run(*args):
        assert cli.main([str(a) for a in args]) == 0
    return run


def load_json(path: Path) -> dict:
    """Parse a results file and check it says where and with what it was measured."""
    data = json.loads(path.read_text())
    env = data["environment"]
    assert env["date"] and env["device"] and env["torch"]
    return data


def assert_png_if_matplotlib(path: Path) -> None:
    """A PNG exists exactly when matplotlib does (it is an optional extra)."""
    if importlib.util.find_spec("matplotlib") is None:
        assert not path.exists()
    else:
        assert path.read_bytes()[:8] == PNG_SIGNATURE
