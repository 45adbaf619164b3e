"""Shared set-up for the JAX tests: the differential check against the torch oracle.

`compare` draws seeded random inputs, runs flashkit.jax forward and backward (through jax.vjp,
with a random cotangent on out and on lse) and checks out, lse, dq, dk, dv with the rule of
docs/design.md section 5: oracle = flashkit.reference in float64, baseline = the same torch
computation in the kernel's dtype (float32 or bfloat16).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from flashkit.jax import flash_attention  # noqa: E402
from flashkit.reference import attention  # noqa: E402
from flashkit.testing import assert_close_to_oracle  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _torch_run(arrays, dtype, causal, scale, window):
    """Reference out, lse and (dq, dk, dv) in `dtype`, cotangents (dout, dlse) from arrays."""
    q, k, v, dout, dlse = (torch.from_numpy(a).to(dtype) for a in arrays)
    for t in (q, k, v):
        t.requires_grad_()
    out, lse = attention(q, k, v, causal=causal, softmax_scale=scale, window_size=window)
    # lse is -inf on rows that see nothing: their cotangent must not touch it.
    seen = torch.isfinite(lse)
    loss = (out * dout).sum() + torch.where(seen, lse * dlse, torch.zeros_like(lse)).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    return (out.detach(), lse.detach(), *grads)


def _to_torch(x):
    return torch.from_numpy(np.array(x.astype(jnp.float32))).double()


def compare(implementation, *, batch=1, seqlen_q, seqlen_k=None, nheads=1, nheads_k=None,
            d=64, dv=None, causal=False, window=(-1, -1), scale=None, dtype="float32",
            block_q=None, block_k=None, seed=0, with_grads=True):
    """Check out and lse (and with with_grads dq, dk, dv) of one implementation."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    nheads_k = nheads if nheads_k is None else nheads_k
    dv = d if dv is None else dv
    rng = np.random.default_rng(seed)
    shapes = [(batch, seqlen_q, nheads, d), (batch, seqlen_k, nheads_k, d),
              (batch, seqlen_k, nheads_k, dv), (batch, seqlen_q, nheads, dv),
              (batch, nheads, seqlen_q)]
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    if dtype == "bfloat16":  # the same values for every party: round once to bf16
        arrays = [torch.from_numpy(a).bfloat16().float().numpy() for a in arrays]

    oracle = _torch_run(arrays, torch.float64, causal, scale, window)
    baseline = _torch_run(arrays, TORCH_DTYPES[dtype], causal, scale, window)

    def attend(q, k, v):
        return flash_attention(q, k, v, causal=causal, softmax_scale=scale, window_size=window,
                               implementation=implementation, return_lse=True,
                               block_q=block_q, block_k=block_k)

    def run(q, k, v, dout, dlse):  # forward and backward, jitted as one program
        if not with_grads:
            return *attend(q, k, v), ()
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return out, lse, vjp((dout, jnp.where(jnp.isfinite(lse), dlse, 0.0)))

    out, lse, grads = jax.jit(run)(*(jnp.asarray(a, dtype=dtype) for a in arrays[:4]),
                                   jnp.asarray(arrays[4]))
    assert out.dtype == dtype and lse.dtype == jnp.float32
    names = ("out", "lse", "dq", "dk", "dv")[:2 + len(grads)]
    for name, actual, ref, base in zip(names, (out, lse, *grads), oracle[:len(names)],
                                       baseline[:len(names)], strict=True):
        assert_close_to_oracle(f"{implementation} {name}", _to_torch(actual), ref, base)
    return out, lse, grads


@pytest.fixture
def check():
    """The differential check, as a fixture: check(implementation, seqlen_q=..., ...)."""
    return compare
