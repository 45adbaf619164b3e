"""The JAX/TPU write-up's baselines: every one computes causal attention, and the table sets the
write-up's ratios beside ours."""

import pytest

pytest.importorskip("jax")

from flashkit.experiments import jax_baselines  # noqa: E402


def test_every_baseline_is_causal_attention():
    measured = jax_baselines.measure([64], d=16, rounds=1)
    assert set(measured["max_error_at_smallest_n"]) == set(jax_baselines.METHODS)
    assert max(measured["max_error_at_smallest_n"].values()) < 1e-5
    assert all(ms > 0 for ms in measured["ms"][64].values())


def test_table_puts_the_tpu_ratio_beside_ours():
    ms = {4096: {"nojit": 2.0, "unfused": 1.0, "fused": 0.5, "fori": 4.0, "vmap": 0.25}}
    header, [row] = jax_baselines.table(ms)
    cells = dict(zip(header, row, strict=True))
    assert cells["unfused/fused TPU / ours"] == "14.4x / 2.0x"  # 1.038 / 0.072 on the TPU
    assert cells["fori/vmap TPU / ours"] == "14.1x / 16.0x"
