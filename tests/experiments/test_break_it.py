"""The BREAK IT variants break the way the chapter says, and the intact loop is exact."""

import math

import pytest
import torch

from flashkit.experiments import break_it


def _run(subtract_max, rescale, logit_std, dtype):
    q, k, v = break_it.make_inputs(1, 2, 128, 32, logit_std)
    expected = break_it.naive_attention(q, k, v)
    trace = []
    out = break_it.tiled_attention(q.to(dtype), k.to(dtype), v.to(dtype), 32, subtract_max,
                                   rescale, trace)
    return out.double(), expected, trace


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("logit_std", [1.0, 25.0])
def test_intact_matches_naive(dtype, logit_std):
    out, expected, trace = _run(True, True, logit_std, dtype)
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    assert (out - expected).abs().max() < tol
    assert all(t.broken_rows == 0 for t in trace)


@pytest.mark.parametrize("dtype, logit_std", [(torch.float16, 4.0), (torch.float32, 25.0)])
def test_without_max_subtraction_exp_overflows(dtype, logit_std):
    out, _, trace = _run(False, True, logit_std, dtype)
    assert not torch.isfinite(out).all()
    assert math.isinf(max(t.max_p for t in trace))
    assert any(t.broken_rows for t in trace)


def test_without_max_subtraction_small_scores_survive_fp32():
    out, expected, _ = _run(False, True, 1.0, torch.float32)
    assert (out - expected).abs().max() < 1e-4


@pytest.mark.parametrize("logit_std", [1.0, 4.0])
def test_without_rescaling_finite_and_wrong(logit_std):
    out, expected, trace = _run(True, False, logit_std, torch.float32)
    assert torch.isfinite(out).all()
    assert all(t.broken_rows == 0 for t in trace)
    assert (out - expected).abs().max() > 0.05


def test_run_variants_reports_first_broken_tile():
    inputs = break_it.make_inputs(1, 1, 64, 16, 25.0)
    outcomes = {(o.dtype, o.variant): o for o in break_it.run_variants(inputs, 25.0, block=16)}
    assert outcomes["float16", "no max subtraction"].first_broken_tile == 0
    assert outcomes["float32", "intact"].first_broken_tile is None
    assert math.isinf(outcomes["float16", "no max subtraction"].max_error)
