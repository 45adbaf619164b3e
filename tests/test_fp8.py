"""float8 inputs through flashkit.flash_attn_func and the helpers of flashkit.fp8: quantize,
dequantize, the Hadamard rotation, the argument checks, and the torch / reference backends
(dequantised inputs) against the float64 oracle. The Triton kernel's own tests are in
tests/ops/test_triton_fp8.py."""

from __future__ import annotations

import pytest
import torch

import flashkit
from flashkit import fp8
from flashkit.ops.params import AttentionParams
from flashkit.reference import attention_with_params
from flashkit.testing import assert_close_to_oracle

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("per_head", [True, False])
def test_quantize_round_trip(dtype, per_head):
    x = torch.randn(2, 9, 3, 16) * torch.tensor([1.0, 10.0, 0.1])[:, None]
    before = x.clone()
    x8, descale = fp8.quantize(x, per_head=per_head, dtype=dtype)
    assert torch.equal(x, before)  # the input is left alone
    assert x8.dtype == dtype and descale.dtype == torch.float32
    assert descale.shape == ((2, 3) if per_head else (1,))
    amax = float(x8.float().abs().max())
    assert amax == torch.finfo(dtype).max  # the largest magnitude maps to the top of the format
    unit = 2.0 ** -(4 if dtype == E4M3 else 3)  # half an ulp: 3 (e4m3) or 2 (e5m2) mantissa bits
    back = fp8.dequantize(x8, descale)
    scale = descale[:, None, :, None] if per_head else descale
    # relative rounding, or absolute below the smallest normal (2^-6 / 2^-14) in scaled units
    tiny = torch.finfo(dtype).smallest_normal * scale
    assert ((back - x).abs() <= unit * x.abs() + tiny).all()


def test_quantize_zero_and_bad_input():
    x8, descale = fp8.quantize(torch.zeros(1, 4, 2, 8))
    assert torch.equal(descale, torch.ones(1, 2)) and (x8.float() == 0).all()
    with pytest.raises(ValueError, match="x:"):
        fp8.quantize(torch.randn(4, 8))
    with pytest.raises(ValueError, match="dtype"):
        fp8.quantize(torch.randn(1, 4, 2, 8), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="power-of-two"):
        fp8.quantize(torch.randn(1, 4, 2, 40), hadamard=True)


def test_hadamard_keeps_q_dot_k():
    h = fp8.hadamard_matrix(64, dtype=torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    q, k = torch.randn(5, 64, dtype=torch.float64), torch.randn(7, 64, dtype=torch.float64)
    assert torch.allclose((q @ h) @ (k @ h).T, q @ k.T, atol=1e-12)


def test_dequantize_per_kv_head_q_descale():
    """FA3's q_descale (batch, nheads_k) stands for each group of query heads."""
    x8 = torch.randn(2, 3, 4, 8).to(E4M3)
    descale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = fp8.dequantize(x8, descale)
    assert torch.equal(got[0, :, 1], x8[0, :, 1].float()) and torch.equal(
        got[1, :, 3], 4 * x8[1, :, 3].float())


def random_fp8(dtype=E4M3, shape_q=(2, 13, 4, 16), shape_kv=(2, 21, 2, 16)):
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(torch.randn(s), dtype=dtype)
                                    for s in (shape_q, shape_kv, shape_kv))
    return q8, k8, v8, dict(q_descale=qd, k_descale=kd, v_descale=vd)


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("causal", [False, True])
def test_dequantising_backends(backend, causal):
    """torch: the tiled backend in float32 on the dequantised inputs; reference: the oracle.
    Both return bf16 out; the baseline is the float32 computation rounded to bf16."""
    q8, k8, v8, descales = random_fp8()
    out, lse, probs = flashkit.flash_attn_func(q8, k8, v8, causal=causal, backend=backend,
                                               return_attn_probs=True, **descales)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    params = AttentionParams(softmax_scale=16 ** -0.5, window_right=0 if causal else None)
    wide = [fp8.dequantize(x, descales[f"{n}_descale"], torch.float64)
            for x, n in zip((q8, k8, v8), "qkv", strict=True)]
    oracle_out, oracle_lse, oracle_probs = attention_with_params(*wide, params,
                                                                 return_probs=True)
    base_out, base_lse = attention_with_params(*(x.float() for x in wide), params)
    assert_close_to_oracle("out", out, oracle_out, base_out.to(torch.bfloat16))
    assert_close_to_oracle("lse", lse, oracle_lse, base_lse)
    assert torch.allclose(probs.double(), oracle_probs, atol=1e-5)


