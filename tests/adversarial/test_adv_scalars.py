"""Scalars out of range: a ValueError/TypeError naming the argument; a large but allowed scale
gives the float64 math's finite answer."""

import math

import pytest
import torch
from adversarial_support import BACKENDS, qkv, rejects

import flashkit
from flashkit.checks import MAX_SOFTMAX_SCALE


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kwargs, arg", [
    (dict(softmax_scale=0.0), "softmax_scale"), (dict(softmax_scale=-1.0), "softmax_scale"),
    (dict(softmax_scale=math.nan), "softmax_scale"),
    (dict(softmax_scale=math.inf), "softmax_scale"),
    (dict(softmax_scale=1e38), "softmax_scale"), (dict(softmax_scale="1"), "softmax_scale"),
    (dict(dropout_p=-0.1), "dropout_p"), (dict(dropout_p=1.0), "dropout_p"),
    (dict(dropout_p=math.nan), "dropout_p"), (dict(softcap=-1.0), "softcap"),
    (dict(softcap=math.inf), "softcap"), (dict(causal="yes"), "causal"),
    (dict(window_size=(-2, 0)), "window_size"), (dict(window_size=(1,)), "window_size"),
    (dict(window_size=(1.5, 2)), "window_size"), (dict(backend_name="cuda"), "backend"),
])
def test_bad_scalars(backend, kwargs, arg):
    q, k, v = qkv()
    kwargs = dict(kwargs)
    if "backend_name" in kwargs:
        backend = kwargs.pop("backend_name")
    rejects((ValueError, TypeError), arg,
            lambda: flashkit.flash_attn_func(q, k, v, **kwargs, backend=backend), q, k, v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_largest_scale_is_finite_and_exact(backend, dtype):
    q, k, v = qkv(dtype=dtype)
    out = flashkit.flash_attn_func(q, k, v, softmax_scale=MAX_SOFTMAX_SCALE, backend=backend)
    ref = flashkit.flash_attn_func(q.double(), k.double(), v.double(),
                                   softmax_scale=MAX_SOFTMAX_SCALE, backend="reference")
    assert torch.isfinite(out).all()
    # each row is one-hot on its largest score in both (ties have probability zero here)
    assert (out.double() - ref).abs().max() <= (2e-3 if dtype == torch.float16 else 1e-6)
