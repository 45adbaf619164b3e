"""flashkit.jax under transformations (jit, grad, vmap), input checks, and a randomised
differential test (hypothesis) of the vmap port and the Pallas kernels against the oracle."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flashkit.jax import flash_attention  # noqa: E402


def _inputs(shape_q, shape_k, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], shape_q, dtype), jax.random.normal(keys[1], shape_k, dtype),
            jax.random.normal(keys[2], shape_k, dtype))


@pytest.mark.parametrize("implementation", ["xla", "fori", "pallas"])
def test_jit_grad_vmap(implementation):
    """vmap over an extra leading axis == a Python loop; jit(grad) == grad; finite gradients."""
    q, k, v = _inputs((3, 2, 21, 4, 16), (3, 2, 18, 2, 16))
    f = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, block_q=16, block_k=16,
                                                implementation=implementation))
    batched = jax.jit(jax.vmap(f))(q, k, v)
    looped = jnp.stack([f(q[i], k[i], v[i]) for i in range(3)])
    np.testing.assert_allclose(batched, looped, rtol=1e-5, atol=1e-6)

    loss = lambda q, k, v: jnp.sum(jax.vmap(f)(q, k, v) ** 2)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    jit_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g, jg, x in zip(grads, jit_grads, (q, k, v), strict=True):
        assert g.shape == x.shape and np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(g, jg, rtol=1e-5, atol=1e-6)


def test_fori_and_vmap_ports_agree():
    """The TPU post's two ports differ only in the outer map: same tiles, sums and result."""
    q, k, v = _inputs((2, 70, 4, 32), (2, 45, 2, 32))
    f = {impl: jax.jit(lambda q, k, v, impl=impl: flash_attention(
        q, k, v, causal=True, implementation=impl, block_q=32, block_k=16))(q, k, v)
        for impl in ("xla", "fori")}
    np.testing.assert_allclose(f["xla"], f["fori"], rtol=1e-6, atol=1e-6)


BAD = [
    (dict(q=(2, 8, 4)), ValueError, "q: expected rank 4"),
    (dict(k=(3, 8, 2, 16)), ValueError, "batch must match"),
    (dict(k=(2, 8, 2, 32)), ValueError, "k: headdim 32"),
    (dict(v=(2, 9, 2, 16)), ValueError, "v: expected"),
    (dict(k=(2, 8, 3, 16), v=(2, 8, 3, 16)), ValueError, "multiple of nheads_k"),
    (dict(q=(2, 8, 4, 300), k=(2, 8, 2, 300), v=(2, 8, 2, 300)), ValueError, "q: headdim 300"),
    (dict(implementation="cuda"), ValueError, "implementation"),
    (dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(block_q=24, implementation="pallas"), ValueError, "block_q"),
    (dict(block_k=0), ValueError, "block_k"),
    (dict(v_dtype=jnp.float16), TypeError, "one dtype"),
    (dict(q_dtype=jnp.int32, k_dtype=jnp.int32, v_dtype=jnp.int32), TypeError, "q: expected float"),
]


@pytest.mark.parametrize("change,error,match", BAD)
def test_bad_inputs_name_the_argument(change, error, match):
    shapes = dict(q=(2, 8, 4, 16), k=(2, 8, 2, 16), v=(2, 8, 2, 16))
    arrays = {name: jnp.ones(change.pop(name, shape), change.pop(f"{name}_dtype", jnp.float32))
              for name, shape in list(shapes.items())}
    with pytest.raises(error, match=match):
        flash_attention(arrays["q"], arrays["k"], arrays["v"], **change)


def test_pallas_rejects_float64():
    with pytest.raises(TypeError, match="q: implementation='pallas'"):
        flash_attention(np.ones((1, 4, 1, 16)), np.ones((1, 4, 1, 16)), np.ones((1, 4, 1, 16)))


# `check` is a stateless function: sharing it across examples is safe.
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sq=st.integers(1, 70), sk=st.integers(1, 70), group=st.sampled_from([1, 2, 4]),
       d=st.sampled_from([8, 16, 24]), causal=st.booleans(),
       window=st.sampled_from([(-1, -1), (3, 0), (0, 5), (20, 17)]), seed=st.integers(0, 99))
def test_random_shapes_against_oracle(check, implementation, sq, sk, group, d, causal, window,
                                      seed):
    check(implementation, batch=1, seqlen_q=sq, seqlen_k=sk, nheads=group, nheads_k=1, d=d,
            causal=causal, window=window, block_q=16, block_k=16, seed=seed)
