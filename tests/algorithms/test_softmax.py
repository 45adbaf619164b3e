import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashkit.algorithms.softmax import (
    native_softmax,
    online_normalizer,
    online_softmax,
    online_steps,
    safe_softmax,
)

VARIANTS = [native_softmax, safe_softmax, online_softmax]
SEED_X = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def torch_softmax(x):
    return torch.softmax(torch.tensor(x, dtype=torch.float64), -1)


@pytest.mark.parametrize("softmax", VARIANTS)
def test_seed_worked_example(softmax):
    a = softmax(SEED_X)
    assert [round(a_i, 4) for a_i in a] == [0.0043, 0.0116, 0.0315, 0.0858, 0.2331, 0.6337]
    assert round(sum(a_i * v_i for a_i, v_i in zip(a, SEED_X, strict=True)), 4) == 5.4329


@pytest.mark.parametrize("softmax", VARIANTS)
@settings(deadline=None)  # the first example pays torch's warm-up
@given(x=st.lists(st.floats(-30, 30), min_size=1, max_size=40))
def test_matches_torch_softmax(softmax, x):
    torch.testing.assert_close(torch.tensor(softmax(x), dtype=torch.float64), torch_softmax(x),
                               rtol=1e-13, atol=1e-16)


@pytest.mark.parametrize("softmax", [safe_softmax, online_softmax])
@settings(deadline=None)
@given(x=st.lists(st.floats(-1e4, 1e4), min_size=1, max_size=40))
def test_safe_variants_take_large_inputs(softmax, x):
    torch.testing.assert_close(torch.tensor(softmax(x), dtype=torch.float64), torch_softmax(x),
                               rtol=1e-13, atol=1e-16)


def test_native_softmax_overflows():
    with pytest.raises(OverflowError):
        native_softmax([1000.0, 1001.0])
    assert safe_softmax([1000.0, 1001.0]) == online_softmax([1000.0, 1001.0])


@settings(deadline=None)
@given(x=st.lists(st.floats(-100, 100), min_size=1, max_size=30))
def test_online_steps_keep_the_invariant(x):
    # After k elements: m_k = max(x[:k]) and d_k = sum_{j<k} e^{x_j - m_k}.
    for k, (m, d) in enumerate(online_steps(x), start=1):
        assert m == max(x[:k])
        assert math.isclose(d, math.fsum(math.exp(x_j - m) for x_j in x[:k]), rel_tol=1e-13)


def test_online_normalizer_is_single_pass_and_handles_empty():
    m, d = online_normalizer(float(x) for x in SEED_X)  # a generator: read once
    assert m == 6.0 and math.isclose(d, sum(math.exp(x - 6.0) for x in SEED_X), rel_tol=1e-15)
    assert online_normalizer([]) == (-math.inf, 0.0)
