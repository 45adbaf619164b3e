"""The Gluon backward of the plain case (flashkit.ops.triton.backward_hopper): which calls take it,
and its gradients against the float64 oracle (DESIGN section 5) through the public backend, on
both dQ paths (atomics by default, the dQ kernel under deterministic=True, bitwise reproducible)."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from tests.ops.test_triton import DEVICE, check_against_oracle, make_inputs

from flashkit.ops import triton as triton_backend
from flashkit.ops.params import AttentionParams

hopper = importlib.import_module("flashkit.ops.triton.backward_hopper")
backward = importlib.import_module("flashkit.ops.triton.backward")


def _on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _eligible(q, k, v, params, tiles=None):
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    return hopper.eligible(q, k, v, torch.empty_like(q), lse, params, torch.empty_like(q),
                           torch.empty_like(k), torch.empty_like(v), tiles)


def test_not_taken_off_hopper_or_with_features():
    q, k, v, _ = make_inputs(1, 128, 128, 4, 2, 64, 64, torch.float16)
    plain = AttentionParams(0.125, None, 0)
    assert _eligible(q, k, v, plain) == (DEVICE == "cuda" and _on_hopper())
    assert not _eligible(q, k, v, plain, tiles={"dkdv": (32, 32, 4, 1)})  # Triton tile sweep
    for params in (AttentionParams(0.125, 7, 0), AttentionParams(0.125, None, 0, softcap=5.0),
                   AttentionParams(0.125, None, 0, dropout_p=0.1),
                   AttentionParams(0.125, None, 0, sink=torch.zeros(4))):
        assert not _eligible(q, k, v, params)
    q_odd, k_odd, v_odd, _ = make_inputs(1, 100, 100, 2, 2, 64, 64, torch.float16)
    assert not _eligible(q_odd, k_odd, v_odd, plain)
    q_short, k_long, v_long, _ = make_inputs(1, 128, 256, 2, 2, 64, 64, torch.float16)
    assert not _eligible(q_short, k_long, v_long, plain)
    q80, k80, v80, _ = make_inputs(1, 128, 128, 2, 2, 80, 80, torch.float16)
    assert not _eligible(q80, k80, v80, plain)


CASES = [  # (dtype, head_dim, seqlen, nheads, nheads_k, causal)
    (torch.bfloat16, 128, 64, 2, 2, True), (torch.bfloat16, 128, 1088, 4, 1, True),
    (torch.float16, 128, 640, 4, 4, False), (torch.bfloat16, 64, 128, 3, 3, True),
    (torch.float16, 64, 1152, 4, 2, True), (torch.bfloat16, 64, 384, 2, 2, False),
    (torch.float16, 128, 256, 8, 2, False),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("path", ["default", "atomic_dq", "deterministic"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_gluon_backward_matches_oracle(case, path, monkeypatch):
    """default: the Gluon dK/dV and dQ kernels; atomic_dq: dQ by atomics in the dK/dV kernel
    (configs.GLUON_BACKWARD_ATOMIC_DQ on); deterministic=True never takes the atomics."""
    monkeypatch.setattr(backward, "GLUON_BACKWARD_ATOMIC_DQ", path != "default")
    deterministic = path == "deterministic"
    dtype, head_dim, seqlen, nheads, nheads_k, causal = case
    q, k, v, dout = make_inputs(2, seqlen, seqlen, nheads, nheads_k, head_dim, head_dim, dtype,
                                "cuda")
    params = AttentionParams(head_dim ** -0.5, None, 0 if causal else None,
                             deterministic=deterministic)
    assert _eligible(q, k, v, params)
    check_against_oracle(q, k, v, dout, params)  # poisoned out, lse, dq, dk, dv


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_gluon_backward_deterministic_is_bitwise_reproducible(head_dim):
    q, k, v, dout = make_inputs(2, 1024, 1024, 8, 2, head_dim, head_dim, torch.bfloat16, "cuda")
    params = AttentionParams(head_dim ** -0.5, None, 0, deterministic=True)
    out, lse = triton_backend.forward(q, k, v, params)
    first = triton_backend.backward(dout, q, k, v, out, lse, params)[:3]
    for _ in range(3):
        again = triton_backend.backward(dout, q, k, v, out, lse, params)[:3]
        for name, a, b in zip(("dq", "dk", "dv"), first, again, strict=True):
            assert torch.equal(a, b), name
    # the atomic path changes dQ's summation order only: dK and dV are the same bits
    atomic = backward.attention_backward(dout, q, k, v, out, lse,
                                         dataclasses.replace(params, deterministic=False),
                                         atomic_dq=True)[:3]
    assert torch.equal(atomic[1], first[1]) and torch.equal(atomic[2], first[2])
