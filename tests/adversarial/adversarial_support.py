"""What every adversarial test shares: the backends (the same test runs the torch backend and the
Triton kernels: in the interpreter without a GPU, on the GPU with one), tiny random inputs, and
the check that a rejected call raised the right error before touching anything it was given."""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ("torch", "triton")


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def qkv(batch=1, seqlen_q=5, seqlen_k=7, nheads=2, nheads_k=2, headdim=16, dtype=torch.float32):
    return (randn(batch, seqlen_q, nheads, headdim, dtype=dtype),
            randn(batch, seqlen_k, nheads_k, headdim, dtype=dtype),
            randn(batch, seqlen_k, nheads_k, headdim, dtype=dtype))


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes, so NaN payloads and -0.0 compare exactly."""
    return t.detach().contiguous().view(torch.uint8).clone()


def rejects(exc, match: str, fn, *given):
    """fn() raises exc whose message matches `match` (the argument's name), and every tensor in
    `given` (the call's inputs, the caches) is bit for bit as before."""
    before = [bits(t) for t in given]
    with pytest.raises(exc, match=match):
        fn()
    for i, (t, b) in enumerate(zip(given, before, strict=True)):
        assert torch.equal(bits(t), b), f"input {i} was modified by a rejected call"
