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


def _causal(**switches):
    q, k, v = break_it.make_inputs(1, 1, 64, 16, 1.0, seed=3)
    out = break_it.tiled_attention(q, k, v, 16, causal=True, **switches)
    return out, break_it.naive_attention(q, k, v, causal=True)


def test_causal_intact_matches_naive():
    out, expected = _causal()
    assert (out - expected).abs().max() < 1e-12


def test_causal_mask_from_zero_sees_the_future():
    out, expected = _causal(mask_from_zero=True)
    error = (out - expected).abs().amax(-1)[0, 0].view(4, 16)  # per row tile, per row
    assert (error.amax(-1) > 0.1).all()  # every row tile is wrong
    q, k, v = break_it.make_inputs(1, 1, 64, 16, 1.0, seed=3)
    v_future = v.clone()
    v_future[..., 16, :] += 1.0  # key 16 is in query 0's future
    for switches, leaks in (({}, False), ({"mask_from_zero": True}, True)):
        a = break_it.tiled_attention(q, k, v, 16, causal=True, **switches)[..., 0, :]
        b = break_it.tiled_attention(q, k, v_future, 16, causal=True, **switches)[..., 0, :]
        assert bool((a - b).abs().max() > 1e-3) == leaks


def test_chapter_causal_loop_without_skip_is_nan_except_last_row_tile():
    out, _ = _causal(skip_masked_tiles=False)
    finite = torch.isfinite(out).all(-1)[0, 0]
    assert not finite[:48].any() and finite[48:].all()


def test_shifted_inputs_shift_every_score():
    q, k, v = break_it.make_inputs(1, 1, 8, 4, 1.0)
    q2, k2, _ = break_it.shifted_inputs((q, k, v), -30.0)
    s = q @ k.transpose(-1, -2) / 2
    s2 = q2 @ k2.transpose(-1, -2) / 5 ** 0.5
    assert (s2 - (s - 30.0)).abs().max() < 1e-12


def test_running_max_from_zero_exact_near_zero_nan_far_below():
    inputs = break_it.make_inputs(1, 1, 64, 16, 1.0)
    points = {(p.shift, p.dtype): p for p in
              break_it.max_init_sweep(inputs, (0.0, -120.0), dtypes=("float32",), block=16)}
    near, far = points[0.0, "float32"], points[-120.0, "float32"]
    assert near.error_zero < 1e-5 and near.error_minus_inf < 1e-5
    assert far.error_minus_inf < 1e-4 and math.isinf(far.error_zero)


def test_gpt_with_intact_tiles_trains_like_the_oracle():
    from flashkit.experiments import corpus, train
    config = train.configs("cpu", steps=2, seqlens=(32,), tokens=64, n_layer=1, n_head=2,
                           n_embd=16)[0]
    text = corpus.load_text()
    tok = corpus.CharTokenizer(text)
    oracle = train.train_once("naive", config, tok.encode(text), tok.vocab_size)
    runs = {r.attention: r for r in break_it.train_variants(config)}
    assert abs(runs["intact"].losses[0] - oracle.losses[0]) < 1e-5
    assert abs(runs["mask from arange(0) in each tile"].losses[0] - oracle.losses[0]) > 1e-4
    assert all(math.isfinite(x) for r in runs.values() for x in r.losses)
