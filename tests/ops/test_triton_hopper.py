"""The Gluon forward of the plain case (flashkit.ops.triton.forward_hopper): which calls take it,
and its outputs against the float64 oracle (DESIGN section 5) through the public backend."""

from __future__ import annotations

import importlib

import pytest
import torch
from tests.ops.test_triton import DEVICE, check_against_oracle, make_inputs

from flashkit.ops.params import AttentionParams

hopper = importlib.import_module("flashkit.ops.triton.forward_hopper")


def _on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_not_taken_off_hopper_or_with_features():
    q, k, v, _ = make_inputs(1, 128, 128, 2, 2, 64, 64, torch.float16)
    plain = AttentionParams(0.125, None, 0)
    assert hopper.eligible(q, k, v, plain, None, None, None) == (DEVICE == "cuda"
                                                                  and _on_hopper())
    for params in (AttentionParams(0.125, 7, 0), AttentionParams(0.125, None, 0, softcap=5.0)):
        assert not hopper.eligible(q, k, v, params, None, None, None)
    q_odd, k_odd, v_odd, _ = make_inputs(1, 100, 100, 2, 2, 64, 64, torch.float16)
    assert not hopper.eligible(q_odd, k_odd, v_odd, plain, None, None, None)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", [  # (dtype, head_dim, seqlen, nheads, nheads_k, causal)
    (torch.bfloat16, 128, 64, 2, 2, True), (torch.bfloat16, 128, 1088, 4, 1, True),
    (torch.float16, 128, 640, 4, 4, False), (torch.bfloat16, 64, 128, 3, 3, True),
    (torch.float16, 64, 1152, 4, 2, True), (torch.bfloat16, 64, 384, 2, 2, False),
], ids=str)
def test_gpu_gluon_forward_matches_oracle(case):
    dtype, head_dim, seqlen, nheads, nheads_k, causal = case
    q, k, v, dout = make_inputs(2, seqlen, seqlen, nheads, nheads_k, head_dim, head_dim, dtype,
                                "cuda")
    params = AttentionParams(head_dim ** -0.5, None, 0 if causal else None)
    assert hopper.eligible(q, k, v, params, None, None, None)
    check_against_oracle(q, k, v, dout, params)
