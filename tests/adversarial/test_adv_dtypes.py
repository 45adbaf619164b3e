"""Dtypes: unsupported or mixed ones raise TypeError (NotImplementedError where a backend lacks a
supported dtype), naming the argument and the backend."""

import pytest
import torch
from adversarial_support import BACKENDS, DEVICE, qkv, randn, rejects

import flashkit


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arg", ["k", "v"])
def test_mixed_dtypes(backend, arg):
    q, k, v = qkv()
    given = {"q": q, "k": k, "v": v}
    given[arg] = given[arg].half()
    rejects(TypeError, arg, lambda: flashkit.flash_attn_func(**given, backend=backend),
            *given.values())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_non_float_dtypes(backend, dtype):
    q, k, v = (t.to(dtype) for t in qkv())
    rejects(TypeError, "q", lambda: flashkit.flash_attn_func(q, k, v, backend=backend), q, k, v)


def test_float64_on_triton_is_not_implemented():
    q, k, v = qkv(dtype=torch.float64)
    rejects(NotImplementedError, "triton.*float64",
            lambda: flashkit.flash_attn_func(q, k, v, backend="triton"), q, k, v)
    with torch.no_grad():
        kc, vc = randn(1, 16, 2, 16, dtype=torch.float64), randn(1, 16, 2, 16, dtype=torch.float64)
        rejects(NotImplementedError, "float64", lambda: flashkit.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=4, backend="triton"), q, kc, vc)


def test_float64_on_torch_runs():
    q, k, v = qkv(dtype=torch.float64)
    out = flashkit.flash_attn_func(q, k, v, backend="torch")
    ref = flashkit.flash_attn_func(q, k, v, backend="reference")
    assert (out - ref).abs().max() < 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_argument_dtypes(backend):
    q, k, v = qkv()
    slopes = torch.rand(2, device=DEVICE, dtype=torch.float64)
    rejects(TypeError, "alibi_slopes", lambda: flashkit.flash_attn_func(
        q, k, v, alibi_slopes=slopes, backend=backend), q, k, v, slopes)
    sink = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    rejects(TypeError, "sink", lambda: flashkit.flash_attn_func(q, k, v, sink=sink,
                                                                backend=backend), q, k, v)
    qp, kp, vp = randn(5, 2, 16), randn(7, 2, 16), randn(7, 2, 16)
    cu64 = torch.tensor([0, 5], dtype=torch.int64, device=DEVICE)
    cuk = torch.tensor([0, 7], dtype=torch.int32, device=DEVICE)
    rejects(TypeError, "cu_seqlens_q", lambda: flashkit.flash_attn_varlen_func(
        qp, kp, vp, cu64, cuk, 5, 7, backend=backend), qp, kp, vp, cu64, cuk)
