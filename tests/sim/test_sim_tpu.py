"""The TPU cycle model (the TPU post): real attention outputs, MXU/VPU cycles, the post's table."""

import math

import numpy as np
import pytest

from flashkit.sim.tpu import (
    TPUCycleSimulator,
    compare_attention,
    flash_attention,
    format_comparison,
    format_vpu_breakdown,
    standard_attention,
)


def _reference(q, k, v, causal):
    n, d = q.shape
    s = q @ k.T / math.sqrt(d)
    if causal:
        s = np.where(np.triu(np.ones((n, n), dtype=bool), k=1), -np.inf, s)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True) @ v


def test_seed_table_n512_d64():
    runs = compare_attention(n=512, d=64, blocks=(64, 128))
    # The TPU post, "What the emulator revealed" (block=64 | block=128 | standard):
    # Total 24,556 | 16,936 | 20,604; MXU 13,680 | 6,360 | 2,172; VPU 10,876 | 10,576 | 18,432;
    # MXU utilization 8.4% | 20.1% | 94.3%; vs standard 1.19x | 0.82x | 1.00x.
    assert [r.total_cycles for r in runs] == [24_556, 16_936, 20_604]
    assert [r.mxu_cycles for r in runs] == [13_680, 6_360, 2_172]
    assert [r.vpu_cycles for r in runs] == [10_876, 10_576, 18_432]
    assert [round(100 * r.mxu_utilisation, 1) for r in runs] == [8.4, 20.1, 94.3]
    table = format_comparison(runs)
    assert "vs standard         1.19x      0.82x     1.00x" in table
    assert "Total cycles       24,556     16,936    20,604" in table
    # Causal flash visits 10 of the 4 x 4 tiles ("skips 6 tiles out of 16"): 10 x 2 x 318 cycles.
    assert runs[1].mxu_cycles == 10 * 2 * (128 + 64 + 128 - 2)
    for run in runs:
        q, k, v = np.random.default_rng(0).normal(size=(3, 512, 64))
        np.testing.assert_allclose(run.output, _reference(q, k, v, True), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n, block_m, block_n", [(1, 4, 4), (37, 8, 16), (50, 16, 8)])
def test_flash_output_is_attention_for_any_tiling(causal, n, block_m, block_n):
    q, k, v = np.random.default_rng(n).normal(size=(3, n, 8)) * 2
    sim = TPUCycleSimulator()
    out = flash_attention(sim, q, k, v, block_m, block_n, causal)
    np.testing.assert_allclose(out, _reference(q, k, v, causal), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(standard_attention(TPUCycleSimulator(), q, k, v, causal),
                               _reference(q, k, v, causal), rtol=1e-9, atol=1e-12)
    q_blocks, k_blocks = math.ceil(n / block_m), math.ceil(n / block_n)
    visited = sum(1 for qb in range(q_blocks) for kb in range(k_blocks)
                  if not causal or kb * block_n <= min((qb + 1) * block_m, n) - 1)
    per_tile = (block_m + 8 + block_n - 2) + (block_m + block_n + 8 - 2)
    assert sim.mxu_cycles == visited * per_tile
    # Every tile here is at most 16 wide: all of them ran through the ticking systolic array.
    assert sim.ticked_matmuls == 2 * visited


def test_vpu_charges_whole_vectors_and_exp_twice():
    sim = TPUCycleSimulator()
    sim.vpu("add", 128)
    sim.vpu("add", 129)
    sim.vpu("exp", 1, cycles_per_vector=2)
    assert sim.vpu_cycles == 1 + 2 + 2 and sim.vpu_ledger == {"add": 3, "exp": 2}


def test_non_causal_standard_has_no_mask_passes():
    (flash, standard) = compare_attention(n=256, d=32, blocks=(128,), causal=False)
    assert standard.vpu_cycles == 7 * 256 * 256 // 128
    assert "apply mask" not in flash.vpu_ledger  # 256 is a whole number of tiles: no padding
    assert "MXU utilization" in format_comparison([flash, standard])
    assert "divide accumulator" in format_vpu_breakdown([flash, standard])


def test_bad_arguments_are_named():
    q = np.ones((4, 2))
    with pytest.raises(ValueError, match="q, k, v must all be"):
        standard_attention(TPUCycleSimulator(), q, np.ones((5, 2)), q)
    with pytest.raises(ValueError, match="block_m and block_n must be >= 1"):
        flash_attention(TPUCycleSimulator(), q, q, q, 0, 4)
    with pytest.raises(ValueError, match="at least one block size"):
        compare_attention(blocks=())
    with pytest.raises(ValueError, match="mxu_dim and vpu_width"):
        TPUCycleSimulator(mxu_dim=0)


def test_vmem_table_matches_the_write_up():
    from flashkit.sim.tpu import format_vmem_table, vmem_table
    rows = {n: (s, o, fits) for n, s, o, fits in vmem_table([512, 4096, 8192, 32768])}
    assert rows[512] == (1.0, 0.125, True)
    assert rows[4096][0] == 64.0 and rows[4096][2]
    assert rows[8192][0] == 256.0 and not rows[8192][2]
    assert rows[32768][:2] == (4096.0, 8.0)
    assert "fits up to n = 4096 and stops fitting at n = 8192" in format_vmem_table()
