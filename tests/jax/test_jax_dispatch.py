"""flashkit.jax's front door (flashkit.jax.dispatch): on the CPU it picks the portable
implementations and says why the Mosaic GPU kernels declined, logs its choices under
FLASHKIT_LOG_DISPATCH, and explicit implementations run what they name."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from flashkit.jax import dispatch, flash_attention  # noqa: E402
from flashkit.jax._checks import check_inputs  # noqa: E402

cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU choice")


def _problem(implementation="pallas", interpret=True, d=128, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct((1, 128, 2, d), dtype)
    cfg = check_inputs(q, q, q, causal=True, softmax_scale=None, window_size=(-1, -1),
                       implementation=implementation, block_q=None, block_k=None,
                       interpret=interpret)
    return q, cfg


@cpu_only
def test_cpu_runs_the_portable_kernels_and_says_why_mosaic_declined():
    q, cfg = _problem()  # interpret defaults to True on a CPU backend
    for choice in (dispatch.forward_choice, dispatch.backward_choice):
        ran, declined = choice(q, q, q, cfg)
        assert ran == "pallas_triton"
        (name, why), = declined
        assert name == "mosaic" and "interpret" in why
    q, cfg = _problem(interpret=False)  # compiled: the device is what declines
    ran, ((name, why),) = dispatch.forward_choice(q, q, q, cfg)
    assert ran == "pallas_triton" and why.startswith("not a Hopper GPU") and "cpu" in why


def test_declines_name_what_the_kernels_do_not_cover(monkeypatch):
    """As on a Hopper GPU (is_hopper patched): the reasons are the problem's."""
    from flashkit.jax import mosaic
    monkeypatch.setattr(mosaic, "is_hopper", lambda: True)
    q, cfg = _problem(interpret=False, dtype=jnp.float32)
    assert "dtype float32" in dispatch.forward_choice(q, q, q, cfg)[1][0][1]
    q, cfg = _problem(interpret=False, d=96)
    assert "head dims 96/96" in dispatch.backward_choice(q, q, q, cfg)[1][0][1]
    q, cfg = _problem(interpret=False)
    assert dispatch.forward_choice(q, q, q, cfg) == ("mosaic", ())
    assert dispatch.backward_choice(q, q, q, cfg) == ("mosaic", ())


@pytest.mark.parametrize("implementation,ran", [("pallas_triton", "pallas_triton"),
                                                ("xla", "xla"), ("fori", "fori")])
def test_named_implementations_run_without_declines(implementation, ran):
    q, cfg = _problem(implementation, dtype=jnp.float32)
    assert dispatch.forward_choice(q, q, q, cfg) == (ran, ())
    assert dispatch.backward_choice(q, q, q, cfg) == (ran, ())


@cpu_only
def test_pallas_mosaic_forward_raises_the_reason():
    q, cfg = _problem("pallas_mosaic")
    with pytest.raises(NotImplementedError, match=r"pallas_mosaic.*interpret"):
        dispatch.forward_choice(q, q, q, cfg)


@cpu_only
def test_log_names_the_implementation_and_the_declines(caplog):
    x = jnp.ones((1, 16, 1, 16), jnp.float32)
    with caplog.at_level(logging.DEBUG, logger="flashkit.dispatch"):
        jax.grad(lambda q: flash_attention(q, x, x, causal=True).sum())(x)
    messages = [r.getMessage() for r in caplog.records if r.name == "flashkit.dispatch"]
    assert messages[0].startswith("jax forward ran pallas_triton; declined: mosaic: ")
    assert any(m.startswith("jax backward ran pallas_triton; declined: mosaic: ")
               for m in messages)


@cpu_only
def test_environment_variable_turns_the_log_on():
    code = ("import jax.numpy as jnp; from flashkit.jax import flash_attention; "
            "x = jnp.ones((1, 8, 1, 16)); flash_attention(x, x, x, implementation='xla')")
    env = dict(os.environ, FLASHKIT_LOG_DISPATCH="1", PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    assert "jax forward ran xla; declined: nothing" in run.stderr
