"""Compiling a first call's kernels ahead, side by side (flashkit.ops.triton.ahead): under
`compiling()` a launch hands its kernel to a pool thread and runs nothing; a launch that misses
its caches waits for those compiles; a forward plan's first differentiated call compiles its
forward and its backward kernels this way, once."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import flashkit
from flashkit.ops.triton import ahead, dispatch, launch
from helpers import random_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _StandIn:
    """A kernel that records its warm-ups (and their threads) and refuses to be launched."""

    def __init__(self, seconds: float = 0.0):
        self.seconds, self.warmed = seconds, []

    def warmup(self, *args, grid, **kwargs):
        time.sleep(self.seconds)
        self.warmed.append((threading.current_thread().name, args, grid, kwargs))
        return self

    def _init_handles(self):
        pass

    def __getitem__(self, grid):
        raise AssertionError("a kernel ran inside compiling()")


def test_launches_inside_compiling_only_compile_in_pool_threads():
    ahead.settle()  # compiles an earlier test left (a call whose kernels it found compiled)
    kernel = _StandIn(seconds=0.2)
    t = torch.zeros(4)
    with ahead.compiling():
        assert ahead.active()
        for n in range(3):
            assert launch.launch(kernel, (1, ), (t, ), (n, ), dict(BLOCK=16)) is None
    assert not ahead.active()
    start = time.perf_counter()
    ahead.settle()  # three 0.2 s compiles side by side
    assert time.perf_counter() - start < 0.5
    assert sorted(args[1] for _, args, _, _ in kernel.warmed) == [0, 1, 2]
    assert all(name.startswith("flashkit-compile") for name, *_ in kernel.warmed)
    assert all(kw == dict(BLOCK=16) and grid == (1, ) for _, _, grid, kw in kernel.warmed)


def test_a_failed_compile_is_left_to_the_launch():
    class Failing(_StandIn):
        def warmup(self, *args, grid, **kwargs):
            raise RuntimeError("compile error")

    with ahead.compiling():
        launch.launch(Failing(), (1, ), (torch.zeros(1), ), (), {})
    ahead.settle()  # does not raise: the launch that needs the kernel compiles and raises
    assert not ahead._pending


def test_nested_compiling_restores_the_outer_block():
    with ahead.compiling():
        with ahead.compiling():
            pass
        assert ahead.active()
    assert not ahead.active()


def test_compiling_is_per_thread():
    seen = []
    with ahead.compiling():
        other = threading.Thread(target=lambda: seen.append(ahead.active()))
        other.start()
        other.join()
    assert seen == [False]


@pytest.mark.usefixtures("fresh_plans")
def test_first_differentiated_call_compiles_forward_and_backward_ahead(monkeypatch):
    """A forward plan's first call with q requiring grad hands the forward's and the
    backward's kernels to the compile threads (here recorded, not compiled), once; the call and
    its backward then run as usual and match the oracle."""
    submitted = []
    monkeypatch.setattr(dispatch, "_compiles_ahead", lambda q, k, v: True)  # a GPU's condition
    monkeypatch.setattr(ahead, "submit", lambda kernel, *a: submitted.append(
        getattr(kernel, "__name__", None) or kernel.fn.__name__))
    q, k, v = (t.to(DEVICE).requires_grad_() for t in random_qkv(2, 37, 29, 2, headdim=16))
    out = flashkit.flash_attn_func(q, k, v, causal=True, backend="triton")
    names = sorted(submitted)
    assert names.count("_bwd_kernel") == 2  # dQ and dK/dV
    assert "_fwd_kernel" in names
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    submitted.clear()
    again = flashkit.flash_attn_func(q, k, v, causal=True, backend="triton")
    assert submitted == []  # the plan's first call only
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    ref = flashkit.flash_attn_func(q, k, v, causal=True, backend="reference")
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.usefixtures("fresh_plans")
def test_no_compile_ahead_without_grad_or_off_the_gpu(monkeypatch, requires_grad):
    submitted = []
    monkeypatch.setattr(ahead, "submit", lambda *a: submitted.append(a))
    q, k, v = (t.to(DEVICE).requires_grad_(requires_grad) for t in random_qkv(1, 9, 9, 2,
                                                                               headdim=16))
    flashkit.flash_attn_func(q, k, v, backend="triton")
    assert submitted == [] or (DEVICE == "cuda" and requires_grad)
