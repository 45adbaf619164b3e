"""The FP8 forward (flashkit.ops.triton.forward_fp8) against the float64 oracle on the
dequantised inputs (q8 * q_descale, ...).

The error bound: fp8 is not covered by the bf16 rule, so the baseline is the same materialised
computation with the roundings of the kernel on a Hopper GPU (flashkit.fp8.rounded_reference:
inputs in fp8, q8 . k8 and P8 . v8 summed in the FP8 tensor cores' accumulator of about 14
significant bits, P scaled and rounded to fp8, output in bf16), and the rule is flash-attn's
    max|kernel - oracle| <= 2 * max|baseline - oracle| + 1e-5.
out's baseline is dominated by P's rounding: unit roundoff 2^-4 (e4m3, 3 mantissa bits) or 2^-3
(e5m2, 2 bits) on each P, which averages down over the keys a row attends to. lse's is the
accumulator's truncation of the scores (a few 1e-4 at |s| of a few units). The measured bound per
head dim and format is printed by benchmarks/suites/fp8.py and kept in docs/fp8.md.

CPU (TRITON_INTERPRET=1): the interpreter runs fp8 dots (it upcasts), and flashkit routes its
fp8 casts through torch's rounding (ops/triton/interpreter.py), so the kernel itself runs at tiny
sizes here. The GPU tests (`gpu`) cover head dims 64/128/256 at real lengths.
"""

from __future__ import annotations

import pytest
import torch
from tests.ops.test_triton import DEVICE

from flashkit import fp8
from flashkit.ops.params import AttentionParams
from flashkit.ops.triton import forward_fp8
from flashkit.reference import attention_with_params
from flashkit.testing import assert_close_to_oracle, poison

FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)
FORMAT_IDS = ("e4m3", "e5m2")


def quantized(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, per_head=True,
              device=DEVICE):
    """Random fp8 q, k, v (batch, seqlen, heads, head_dim) and their descales."""
    shapes = ((batch, seqlen_q, nheads, head_dim), (batch, seqlen_k, nheads_k, head_dim),
              (batch, seqlen_k, nheads_k, head_dim))
    return [fp8.quantize(torch.randn(s, device=device), per_head=per_head, dtype=dtype)
            for s in shapes]


def check(qkv, params, out=None, lse=None, v=None):
    """Run the kernel (v: a different view of the same values, if given) and assert the rule
    for out and lse against the oracle on the dequantised inputs."""
    (q8, qd), (k8, kd), (v8, vd) = qkv
    got_out, got_lse = forward_fp8.attention_forward(q8, k8, v8 if v is None else v, params,
                                                     qd, kd, vd, out=out, lse=lse)
    assert got_out.dtype == torch.bfloat16 and got_lse.dtype == torch.float32
    wide = [fp8.dequantize(x, d, torch.float64) for x, d in qkv]
    oracle_out, oracle_lse = attention_with_params(*wide, params)
    base_out, base_lse = fp8.rounded_reference(q8, k8, v8, params, qd, kd, vd)
    assert_close_to_oracle("out", got_out, oracle_out, base_out)
    assert_close_to_oracle("lse", got_lse, oracle_lse, base_lse)
    return got_out, got_lse


def params_for(head_dim, causal=False, **kw):
    return AttentionParams(softmax_scale=head_dim ** -0.5, window_right=0 if causal else None,
                           **kw)


@pytest.mark.parametrize("dtype", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 37, 45, 4, 2, 40), (1, 1, 33, 2, 1, 64),
                                   (1, 50, 17, 2, 2, 16)],
                         ids=["gqa_awkward", "one_row_mqa", "sq_gt_sk_d16"])
def test_matches_oracle(dtype, causal, shape):
    qkv = quantized(*shape, dtype)
    batch, seqlen_q, _, nheads, _, head_dim = shape
    out = poison(torch.empty(batch, seqlen_q, nheads, head_dim, dtype=torch.bfloat16,
                             device=DEVICE))
    lse = poison(torch.empty(batch, nheads, seqlen_q, dtype=torch.float32, device=DEVICE))
    got_out, got_lse = check(qkv, params_for(head_dim, causal), out=out, lse=lse)
    assert got_out is out and got_lse is lse
    if causal and seqlen_q > shape[2]:  # rows that see no key: out 0, lse -inf, never NaN
        hidden = seqlen_q - shape[2]
        assert (out[:, :hidden] == 0).all() and torch.isneginf(lse[..., :hidden]).all()


