"""HBM IO model (the paper, Theorem 2): executed schedules agree with their closed forms."""

import math

import numpy as np
import pytest

from flashkit.sim.hbm import (
    IOCount,
    flash_attention_io,
    flash_attention_v1,
    flash_attention_v2,
    flash_block_sizes,
    format_io_sweep,
    format_sram_sweep,
    format_triton_configs,
    standard_attention,
    standard_attention_io,
    triton_forward_bytes,
    triton_forward_io,
)


def _reference(q, k, v, scale=1.0, causal=False):
    s = q @ k.T * scale
    if causal:  # bottom-right aligned: key j visible from query i iff j <= i + nk - nq
        i = np.arange(q.shape[0])[:, None] + (k.shape[0] - q.shape[0])
        s = np.where(np.arange(k.shape[0])[None, :] <= i, s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    seen = np.isfinite(m)
    p = np.exp(s - np.where(seen, m, 0.0))
    l = p.sum(axis=1, keepdims=True)
    out = np.where(seen, p @ v / np.where(seen, l, 1.0), 0.0)
    lse = np.where(seen[:, 0], (m + np.log(np.where(seen, l, 1.0)))[:, 0], -np.inf)
    return out, lse


def _qkv(nq, nk, d, dv=None, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(nq, d)), rng.normal(size=(nk, d)), rng.normal(size=(nk, dv or d))


@pytest.mark.parametrize("n, d", [(1, 1), (5, 3), (16, 8)])
def test_standard_attention_traffic_is_theta_nd_plus_n2(n, d):
    q, k, v = _qkv(n, n, d)
    out, io = standard_attention(q, k, v)
    np.testing.assert_allclose(out, _reference(q, k, v)[0], rtol=1e-12)
    assert io == standard_attention_io(n, d)
    # The paper, Algorithm 0: read Q, K, write S; read S, write P; read P, V, write O.
    assert io.elements == 4 * n * d + 4 * n * n


@pytest.mark.parametrize("n, d, sram, block_r, block_c", [
    (1, 4, 16, None, None), (10, 4, 16, None, None), (37, 8, 200, None, None),
    (20, 4, None, 3, 7), (20, 4, 64, 20, None),
])
def test_algorithm1_executed_matches_closed_form(n, d, sram, block_r, block_c):
    q, k, v = _qkv(n, n, d, seed=n)
    out, io = flash_attention_v1(q, k, v, sram, block_r, block_c)
    np.testing.assert_allclose(out, _reference(q, k, v)[0], rtol=1e-10)
    block_c = block_c or flash_block_sizes(d, sram)[1]
    assert io == flash_attention_io(n, d, sram, block_c)
    outer = math.ceil(n / block_c)
    assert io.reads["K"] == n * d and io.reads["Q"] == outer * n * d


def test_algorithm1_block_sizes():
    # The paper, Algorithm 1 step 1: B_c = ceil(M / 4d), B_r = min(ceil(M / 4d), d).
    assert flash_block_sizes(64, 98_304) == (64, 384)
    assert flash_block_sizes(64, 1_000) == (4, 4)
    with pytest.raises(ValueError, match="sram must hold at least one row of d = 64"):
        flash_block_sizes(64, 63)
    with pytest.raises(ValueError, match="give sram"):
        flash_attention_io(8, 4)


def test_theorem_2_scaling():
    d, sram = 64, 98_304
    for n in (1024, 4096, 16_384):
        assert standard_attention_io(n, d).elements / (n * d + n * n) == 4.0
        ratio = flash_attention_io(n, d, sram).elements / (n * n * d * d / sram)
        assert 12 <= ratio <= 19  # about 12 N^2 d^2 / M plus lower-order terms
    # Doubling the SRAM halves FlashAttention's traffic, to lower-order terms.
    small, large = (flash_attention_io(8192, d, m).elements for m in (32_768, 65_536))
    assert small / large == pytest.approx(2, rel=0.02)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq, nk, block_m, block_n", [
    (1, 1, 4, 4), (17, 17, 4, 8), (13, 29, 8, 4), (29, 13, 8, 8), (16, 16, 16, 16),
])
def test_triton_schedule_executed_matches_the_prediction(causal, nq, nk, block_m, block_n):
    q, k, v = _qkv(nq, nk, 8, dv=4, seed=nq * nk)
    out, lse, io = flash_attention_v2(q, k, v, block_m, block_n, causal)
    expected_out, expected_lse = _reference(q, k, v, 8 ** -0.5, causal)
    np.testing.assert_allclose(out, expected_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-10)
    assert io == triton_forward_io(nq, nk, 8, block_m, block_n, causal, head_dim_v=4)


def test_triton_schedule_causal_rows_without_keys_and_lse():
    q, k, v = _qkv(6, 3, 4)  # bottom-right aligned: queries 0..2 see no key
    out, lse, io = flash_attention_v2(q, k, v, 2, 2, causal=True)
    np.testing.assert_array_equal(out[:3], 0.0)
    np.testing.assert_array_equal(lse[:3], -np.inf)
    assert np.isfinite(lse[3:]).all()
    assert io.reads["K"] == (0 + 1 + 3) * 4  # the three query blocks see 0, 1 and 3 keys


def test_triton_prediction_counts_a_whole_pass_per_query_block():
    io = triton_forward_io(4096, 4096, 128, 128, 64, causal=False, batch=2, nheads=3)
    assert io.reads["K"] == 2 * 3 * 4096 * 128 * (4096 // 128)
    causal = triton_forward_io(4096, 4096, 128, 128, 64, causal=True)
    blocks = 4096 // 128
    assert causal.reads["K"] == 128 * 128 * blocks * (blocks + 1) // 2
    # bf16: Q, K, V, O at 2 bytes, lse at 4.
    assert causal.bytes(2) == 2 * (causal.elements - 4096) + 4 * 4096
    assert triton_forward_bytes(4096, 4096, 128, 128, 64, True, 2) == causal.bytes(2)


def test_tables_print():
    assert "standard / (Nd+N^2)" in format_io_sweep([256, 512], 32, 4096)
    assert "FA1 x M / (N^2 d^2)" in format_sram_sweep(1024, 32, [4096, 8192])
    text = format_triton_configs(1024, 64, [(64, 32), (128, 64)], causal=True)
    assert "K,V passes" in text and "128       64" in text


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="block_m must be >= 1"):
        triton_forward_io(8, 8, 4, 0, 4)
    with pytest.raises(ValueError, match="element_bytes must be >= 1"):
        IOCount().bytes(0)
    with pytest.raises(ValueError, match="need q"):
        flash_attention_v2(np.ones((2, 3)), np.ones((2, 2)), np.ones((2, 2)), 2, 2)
