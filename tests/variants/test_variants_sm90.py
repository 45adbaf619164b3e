"""The kernels with user modifiers compile for sm_90, without a GPU.

The interpreter runs a kernel's Python, so it forgives what Triton's code generator refuses
(tuple arguments, functions as compile-time arguments, constexpr branches on None). This test
records the launches the launchers make and compiles them for sm_90 ahead of time, down to
ptxas, the way the GPU would at its first call. The kernels must be built without the
interpreter, which this test process has switched on: the compile runs in a child process.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from triton import compiler
from triton.backends.compiler import GPUTarget

import flashkit
from flashkit import variants
from flashkit.ops.params import AttentionParams
from flashkit.variants import mods

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64"}


def _signature_type(x):
    if isinstance(x, torch.Tensor):
        return "*" + _TYPES[x.dtype]
    if isinstance(x, bool):
        return "i1"
    if isinstance(x, int):
        return "i64" if abs(x) >= 2**31 else "i32"
    if isinstance(x, float):
        return "fp32"
    return tuple(_signature_type(e) for e in x)


class _Recorder:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **kwargs) records the call."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []
        self.arg_names = kernel.arg_names  # launch.py orders the arguments by them

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _compile(kernel, args, kwargs):
    kwargs = dict(kwargs)
    options = dict(num_warps=kwargs.pop("num_warps"), num_stages=kwargs.pop("num_stages"))
    names = kernel.arg_names
    signature = {n: _signature_type(a) for n, a in zip(names, args, strict=False)}
    signature.update(dict.fromkeys(kwargs, "constexpr"))
    constexprs = {(names.index(n),): v for n, v in kwargs.items()}
    source = compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.mark.slow
def test_variant_kernels_compile_for_sm90():
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        get_ptxas(90)
    except Exception as err:  # a triton build without the CUDA toolchain
        pytest.skip(f"no ptxas: {err}")
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["_fwd_kernel", "_bwd_kernel"], done.stdout


def compile_variant_kernels():
    """Record one forward and one dQ launch with a block mask and a score_mod (a captured
    table) and compile both for sm_90; prints each kernel's name once its cubin exists."""
    forward = importlib.import_module("flashkit.ops.triton.forward")
    backward = importlib.import_module("flashkit.ops.triton.backward")
    launch = importlib.import_module("flashkit.ops.triton.launch")
    launch.interpreting = lambda: True  # no GPU: every launch goes through kernel[grid]
    batch, seqlen, nheads, headdim = 1, 300, 2, 64
    q, k, v = (torch.randn(batch, seqlen, nheads, headdim, dtype=torch.bfloat16)
               for _ in range(3))
    doc = (torch.arange(seqlen) // 100).to(torch.int32)
    mask = flashkit.create_block_mask(variants.document_mask(doc, causal=True), None, None,
                                      seqlen, seqlen, device="cpu")
    params = mods.attach(AttentionParams(softmax_scale=headdim ** -0.5), q,
                         variants.relative_bias(torch.randn(nheads, 13)), None, mask, batch,
                         nheads, seqlen, seqlen)
    launches = ((forward, "_fwd_kernel"), (backward, "_bwd_kernel"),
                (backward, "_bwd_preprocess_kernel"))
    recorders = {name: _Recorder(getattr(module, name)) for module, name in launches}
    for module, name in launches:
        setattr(module, name, recorders[name])
    forward.attention_forward(q, k, v, params)
    backward.attention_backward(q, q, k, v, q, torch.zeros(batch, nheads, seqlen), params)
    fwd_call = recorders["_fwd_kernel"].calls[0]
    dq_call = next(c for c in recorders["_bwd_kernel"].calls if c[1]["DO_DQ"])
    for name, (args, kwargs) in (("_fwd_kernel", fwd_call), ("_bwd_kernel", dq_call)):
        assert kwargs["SPARSE"] and kwargs["SCORE_MOD"] is not None
        assert _compile(recorders[name].kernel, args, kwargs).asm["cubin"]
        print(name, flush=True)


if __name__ == "__main__":
    compile_variant_kernels()
