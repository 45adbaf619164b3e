"""Systolic arrays (the TPU post): ticked cycle by cycle, they compute A @ B in M + K + N - 2."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashkit.sim.systolic import format_stagger, systolic_matmul

# An A (2, 3) and B (3, 2) whose product is the one the TPU post's quick test prints.
SEED_A = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
SEED_B = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])


@pytest.mark.parametrize("design", ["weight", "output"])
def test_seed_quick_test(design):
    result = systolic_matmul(SEED_A, SEED_B, design)
    # The TPU post: "A @ B = [[4. 5.] [10. 11.]]", "Total cycles: 6 (M+K+N-2+1 = 6)"; its loop ticks
    # once more after the last result leaves, so the pipeline itself is M + K + N - 2 = 5.
    np.testing.assert_array_equal(result.product, [[4.0, 5.0], [10.0, 11.0]])
    assert result.cycles == 2 + 3 + 2 - 2


def test_weight_stationary_stagger_is_the_seed_diagram():
    result = systolic_matmul(SEED_A, SEED_B, "weight")
    # The TPU post, "timing for a (2, 3) @ (3, 2) matmul": row k receives A[m, k] at cycle m + k.
    for cycle, entering in enumerate(result.entering):
        for row, slot in enumerate(entering):
            m = cycle - row
            assert slot == ((m, row) if 0 <= m < 2 else None)
    # C[m, n] leaves the bottom of column n at cycle m + (K - 1) + n.
    for cycle, leaving in enumerate(result.leaving):
        assert all(cycle == m + 2 + n for m, n in leaving)
    table = format_stagger(result)
    assert "row 2   .       .       A[0,2]  A[1,2]" in table and "C[1,1]" in table


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 6), st.sampled_from(["weight",
                                                                                 "output"]),
       st.integers(0, 2**32 - 1))
def test_any_shape_matches_numpy_and_the_cycle_formula(m, k, n, design, seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(m, k)), rng.normal(size=(k, n))
    result = systolic_matmul(a, b, design)
    np.testing.assert_allclose(result.product, a @ b, rtol=1e-12, atol=1e-12)
    assert result.cycles == m + k + n - 2


def test_bad_operands_are_named():
    with pytest.raises(ValueError, match=r"need A \(M, K\) and B \(K, N\)"):
        systolic_matmul(np.ones((2, 3)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="design must be 'weight' or 'output'"):
        systolic_matmul(SEED_A, SEED_B, "row")
