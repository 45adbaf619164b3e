"""Shared test set-up: Triton kernels run in the interpreter when there is no GPU, GPU-only tests
are skipped without CUDA, and every test starts from a fixed seed (inputs random, never zeros)."""

import os

import pytest
import torch
from hypothesis import settings

# Differential tests draw random cases, but the same ones every run: CI must not flake.
settings.register_profile("flashkit", derandomize=True, print_blob=True)
settings.load_profile("flashkit")

# Must be set before triton.jit decorates any kernel: without a GPU, kernels are interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# JAX would take 75% of the GPU's memory at its first use, which starves the torch tests of the
# same process and of other xdist workers (an H200 run of `-m gpu -n 12` ran out of memory).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fresh_plans():
    """Kernel choices made anew in the test and forgotten after it (dispatch.forget_plans, which
    also retires the plans that the entry points keep with their kept calls): a test that
    patches a threshold or a kernel makes its choices under the patch, and no later test runs
    them."""
    from flashkit.ops.triton import dispatch

    dispatch.forget_plans()
    yield
    dispatch.forget_plans()
