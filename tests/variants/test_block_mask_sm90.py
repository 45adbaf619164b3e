"""The Gluon kernels walking a block mask compile for sm_90 and fit its shared memory, without a
GPU.

The Gluon forward, dQ and dK/dV kernels take a block mask as a tuple argument whose members
Triton specialises like any other (a tile count of 1 becomes a compile-time constant), and a
constant inside a tuple is where Triton's code generator has failed (a head dim 64 dK/dV kernel
read it as None inside a loop). This test makes the launches the Gluon launchers make for a
document mask, shared by the heads and one per head, with a score_mod, ALiBi and a sink on top,
at head dims 64, 128 and 256 (the tiles of each, so every tile count per block occurs), and
the dQ kernel with each built-in captured_grad rule (a learned tensor's gradient, added by
atomics from the wgmma accumulator's layout), and the three with a causal mask over varlen's
packed tokens (run as one sequence, the modifiers given positions within each), and compiles
each for sm_90 down to ptxas. A stand-in driver answers "cuda sm_90" and every launch only
compiles (benchmarks/diagnostics/sm90_probe.py), in a child process without the interpreter
this test process has switched on.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

SM90_SHARED_BYTES = 232448  # the most shared memory one block may use on sm_90
CASES = [(torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 256)]
KERNELS = ("_fwd_hopper_kernel", "_bwd_dq_hopper_kernel", "_bwd_dkdv_hopper_kernel")
CAPTURED_RULES = ("relative_bias", "alibi", "token_bias")  # the built-in captured_grad rules


@pytest.mark.slow
def test_gluon_block_mask_kernels_compile_for_sm90():
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        from triton.experimental import gluon  # noqa: F401
        get_ptxas(90)
    except Exception as err:  # a triton build without Gluon or the CUDA toolchain
        pytest.skip(f"no Gluon or ptxas: {err}")
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [
        str(root / "src"), str(root / "benchmarks" / "diagnostics"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    assert sorted((int(d), kind, kernel) for d, kind, kernel, _ in rows) == sorted(
        [(d, kind, kernel) for _, d in CASES for kind in ("shared", "per_head")
         for kernel in KERNELS]
        + [(d, rule, "_bwd_dq_hopper_kernel") for _, d in CASES for rule in CAPTURED_RULES]
        + [(d, "packed", kernel) for _, d in CASES for kernel in KERNELS])
    too_big = [row for row in rows if int(row[3]) > SM90_SHARED_BYTES]
    assert not too_big, f"shared memory over {SM90_SHARED_BYTES} bytes: {too_big}"


@triton.jit
def _same_document(b, h, q_idx, kv_idx, ids, stride_b, stride_h):
    """Document ids per batch entry and head (stride_h 0: one row for every head)."""
    row = ids + b * stride_b + h * stride_h
    return tl.load(row + q_idx) == tl.load(row + kv_idx)


def _compile(case: tuple) -> list[str]:
    """`head_dim shared|per_head kernel shared_bytes` of each Gluon kernel a block-mask call
    launches (forward, dQ, dK/dV), compiled for sm_90."""
    dtype, head_dim, per_head = case
    import sm90_probe

    sm90_probe.COMPILED.clear()  # this case's builds only (a worker process runs several)
    import flashkit
    from flashkit import variants
    from flashkit.ops.params import AttentionParams, lse_shape
    from flashkit.ops.triton import backward_hopper, forward_hopper, launch
    from flashkit.variants.mods import attach

    launch._hooked = lambda: True  # every launch through kernel[grid], i.e. compile_only
    forward_hopper.programs_per_device = lambda device, consumers: 132  # an H100/H200's SMs
    torch.manual_seed(0)
    batch, nheads, nheads_k, seqlen = 2, 8, 2, 512
    doc = (torch.arange(seqlen) // 97).repeat(batch, nheads if per_head else 1, 1).contiguous()
    mod = flashkit.MaskMod(_same_document, doc, doc.stride(0), doc.stride(1) if per_head else 0)
    mask = flashkit.create_block_mask(mod, batch, nheads if per_head else None, seqlen, seqlen,
                                      device="cpu")
    q = torch.empty(batch, seqlen, nheads, head_dim, dtype=dtype)
    k, v = (torch.empty(batch, seqlen, nheads_k, head_dim, dtype=dtype) for _ in range(2))
    params = AttentionParams(head_dim ** -0.5, alibi_slopes=torch.rand(nheads),
                             sink=torch.randn(nheads))
    params = attach(params, q, variants.relative_bias(torch.randn(nheads, 13)), mod, mask,
                    batch, nheads, seqlen, seqlen)
    assert forward_hopper.block_mask_declines(q, k, params) is None
    assert backward_hopper.block_mask_declines(q, params) is None
    lse = torch.empty(lse_shape(q, params), dtype=torch.float32)
    delta = torch.empty_like(lse)
    forward_hopper.attention_forward(q, k, v, params)
    backward_hopper.attention_backward_dq(q, q, k, v, q, lse, delta, None, params,
                                          torch.empty_like(q))
    backward_hopper.attention_backward_dkdv(q, q, k, v, lse, delta, params, torch.empty_like(k),
                                            torch.empty_like(v))
    label = "per_head" if per_head else "shared"
    rows = [f"{head_dim} {label} {name} {kernel.metadata.shared}"
            for name, _, kernel in sm90_probe.COMPILED if kernel.asm["cubin"]]
    if per_head:
        return rows
    # A causal document mask over varlen's packed tokens, run as one sequence (the packing)
    sm90_probe.COMPILED.clear()
    cu = torch.tensor([0, 300, 301, 818, 1024], dtype=torch.int32)
    packed_mask = flashkit.create_block_mask(variants.causal_mask(), None, None, 1024, 1024,
                                             device="cpu", cu_seqlens_q=cu, cu_seqlens_k=cu)
    q1 = torch.empty(1, 1024, nheads, head_dim, dtype=dtype)
    varlen = attach(AttentionParams(head_dim ** -0.5, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                    max_seqlen_q=517, max_seqlen_k=517), q1[0], None, None,
                    packed_mask, 4, nheads, 517, 517)
    packed = AttentionParams(head_dim ** -0.5, variant=dataclasses.replace(
        varlen.variant, packing=packed_mask.packing))  # as variants.autograd runs it
    k1, v1 = (torch.empty(1, 1024, nheads_k, head_dim, dtype=dtype) for _ in range(2))
    assert forward_hopper.block_mask_declines(q1, k1, packed) is None
    assert backward_hopper.block_mask_declines(q1, packed) is None
    lse1 = torch.empty(lse_shape(q1, packed), dtype=torch.float32)
    forward_hopper.attention_forward(q1, k1, v1, packed)
    backward_hopper.attention_backward_dq(q1, q1, k1, v1, q1, lse1, torch.empty_like(lse1), None,
                                          packed, torch.empty_like(q1))
    backward_hopper.attention_backward_dkdv(q1, q1, k1, v1, lse1, torch.empty_like(lse1), packed,
                                            torch.empty_like(k1), torch.empty_like(v1))
    rows += [f"{head_dim} packed {name} {kernel.metadata.shared}"
             for name, _, kernel in sm90_probe.COMPILED if kernel.asm["cubin"]]
    # The dQ kernel with each built-in captured_grad rule (a learned table, slopes, token bias)
    for rule, mod in (("relative_bias", variants.relative_bias(torch.randn(nheads, 13))),
                      ("alibi", variants.alibi(torch.rand(nheads))),
                      ("token_bias", variants.token_bias(torch.randn(batch, seqlen)))):
        sm90_probe.COMPILED.clear()
        learned = attach(AttentionParams(head_dim ** -0.5), q, mod, None, None, batch, nheads,
                         seqlen, seqlen)
        grads = [torch.zeros(t.shape) if isinstance(t, torch.Tensor) else None
                 for t in mod.captured]
        learned = dataclasses.replace(learned, variant=dataclasses.replace(
            learned.variant, captured_grads=grads))
        backward_hopper.attention_backward_dq(q, q, k, v, q, lse, delta, None, learned,
                                              torch.empty_like(q))
        rows += [f"{head_dim} {rule} {name} {kernel.metadata.shared}"
                 for name, _, kernel in sm90_probe.COMPILED if kernel.asm["cubin"]]
    return rows


def main() -> None:
    """Print `head_dim shared|per_head kernel shared_bytes` for every case."""
    import sm90_probe  # benchmarks/diagnostics: its fake driver makes launches compile only

    cases = [(dtype, d, per_head) for dtype, d in CASES for per_head in (False, True)]
    with ProcessPoolExecutor(2, initializer=sm90_probe.install_fake_driver) as pool:
        for rows in pool.map(_compile, cases):
            print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
