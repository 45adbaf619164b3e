import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashkit.algorithms.merge import State, block_state, empty_state, finalize, fold, merge

F64 = torch.float64
scores = st.lists(st.one_of(st.floats(-50, 50), st.just(-math.inf)), min_size=1, max_size=8)


def values(n, dv, seed):
    return torch.randn(n, dv, dtype=F64, generator=torch.Generator().manual_seed(seed))


def state_of(x, dv=3, seed=0):
    return block_state(torch.tensor(x, dtype=F64), values(len(x), dv, seed))


def assert_states_close(a: State, b: State):
    assert torch.equal(a.m, b.m)  # max is exact
    torch.testing.assert_close(a.l, b.l, rtol=1e-13, atol=0)
    torch.testing.assert_close(a.o, b.o, rtol=1e-13, atol=1e-300)


@settings(deadline=None)  # the first example pays torch's warm-up
@given(xa=scores, xb=scores, xc=scores)
def test_merge_is_associative(xa, xb, xc):
    a, b, c = state_of(xa, seed=1), state_of(xb, seed=2), state_of(xc, seed=3)
    assert_states_close(merge(merge(a, b), c), merge(a, merge(b, c)))


@settings(deadline=None)
@given(xa=scores, xb=scores)
def test_merge_is_commutative_exactly(xa, xb):
    a, b = state_of(xa, seed=1), state_of(xb, seed=2)
    for field_ab, field_ba in zip(merge(a, b), merge(b, a), strict=True):
        assert torch.equal(field_ab, field_ba)


@settings(deadline=None)
@given(x=scores)
def test_empty_state_is_the_identity(x):
    a = state_of(x)
    for merged in (merge(empty_state((), 3), a), merge(a, empty_state((), 3))):
        for field, expected in zip(merged, a, strict=True):
            assert torch.equal(field, expected)


@settings(deadline=None)
@given(data=st.data())
def test_any_split_in_any_order_gives_softmax_at_v(data):
    n = data.draw(st.integers(1, 30), label="n")
    x = torch.tensor(data.draw(st.lists(st.floats(-50, 50), min_size=n, max_size=n)), dtype=F64)
    v = values(n, data.draw(st.integers(1, 4), label="dv"), seed=n)
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1)), label="cuts")) if n > 1 else []
    bounds = [0, *cuts, n]
    chunks = [block_state(x[lo:hi], v[lo:hi]) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    chunks = data.draw(st.permutations(chunks), label="order")

    out, lse = finalize(fold(chunks))
    torch.testing.assert_close(out, torch.softmax(x, -1) @ v, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lse, torch.logsumexp(x, -1, keepdim=True), rtol=1e-14, atol=0)


def test_rows_are_independent_and_masked_rows_give_zero():
    # Three rows at once; the last sees no visible key at all.
    s = torch.randn(3, 10, dtype=F64, generator=torch.Generator().manual_seed(0)) * 5
    s[0, 3:7] = -math.inf
    s[2] = -math.inf
    v = values(10, 4, seed=1)
    out, lse = finalize(merge(block_state(s[:, :6], v[:6]), block_state(s[:, 6:], v[6:])))
    torch.testing.assert_close(out[:2], torch.softmax(s[:2], -1) @ v, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lse[:2], torch.logsumexp(s[:2], -1, keepdim=True), rtol=1e-14,
                               atol=0)
    assert torch.equal(out[2], torch.zeros(4, dtype=F64))
    assert lse[2].item() == -math.inf


def test_seed_example_through_chunks():
    x = torch.arange(1.0, 7.0, dtype=F64)
    state = fold([block_state(x[:2], x[:2, None]), block_state(x[2:5], x[2:5, None]),
                  block_state(x[5:], x[5:, None])])
    out, _ = finalize(state)
    assert round(out.item(), 4) == 5.4329
