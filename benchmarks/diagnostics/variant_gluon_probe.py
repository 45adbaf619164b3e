"""Whether Triton's Gluon compiles a user's @triton.jit modifiers where the Gluon forward and
backward would call them, offline (no GPU): on a score tile in the Hopper wgmma accumulator's
register layout (NVMMADistributedLayout v3, the layout the Gluon kernels hold S and dS in), with
the captured values passed as a runtime tuple and unpacked into the call, as the portable
kernels do (`SCORE_MOD(s, b, h, q_idx, kv_idx, *score_args)`). For every built-in of
flashkit.variants: the score_mod and its grad, the mask_mod, and the captured-gradient rule
(atomic adds into a float32 buffer); and the score_mod inside gl.warp_specialize, as the
specialized Gluon forward's partitions would take it. Prints, per built-in and part, whether it
compiled for sm_90, its registers and spill bytes (a warp-specialized kernel reports the
register budget it was given).

    PYTHONPATH=src python3 benchmarks/diagnostics/variant_gluon_probe.py [--block-n 128]

A one-warpgroup tile with plain loads and stores: a feasibility check of calling the modifiers
from Gluon, not a kernel to time. Needs Triton's bundled ptxas and cuobjdump (sm90_probe.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sm90_probe as probe  # noqa: E402

from flashkit import variants  # noqa: E402

BLOCK_M = gl.constexpr(64)  # one warpgroup's wgmma rows


@gluon.jit
def _tile(block_n: gl.constexpr):
    """The accumulator layout of a [BLOCK_M, block_n] wgmma tile of one warpgroup, and its
    row (query) and column (key) indices."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, block_n, 16])
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, block_n, layout=gl.SliceLayout(0, layout))
    return rows[:, None], cols[None, :], rows[:, None] * block_n + cols[None, :]


@gluon.jit
def score_tile(S, Out, score_args, SCORE_MOD: gl.constexpr, BLOCK_N: gl.constexpr):
    """Out = SCORE_MOD(S) on one tile (batch 1, head 3, query and key indices of the tile)."""
    q_idx, kv_idx, offs = _tile(BLOCK_N)
    s = gl.load(S + offs)
    gl.store(Out + offs, SCORE_MOD(s, 1, 3, q_idx, kv_idx, *score_args))


@gluon.jit
def mask_tile(S, Out, mask_args, MASK_MOD: gl.constexpr, BLOCK_N: gl.constexpr):
    """Out = S where MASK_MOD keeps the pair, else -inf."""
    q_idx, kv_idx, offs = _tile(BLOCK_N)
    s = gl.load(S + offs)
    keep = MASK_MOD(1, 3, q_idx, kv_idx, *mask_args)
    gl.store(Out + offs, gl.where(keep, s, float("-inf")))


@gluon.jit
def captured_grad_tile(DS, S, score_args, grad_args, CAPTURED_GRAD: gl.constexpr,
                       BLOCK_N: gl.constexpr):
    """CAPTURED_GRAD adds dS's share into the captured tensors' gradient buffers."""
    q_idx, kv_idx, offs = _tile(BLOCK_N)
    CAPTURED_GRAD(gl.load(DS + offs), gl.load(S + offs), 1, 3, q_idx, kv_idx, *score_args,
                  *grad_args)


@gluon.jit
def _score_partition(S, Out, score_args, SCORE_MOD: gl.constexpr, BLOCK_N: gl.constexpr,
                     ROLE: gl.constexpr):
    if ROLE == 0:  # the consumer warpgroup; the worker warp (ROLE 1) only stands by
        q_idx, kv_idx, offs = _tile(BLOCK_N)
        s = gl.load(S + offs)
        gl.store(Out + offs, SCORE_MOD(s, 1, 3, q_idx, kv_idx, *score_args))


@gluon.jit
def specialized_score_tile(S, Out, score_args, SCORE_MOD: gl.constexpr, BLOCK_N: gl.constexpr):
    """score_tile inside gl.warp_specialize, as the specialized Gluon forward's partitions take
    their arguments: the captured tuple and SCORE_MOD passed to each partition (Triton 3.6
    refuses constexpr tuples there, not runtime ones)."""
    gl.warp_specialize([(_score_partition, (S, Out, score_args, SCORE_MOD, BLOCK_N, 0)),
                        (_score_partition, (S, Out, score_args, SCORE_MOD, BLOCK_N, 1))],
                       [1], [24])


def builtins() -> dict:
    """name -> the built-in's ScoreMod or MaskMod, on CPU tensors (only their dtypes and the
    alignment of their addresses reach the compiler)."""
    doc = torch.zeros(2, 4096, dtype=torch.int32)
    return {
        "alibi": variants.alibi(torch.rand(16)),
        "softcap": variants.softcap(30.0),
        "relative_bias": variants.relative_bias(torch.rand(16, 257)),
        "token_bias": variants.token_bias(torch.rand(2, 4096)),
        "document_mask": variants.document_mask(doc),
        "document_mask causal": variants.document_mask(doc, causal=True),
        "prefix_lm": variants.prefix_lm(torch.full((2,), 100, dtype=torch.int32)),
        "sliding_window_with_globals": variants.sliding_window_with_globals(256, 4),
        "causal_window": variants.causal_window(256),
    }


def _compile(kernel, *args) -> str:
    try:
        kernel[(1,)](*args, num_warps=4)
    except Exception as error:  # the finding: what Gluon refuses, and why
        return f"FAILED {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    resources = probe.resources(probe.COMPILED[-1][2])
    return f"ok  {resources['regs']} registers, {resources['stack']} bytes of stack (spills)"


def parts(mod, s: torch.Tensor, block_n: int) -> dict:
    """part -> (kernel, its arguments) for one built-in."""
    captured = mod.kernel_args()
    if isinstance(mod, variants.MaskMod):
        return {"mask_mod": (mask_tile, s, s, captured, mod.jit(), block_n)}
    found = {"score_mod": (score_tile, s, s, captured, mod.jit(), block_n),
             "specialized": (specialized_score_tile, s, s, captured, mod.jit(), block_n),
             "grad": (score_tile, s, s, captured, mod.jit_grad(), block_n)}
    if mod.captured_grad is not None:
        grads = tuple(torch.zeros(t.numel()) if isinstance(t, torch.Tensor) else None
                      for t in captured)
        found["captured_grad"] = (captured_grad_tile, s, s, captured, grads,
                                  mod.jit_captured_grad(), block_n)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-n", type=int, default=128, help="keys per tile")
    args = ap.parse_args()
    probe.install_fake_driver()
    s = torch.empty(BLOCK_M * args.block_n)
    for name, mod in builtins().items():
        for part, (kernel, *kernel_args) in parts(mod, s, args.block_n).items():
            print(f"{name:28s} {part:14s} {_compile(kernel, *kernel_args)}", flush=True)


if __name__ == "__main__":
    main()