@pytest.mark.parametrize("feature", ["softcap", "alibi", "sink", "window"])
def test_features_through_shared_helpers(feature):
    qkv = quantized(1, 29, 41, 4, 2, 32, torch.float8_e4m3fn)
    kw = {"softcap": dict(softcap=2.0),
          "alibi": dict(alibi_slopes=torch.rand(4, device=DEVICE) * 0.5),
          "sink": dict(sink=torch.randn(4, device=DEVICE)),
          "window": dict(window_left=9, window_right=3)}[feature]
    check(qkv, AttentionParams(softmax_scale=0.3, **kw))


def test_descale_shapes():
    """Per-tensor descales, and FA3's per-kv-head q_descale (batch, nheads_k) standing for
    each group of query heads."""
    dtype = torch.float8_e4m3fn
    check(quantized(2, 19, 23, 4, 2, 32, dtype, per_head=False), params_for(32, causal=True))
    (q8, qd), kk, vv = quantized(2, 19, 23, 4, 2, 32, dtype)
    q_descale = qd.reshape(2, 2, 2).amax(-1)  # one scale per kv head's group of query heads
    q8 = (fp8.dequantize(q8, qd) / q_descale.repeat_interleave(2, 1)[:, None, :, None]).to(dtype)
    check(((q8, q_descale), kk, vv), params_for(32))


@pytest.mark.parametrize("per_head", [True, False])
def test_quantize_key_major_writes_the_layout_the_kernel_reads(per_head):
    """quantize(v, key_major=True): the same values and descale as quantize(v), stored with the
    key axis contiguous, which the forward reads in place: the same out, bit for bit."""
    v = torch.randn(2, 35, 2, 32, device=DEVICE) * 3
    v8, vd = fp8.quantize(v, per_head=per_head, dtype=torch.float8_e5m2)
    vk, vkd = fp8.quantize(v, per_head=per_head, dtype=torch.float8_e5m2, key_major=True)
    assert vk.shape == v8.shape and vk.stride(1) == 1 and torch.equal(vkd, vd)
    assert torch.equal(vk.contiguous().view(torch.uint8), v8.view(torch.uint8))
    assert forward_fp8.key_major(vk) is vk
    qkv = (fp8.quantize(torch.randn(2, 21, 4, 32, device=DEVICE), dtype=torch.float8_e5m2),
           fp8.quantize(torch.randn(2, 35, 2, 32, device=DEVICE), dtype=torch.float8_e5m2),
           (v8, vd))
    out_a, _ = check(qkv, params_for(32, causal=True))
    out_b, _ = check(qkv, params_for(32, causal=True), v=vk)
    assert torch.equal(out_a, out_b)


def test_key_major_v_is_read_in_place():
    """A v whose key axis already has stride 1 is read as it is (no copy), with equal results."""
    qkv = quantized(1, 21, 35, 2, 2, 32, torch.float8_e5m2)
    v8 = qkv[2][0]
    v_kmajor = v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    assert forward_fp8.key_major(v_kmajor) is v_kmajor
    copy = forward_fp8.key_major(v8)
    assert copy.stride(1) == 1 and torch.equal(copy.view(torch.uint8), v8.view(torch.uint8))
    out_a, _ = check(qkv, params_for(32))
    out_b, _ = check(qkv, params_for(32), v=v_kmajor)
    assert torch.equal(out_a, out_b)


def test_eligible_names_what_is_missing():
    q8, _ = fp8.quantize(torch.randn(1, 8, 2, 32, device=DEVICE))
    params = params_for(32)
    assert forward_fp8.eligible(q8, q8, q8, params) is None
    assert "not float8" in forward_fp8.eligible(q8.float(), q8, q8, params)
    assert "dropout" in forward_fp8.eligible(q8, q8, q8, params_for(32, dropout_p=0.1))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    assert "varlen" in forward_fp8.eligible(q8, q8, q8, params_for(32, cu_seqlens_q=cu,
                                                                    cu_seqlens_k=cu))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("lengths", [(1023, 1024), (203, 1000), (1, 17), (2048, 2048)],
                         ids=["1023x1024", "203x1000", "1x17", "2048"])
