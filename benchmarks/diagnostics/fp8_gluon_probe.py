"""Whether Triton's Gluon compiles an FP8 attention tile for sm_90 the way an FP8 version of the
Gluon forward needs it, offline (no GPU): S = Q K^T with e4m3 operands in shared memory, then
O = P V with P rounded to e4m3 in registers (the wgmma's register A operand, k_width 4) and V
key-major in shared memory (wgmma takes fp8 B operands K-major only). Prints the registers,
spills and the SASS tensor-core instructions of one tile.

    PYTHONPATH=src python3 benchmarks/diagnostics/fp8_gluon_probe.py [--head-dim 128]
        [--block-n 128]

A one-warpgroup tile with plain loads: a feasibility check of the operand layouts, not a
kernel to time. Needs Triton's bundled ptxas and nvdisasm (sm90_probe.py).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sm90_probe as probe  # noqa: E402

BLOCK_M = 64  # one warpgroup's wgmma rows


@gluon.jit
def fp8_tile(Q, K, Vt, Out, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr):
    """Out [BM, D] bf16 = softmax-numerator(Q K^T) V for Q [BM, D], K [BN, D] and Vt [D, BN]
    (V key-major), all e4m3, row-major."""
    blocked: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    rows_m = gl.arange(0, BM, layout=gl.SliceLayout(1, blocked))
    rows_n = gl.arange(0, BN, layout=gl.SliceLayout(1, blocked))
    rows_d = gl.arange(0, D, layout=gl.SliceLayout(1, blocked))
    cols_d = gl.arange(0, D, layout=gl.SliceLayout(0, blocked))
    cols_n = gl.arange(0, BN, layout=gl.SliceLayout(0, blocked))
    q = gl.load(Q + gl.expand_dims(rows_m, 1) * D + gl.expand_dims(cols_d, 0))
    k = gl.load(K + gl.expand_dims(rows_n, 1) * D + gl.expand_dims(cols_d, 0))
    vt = gl.load(Vt + gl.expand_dims(rows_d, 1) * BN + gl.expand_dims(cols_n, 0))
    q_smem = gl.allocate_shared_memory(
        gl.float8e4nv, [BM, D], gl.NVMMASharedLayout.get_default_for([BM, D], gl.float8e4nv), q)
    k_smem = gl.allocate_shared_memory(
        gl.float8e4nv, [BN, D], gl.NVMMASharedLayout.get_default_for([BN, D], gl.float8e4nv), k)
    vt_smem = gl.allocate_shared_memory(
        gl.float8e4nv, [D, BN], gl.NVMMASharedLayout.get_default_for([D, BN], gl.float8e4nv),
        vt)
    # fp8 wgmma: K = 32 per instruction
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 32])
    # [BM, BN] = [BM, D] @ [D, BN]: both operands K-major (D contiguous)
    s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), gl.zeros([BM, BN], gl.float32, s_layout))
    p = gl.exp2(s - gl.expand_dims(gl.max(s, axis=1), 1))
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    p_op = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
    # [BM, D] = [BM, BN] @ [BN, D]: V viewed from Vt, keys (the K dim) contiguous
    o = warpgroup_mma(p_op, vt_smem.permute((1, 0)), gl.zeros([BM, D], gl.float32, o_layout))
    out_rows = gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
    out_cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    gl.store(Out + gl.expand_dims(out_rows, 1) * D + gl.expand_dims(out_cols, 0),
             o.to(gl.bfloat16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=128, help="keys per tile")
    args = ap.parse_args()
    probe.install_fake_driver()
    d, n = args.head_dim, args.block_n
    e4m3 = torch.float8_e4m3fn
    q, k, vt = (torch.zeros(shape, dtype=e4m3) for shape in ((BLOCK_M, d), (n, d), (d, n)))
    out = torch.zeros(BLOCK_M, d, dtype=torch.bfloat16)
    compiled = fp8_tile.warmup(q, k, vt, out, BM=BLOCK_M, BN=n, D=d, grid=(1,), num_warps=4)
    used = probe.resources(compiled)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([os.path.join(probe.TOOLS, "nvdisasm"), "-c", cubin],
                              capture_output=True, text=True).stdout
    tensor_ops = collections.Counter(re.findall(r"\b((?:HGMMA|QGMMA)\.[\w.]+)", sass))
    converts = collections.Counter(re.findall(r"\b(F2FP\.[\w.]+)", sass))
    print(f"d{d}, {n} keys per tile: {used['regs']} registers, spill stack {used['stack']} "
          f"bytes, {used['smem']} bytes of shared memory")
    print("tensor-core instructions:", dict(tensor_ops))
    print("conversions:", dict(converts))


if __name__ == "__main__":
    main()
