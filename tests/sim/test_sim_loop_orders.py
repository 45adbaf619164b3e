"""Attention loop orders: both schedules compute attention; their HBM counts are the essay's."""

import math

import numpy as np
import pytest

from flashkit.sim.loop_orders import HBMTraffic, inner_product_attention, outer_product_attention


def _attention(q, k, v):
    s = q @ k.T
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v


@pytest.fixture
def qkv():
    rng = np.random.default_rng(0)
    return rng.normal(size=(7, 3)) * 2, rng.normal(size=(7, 3)), rng.normal(size=(7, 2))


def test_one_output_in_fast_memory_is_the_seed_cost_table(qkv):
    n = 7
    _, inner = inner_product_attention(*qkv)
    _, outer = outer_product_attention(*qkv)
    # The essay, "HBM traffic: inner product vs outer product":
    # Q loads n | n^2, KV loads n^2 | n, O loads n | n^2, O stores n | n^2.
    assert inner == HBMTraffic(q_loads=n, kv_loads=n * n, o_loads=n, o_stores=n)
    assert outer == HBMTraffic(q_loads=n * n, kv_loads=n, o_loads=n * n, o_stores=n * n)


@pytest.mark.parametrize("resident", range(8))
def test_each_resident_output_saves_n_minus_1(qkv, resident):
    n = 7
    out, traffic = outer_product_attention(*qkv, resident=resident)
    np.testing.assert_allclose(out, _attention(*qkv), rtol=1e-12)
    # The essay: "Each additional output slot we keep in fast memory saves n - 1 stores".
    expected = n * n - resident * (n - 1)
    assert (traffic.q_loads, traffic.o_loads, traffic.o_stores, traffic.kv_loads) == \
        (expected, expected, expected, n)
    if resident == n:  # "if all n outputs fit, each is stored once"
        assert traffic.o_stores == n


@pytest.mark.parametrize("query_block", [1, 2, 3, 7, 10])
def test_query_blocks_share_each_pass_over_kv(qkv, query_block):
    out, traffic = inner_product_attention(*qkv, query_block=query_block)
    np.testing.assert_allclose(out, _attention(*qkv), rtol=1e-12)
    assert traffic == HBMTraffic(q_loads=7, kv_loads=7 * math.ceil(7 / query_block), o_loads=7,
                                 o_stores=7)


def test_rectangular_and_large_scores():
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(3, 4)) * 30, rng.normal(size=(5, 4)), rng.normal(size=(5, 6))
    for schedule in (inner_product_attention, outer_product_attention):
        out, traffic = schedule(q, k, v)
        np.testing.assert_allclose(out, _attention(q, k, v), rtol=1e-10)
    assert traffic.kv_loads == 5 and traffic.o_stores == 15


def test_bad_arguments_are_named(qkv):
    with pytest.raises(ValueError, match="query_block must be >= 1"):
        inner_product_attention(*qkv, query_block=0)
    with pytest.raises(ValueError, match=r"resident must be in \[0, 7\]"):
        outer_product_attention(*qkv, resident=8)
    with pytest.raises(ValueError, match="need q"):
        inner_product_attention(np.ones((2, 3)), np.ones((2, 4)), np.ones((2, 1)))
