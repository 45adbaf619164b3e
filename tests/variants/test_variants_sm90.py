"""The kernels with user modifiers compile for sm_90 and fit its shared memory, without a GPU.

The interpreter runs a kernel's Python, so it forgives what Triton's code generator refuses
(tuple arguments, functions as compile-time arguments, constexpr branches on None) and never
allocates shared memory. This test records the launches the launchers make for every built-in
example at head dims 64, 128 and 256 (forward, dK/dV and dQ) and compiles them for sm_90 ahead
of time, down to ptxas, with the specialisation the GPU's first call would use (16-byte aligned
pointers and integers marked as such: a table read's pipelining depends on it). Each kernel's
shared memory must fit the 232448 bytes an sm_90 block may use. The kernels must be built
without the interpreter, which this test process has switched on: the compile runs in a child
process (two compiles at a time).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from variant_cases import EXAMPLES, extras, mods

import flashkit
from flashkit.ops.params import AttentionParams
from flashkit.variants import mods as variant_mods

SM90_SHARED_BYTES = 232448  # the most shared memory one block may use on sm_90
HEAD_DIMS = (64, 128, 256)
KERNELS = ("forward", "dkdv", "dq")


@pytest.mark.slow
def test_variant_kernels_fit_sm90():
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        get_ptxas(90)
    except Exception as err:  # a triton build without the CUDA toolchain
        pytest.skip(f"no ptxas: {err}")
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"),
                                                      str(Path(__file__).parent),
                                                      env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    assert sorted((name, int(d), kernel) for name, d, kernel, _ in rows) == sorted(
        (name, d, kernel) for name in EXAMPLES for d in HEAD_DIMS for kernel in KERNELS)
    too_big = [row for row in rows if int(row[3]) > SM90_SHARED_BYTES]
    assert not too_big, f"shared memory over {SM90_SHARED_BYTES} bytes: {too_big}"


class _Recorder:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **kwargs) records the call."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []
        self.arg_names = kernel.arg_names  # launch.py orders the arguments by them

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def record_launches(name: str, head_dim: int) -> dict:
    """{kernel: (jit function, args, kwargs)} of example `name`'s forward, dK/dV and dQ
    launches (bf16, odd lengths, GQA, as the GPU tests call them; a score_mod with a
    captured_grad rule with its captured tensors learning)."""
    forward = importlib.import_module("flashkit.ops.triton.forward")
    backward = importlib.import_module("flashkit.ops.triton.backward")
    launch = importlib.import_module("flashkit.ops.triton.launch")
    launch.interpreting = lambda: True  # no GPU: every launch goes through kernel[grid]
    batch, nheads, nheads_k = 2, 8, 2
    seqlen_q, seqlen_k = (113, 113) if name in ("document", "prefix_lm") else (113, 203)
    q = torch.randn(batch, seqlen_q, nheads, head_dim, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen_k, nheads_k, head_dim, dtype=torch.bfloat16)
            for _ in range(2))
    kwargs = mods(name, seqlen_q, seqlen_k, **extras(name, batch, nheads, seqlen_q, seqlen_k))
    mask = (flashkit.create_block_mask(kwargs["mask_mod"], batch, None, seqlen_q, seqlen_k,
                                       device="cpu") if "mask_mod" in kwargs else None)
    params = variant_mods.attach(AttentionParams(softmax_scale=head_dim ** -0.5), q,
                                 kwargs.get("score_mod"), None, mask, batch, nheads, seqlen_q,
                                 seqlen_k)
    score = params.variant.score_mod
    if score is not None and score.captured_grad is not None:  # the captured tensors learn
        params.variant.captured_grads = [
            torch.zeros(t.shape) if isinstance(t, torch.Tensor) and t.is_floating_point()
            else None for t in score.captured]
    launches = ((forward, "_fwd_kernel"), (backward, "_bwd_kernel"))
    recorders = {name: _Recorder(getattr(module, name)) for module, name in launches}
    for module, kernel in launches:
        setattr(module, kernel, recorders[kernel])
    forward.attention_forward(q, k, v, params)
    backward.attention_backward(q, q, k, v, q, torch.zeros(batch, nheads, seqlen_q), params)
    fwd, bwd = recorders["_fwd_kernel"], recorders["_bwd_kernel"]
    found = {"forward": (fwd.kernel, *fwd.calls[0])}
    for args, kw in bwd.calls:
        found["dkdv" if kw["DO_DKDV"] else "dq"] = (bwd.kernel, args, kw)
    for module, kernel in launches:
        setattr(module, kernel, recorders[kernel].kernel)
    return found


def compile_sm90(kernel, args, kwargs):
    """Compile a recorded launch for sm_90 as the JIT would on the GPU: the kernel's own binder
    gives the signature and the alignment specialisation of every argument."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def _shared_bytes(case: tuple[str, int]) -> list[str]:
    name, head_dim = case
    launches = record_launches(name, head_dim)
    rows = []
    for kernel in KERNELS:
        fn, args, kwargs = launches[kernel]
        assert kwargs["SPARSE"] or kwargs["SCORE_MOD"] is not None
        compiled = compile_sm90(fn, args, kwargs)
        assert compiled.asm["cubin"]
        rows.append(f"{name} {head_dim} {kernel} {compiled.metadata.shared}")
    return rows


def main() -> None:
    """Print `example head_dim kernel shared_bytes` for every built-in launch."""
    cases = [(name, d) for name in EXAMPLES for d in HEAD_DIMS]
    with ProcessPoolExecutor(2) as pool:
        for rows in pool.map(_shared_bytes, cases):
            print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