def test_gpu_matches_oracle(dtype, causal, head_dim, lengths):
    seqlen_q, seqlen_k = lengths
    qkv = quantized(2, seqlen_q, seqlen_k, 8, 2, head_dim, dtype)
    out = poison(torch.empty(2, seqlen_q, 8, head_dim, dtype=torch.bfloat16, device=DEVICE))
    lse = poison(torch.empty(2, 8, seqlen_q, dtype=torch.float32, device=DEVICE))
    check(qkv, params_for(head_dim, causal), out=out, lse=lse)


@pytest.mark.gpu
@pytest.mark.parametrize("feature", ["softcap", "alibi", "sink", "window"])
def test_gpu_features(feature):
    qkv = quantized(2, 333, 517, 8, 4, 128, torch.float8_e4m3fn)
    kw = {"softcap": dict(softcap=15.0),
          "alibi": dict(alibi_slopes=torch.rand(2, 8, device=DEVICE) * 0.2),
          "sink": dict(sink=torch.randn(8, device=DEVICE)),
          "window": dict(window_left=100, window_right=20)}[feature]
    check(qkv, AttentionParams(softmax_scale=128 ** -0.5, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_hadamard_helps_outlier_channels(head_dim):
    """Outlier channels in q and k (as in LLM activations): rotating both by the Hadamard
    matrix before quantisation lowers the fp8 kernel's RMS error against the oracle on the
    original (unquantised) inputs."""
    errors = hadamard_errors(head_dim, torch.float8_e4m3fn)
    assert errors[True]["rms"] < errors[False]["rms"], errors


def outlier_qkv(batch, seqlen, nheads, head_dim, outlier=10.0, device=DEVICE):
    """q, k with 4 channels `outlier` times larger than the rest, v standard normal."""
    scale = torch.ones(nheads, head_dim, device=device)
    scale[:, torch.randperm(head_dim)[:4]] = outlier
    q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device=device) for _ in range(3))
    return q * scale, k * scale, v


def hadamard_errors(head_dim, dtype, seqlen=1024, causal=True):
    """{hadamard: {"max", "rms"}}: the fp8 kernel's out against the float64 oracle on the
    unquantised inputs, largest and root-mean-square error."""
    q, k, v = outlier_qkv(2, seqlen, 4, head_dim)
    params = params_for(head_dim, causal)
    oracle, _ = attention_with_params(q.double(), k.double(), v.double(), params)
    errors = {}
    for hadamard in (False, True):
        q8, qd = fp8.quantize(q, hadamard=hadamard, dtype=dtype)
        k8, kd = fp8.quantize(k, hadamard=hadamard, dtype=dtype)
        v8, vd = fp8.quantize(v, dtype=dtype)
        out, _ = forward_fp8.attention_forward(q8, k8, v8, params, qd, kd, vd)
        diff = out.double() - oracle
        errors[hadamard] = {"max": float(diff.abs().max()), "rms": float(diff.pow(2).mean().sqrt())}
    return errors


@pytest.mark.parametrize("dtype", FORMATS, ids=FORMAT_IDS)
def test_tensor_core_scores_are_the_per_head_products(dtype):
    """The testing baseline's scores (forward_fp8.tensor_core_scores): q8 . k8 per query head,
    GQA heads mapped as the kernel maps them, odd lengths and head dim masked. The FP8 tensor
    cores keep about 14 significant bits per 32 products, so each score is within 2^-10 of the
    sum of its products' magnitudes (the interpreter sums exactly)."""
    (q8, _), (k8, _), _ = quantized(2, 19, 37, 4, 2, 40, dtype, per_head=False)
    got = forward_fp8.tensor_core_scores(q8, k8)
    q, k = q8.double(), k8.double().repeat_interleave(2, dim=2)
    exact = torch.einsum("bqhd,bkhd->bhqk", q, k)
    magnitude = torch.einsum("bqhd,bkhd->bhqk", q.abs(), k.abs())
    assert got.shape == exact.shape and got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= 2.0 ** -10 * magnitude + 1e-6).all()