def test_hadamard_lowers_error_on_outlier_channels():
    """The quantisation error alone (reference backend on the dequantised inputs) against the
    oracle on the unquantised ones: with 4 channels of q and k 10x the rest, the Hadamard
    rotation lowers the RMS error of the output (measured here: 0.145 -> 0.049, about 3x)."""
    scale = torch.ones(2, 64)
    scale[:, torch.randperm(64)[:4]] = 10.0
    q, k, v = (torch.randn(1, 64, 2, 64) for _ in range(3))
    q, k = q * scale, k * scale
    oracle = flashkit.flash_attn_func(q.double(), k.double(), v.double(), causal=True,
                                      backend="reference")
    rms = {}
    for hadamard in (False, True):
        (q8, qd), (k8, kd) = (fp8.quantize(x, hadamard=hadamard) for x in (q, k))
        v8, vd = fp8.quantize(v)
        out = flashkit.flash_attn_func(q8, k8, v8, causal=True, backend="reference",
                                       q_descale=qd, k_descale=kd, v_descale=vd)
        rms[hadamard] = float((out.double() - oracle).pow(2).mean().sqrt())
    assert rms[True] < 0.75 * rms[False], rms


def test_argument_checks():
    q8, k8, v8, descales = random_fp8()
    bf = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q_descale: descale factors apply to float8"):
        flashkit.flash_attn_func(bf, bf, bf, q_descale=torch.ones(1))
    with pytest.raises(TypeError, match="k_descale: expected a float32 tensor"):
        flashkit.flash_attn_func(q8, k8, v8, k_descale=torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"v_descale: expected shape \(1,\) or \(2, 2\)"):
        flashkit.flash_attn_func(q8, k8, v8, v_descale=torch.ones(2, 4))
    flashkit.flash_attn_func(q8, k8, v8, q_descale=torch.ones(2, 4))  # q: per query head too
    with pytest.raises(TypeError, match="k: dtype"):
        flashkit.flash_attn_func(q8, k8.view(torch.uint8).view(E5M2), v8)
    with pytest.raises(TypeError, match="q: dtype torch.float8_e4m3fn is not supported"):
        cu = torch.tensor([0, 13], dtype=torch.int32)
        flashkit.flash_attn_varlen_func(q8[0], k8[0, :13], v8[0, :13], cu, cu, 13, 13)


def test_forward_only():
    q8, k8, v8, descales = random_fp8()
    sink = torch.zeros(4, requires_grad=True)
    with pytest.raises(NotImplementedError, match="float8 inputs: backward is not implemented"):
        flashkit.flash_attn_func(q8, k8, v8, sink=sink, **descales)
    with torch.no_grad():
        flashkit.flash_attn_func(q8, k8, v8, sink=sink, **descales)
    with pytest.raises(NotImplementedError, match="dropout is not supported with float8"):
        flashkit.flash_attn_func(q8, k8, v8, dropout_p=0.1, **descales)


def test_tensor_core_accumulator_model():
    """The FP8 tensor cores' accumulator as the fp8 baseline models it: 13 explicit mantissa
    bits, truncated toward zero, after every 32 products."""
    one = torch.tensor([1.0 + 2.0 ** -13, 1.0 + 2.0 ** -14, -(1.0 + 2.0 ** -14), 0.0, 3.0],
                       dtype=torch.float64)
    assert fp8.accumulator_round(one).tolist() == [1.0 + 2.0 ** -13, 1.0, -1.0, 0.0, 3.0]
    # 2^14 + 1 needs 15 significant bits: inside one step of 32 the exact sum is truncated once
    a = torch.tensor([[2.0 ** 14, 1.0]], dtype=torch.float64)
    assert fp8.tensor_core_matmul(a, torch.ones(2, 1, dtype=torch.float64)).item() == 2.0 ** 14
    # 2^14 then 63 ones: the first step's 2^14 + 31 truncates to 2^14 + 30 (the ulp is 2 in
    # [2^14, 2^15)), the second adds 32 exactly: 2^14 + 62, not 2^14 + 63
    a = torch.cat([torch.tensor([[2.0 ** 14]]), torch.ones(1, 63)], 1).double()
    assert fp8.tensor_core_matmul(a, torch.ones(64, 1, dtype=torch.float64)).item() == (
        2.0 ** 14 + 62)
    small = torch.randint(-8, 8, (3, 5, 70)).double()  # sums below 2^14: exact
    other = torch.randint(-8, 8, (3, 70, 4)).double()
    assert torch.equal(fp8.tensor_core_matmul(small, other), small @ other)
