"""Compile the Triton launchers' kernels for sm_90 without a GPU and report registers, spills and
SASS instruction counts (HGMMA, MUFU.EX2, LDL/STL), to pre-screen kernel variants before spending
device time.

    PYTHONPATH=src python3 benchmarks/diagnostics/sm90_probe.py [--head-dims 64,128] [--causal]

A fake driver answers "current target = cuda sm_90" and every launch becomes a compile-only
warm-up, so the launchers run unchanged on CPU tensors (their shapes and strides are what Triton
specialises on). Needs ptxas/cuobjdump/nvdisasm from Triton's bundled CUDA tools.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver as driver_config
from triton.runtime.jit import JITFunction

from flashkit.ops.params import AttentionParams

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class _FakeDriver:
    """Just enough of CudaDriver for JITFunction.run(warmup=True)."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


COMPILED: list = []


def install_fake_driver():
    """Route Triton to _FakeDriver and make every launch a compile-only warm-up."""
    driver_config.set_active(_FakeDriver())
    original = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        COMPILED.append((self.__name__, kwargs, kernel))
        return kernel

    JITFunction.run = compile_only


def resources(kernel) -> dict:
    """Registers, spill bytes and SASS op counts of one compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "--dump-resource-usage", cubin],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(TOOLS, "nvdisasm"), "-c", cubin],
                              capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    opcode = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+(?:\.[A-Z0-9]+)?)",
                        re.M)  # the opcode after the address and an optional predicate
    ops = collections.Counter(m.group(1) for m in opcode.finditer(sass))
    keep = ("HGMMA", "MUFU.EX2", "LDL", "STL", "BAR.SYNC", "WARPGROUP.ARRIVE", "WARPSYNC")
    return {"regs": regs, "stack": stack, "smem": kernel.metadata.shared,
            **{k: sum(v for op, v in ops.items() if op.startswith(k)) for k in keep}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--which", default="fwd,bwd")
    args = ap.parse_args()
    install_fake_driver()
    import importlib

    forward = importlib.import_module("flashkit.ops.triton.forward")
    backward = importlib.import_module("flashkit.ops.triton.backward")

    for head_dim in (int(d) for d in args.head_dims.split(",")):
        for causal in (False, True):
            shape = (1, args.seqlen, 2048 // head_dim, head_dim)
            q, k, v = (torch.empty(shape, dtype=torch.bfloat16) for _ in range(3))
            params = AttentionParams(head_dim ** -0.5, None, 0 if causal else None)
            COMPILED.clear()
            if "fwd" in args.which:
                forward.attention_forward(q, k, v, params)
            if "bwd" in args.which:
                lse = torch.empty((1, shape[2], args.seqlen), dtype=torch.float32)
                backward.attention_backward(q, q, k, v, q, lse, params)
            for name, kwargs, kernel in COMPILED:
                tag = {kk: kwargs[kk] for kk in ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1",
                                                 "BLOCK_M2", "BLOCK_N2", "DO_DKDV", "num_warps",
                                                 "num_stages") if kk in kwargs}
                print(f"d{head_dim} {'causal' if causal else 'full'} {name} {tag} "
                      f"{resources(kernel)}", flush=True)


if __name__ == "__main__":
    main()
