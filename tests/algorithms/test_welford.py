import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashkit.algorithms.welford import (
    Moments,
    merge_moments,
    textbook_variance,
    variance,
    welford,
    welford_update,
)

samples = st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=60)


def assert_matches_numpy(state, xs):
    scale = max(1.0, max(abs(x) for x in xs)) ** 2  # absolute error scales with x^2
    assert state.n == len(xs)
    assert math.isclose(state.mean, np.mean(xs), rel_tol=1e-12, abs_tol=1e-12 * math.sqrt(scale))
    for ddof in (0, 1):
        assert math.isclose(variance(state, ddof), np.var(xs, ddof=ddof), rel_tol=1e-10,
                            abs_tol=1e-12 * scale)


@settings(deadline=None)
@given(xs=samples)
def test_streaming_matches_numpy(xs):
    assert_matches_numpy(welford(xs), xs)


@settings(deadline=None)
@given(xs=samples, data=st.data())
def test_merge_of_any_split_matches_numpy(xs, data):
    cut = data.draw(st.integers(0, len(xs)), label="cut")  # either side may be empty
    merged = merge_moments(welford(xs[:cut]), welford(xs[cut:]))
    assert_matches_numpy(merged, xs)


def test_update_follows_the_seed_recurrence():
    # (N-1) S_N^2 = (N-2) S_{N-1}^2 + (x_N - mean_N)(x_N - mean_{N-1})
    before = welford([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0])
    after = welford_update(before, 9.0)
    assert after == Moments(8, 5.0, 32.0)
    assert math.isclose(after.m2, before.m2 + (9.0 - after.mean) * (9.0 - before.mean))


def test_empty_state_is_the_merge_identity():
    a = welford([1.0, 2.0, 4.0])
    assert merge_moments(Moments(), a) == a == merge_moments(a, Moments())
    assert merge_moments(Moments(), Moments()) == Moments()


def test_welford_survives_what_the_textbook_formula_does_not():
    xs = [1e9 + x for x in (4.0, 7.0, 13.0, 16.0)]  # sample variance 30
    assert variance(welford(xs)) == pytest.approx(30.0, rel=1e-12)
    assert abs(textbook_variance(xs) - 30.0) > 10  # catastrophic cancellation
    assert textbook_variance([4.0, 7.0, 13.0, 16.0]) == pytest.approx(30.0, rel=1e-14)


def test_variance_needs_enough_values():
    with pytest.raises(ValueError, match="ddof=1 needs more than 1 values, got n=1"):
        variance(welford([3.0]))
    assert variance(welford([3.0]), ddof=0) == 0.0
