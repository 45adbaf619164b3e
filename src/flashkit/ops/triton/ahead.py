"""Compiling kernels ahead, several at once, for a call's first run.

A new shape or variant compiles each of its kernels when it first launches: one after the
other, a forward then the backward's dQ and dK/dV kernels, several seconds each
cold. Triton's compiler leaves the GIL for most of its work (its MLIR and LLVM passes, ptxas),
so threads compile side by side. Under `compiling()`, `launch.launch` does not run a kernel: it
hands the kernel's arguments to a pool thread that compiles it (Triton's `warmup`, then its
launcher's C module) and returns. The first launch that misses its caches
afterwards waits for every such compile first (`settle`), so it finds the kernels Triton
compiled and compiles nothing twice.

dispatch.py runs a differentiated call's forward and backward under `compiling()` at the first
call of a forward plan (its launchers allocate as usual, nothing is launched), then the call
itself.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading

import torch
import triton

_local = threading.local()  # .on: this thread's launches only compile
_pending: list = []  # the futures of the compiles submitted and not yet waited for
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def active() -> bool:
    """Whether this thread's launches only compile (inside `compiling()`)."""
    return getattr(_local, "on", False)


@contextlib.contextmanager
def compiling():
    """Launches in this block (this thread's) hand their kernels to compile threads instead
    of running them (nested blocks too: leaving one restores what held before it)."""
    before, _local.on = active(), True
    try:
        yield
    finally:
        _local.on = before


def submit(kernel, grid: tuple, args: tuple, constexprs: dict, options: dict) -> None:
    """Compile kernel for these arguments in a pool thread, on the current CUDA device."""
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="flashkit-compile")
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    _pending[:] = [future for future in _pending if not future.done()]
    _pending.append(_pool.submit(_compile, device, kernel, grid, args, constexprs, options))


def _compile(device: int | None, kernel, grid: tuple, args: tuple, constexprs: dict,
             options: dict) -> None:
    """Compile in this thread; an error is dropped (a future keeping its traceback would keep
    the call's tensors alive): the launch that needs the kernel compiles it and raises."""
    try:
        with contextlib.nullcontext() if device is None else torch.cuda.device(device):
            compiled = kernel.warmup(*args, grid=grid, **constexprs, **options)
            # Triton builds the launcher's C module at the first launch (a C compiler run when
            # its disk cache has none): build it here, for that cache; the module load stays
            # with the launch (it touches the CUDA context, and a failed one would leave the
            # kernel broken)
            triton.runtime.driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception:  # see the docstring
        return


def settle() -> None:
    """Wait for every compile submitted so far."""
    if _pending:
        done = _pending.copy()
        _pending.clear()
        concurrent.futures.wait(done)
