"""The Gluon backward (flashkit.ops.triton.backward_hopper): which calls take it, and its gradients
against the float64 oracle (docs/design.md section 5) through the public backend (dQ from its
own kernel, bitwise reproducible), plain and with its features (windows, seqlen_q != seqlen_k,
sink, ALiBi, softcap, dropout: the oracle drops what the Triton kernels' keep-mask helper drops),
dense and varlen (packed sequences
of any length, each checked as its own dense problem by the oracle)."""

from __future__ import annotations

import dataclasses
import importlib
import itertools

import pytest
import torch
from tests.ops.test_triton import DEVICE, check_against_oracle, make_inputs

from flashkit.ops import triton as triton_backend
from flashkit.ops.params import AttentionParams
from flashkit.ops.triton import ahead
from flashkit.ops.triton.configs import GLUON_BACKWARD_DKDV, GLUON_BACKWARD_DQ
from flashkit.ops.triton.forward_hopper import HEAD_DIMS
from flashkit.reference import attention_with_params
from flashkit.testing import (
    GRAD_FACTOR,
    assert_close_to_oracle,
    dropout_keep_mask,
    factor_for,
    poison,
)

hopper = importlib.import_module("flashkit.ops.triton.backward_hopper")
backward = importlib.import_module("flashkit.ops.triton.backward")
dispatch = importlib.import_module("flashkit.ops.triton.dispatch")


def _on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _eligible(q, k, v, params, tiles=None):
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    return hopper.eligible(q, k, v, torch.empty_like(q), lse, params, torch.empty_like(q),
                           torch.empty_like(k), torch.empty_like(v), tiles)


def test_taken_on_hopper_with_features():
    q, k, v, _ = make_inputs(1, 128, 128, 4, 2, 64, 64, torch.float16)
    plain = AttentionParams(0.125, None, 0)
    on_hopper = DEVICE == "cuda" and _on_hopper()
    assert _eligible(q, k, v, plain) == on_hopper
    assert not _eligible(q, k, v, plain, tiles={"dkdv": (32, 32, 4, 1)})  # Triton tile sweep
    for params in (AttentionParams(0.125, 7, 0), AttentionParams(0.125, 5, 3),
                   AttentionParams(0.125, None, 0, softcap=5.0),
                   AttentionParams(0.125, None, None, alibi_slopes=torch.rand(4, device=DEVICE)),
                   AttentionParams(0.125, None, 0, sink=torch.zeros(4, device=DEVICE)),
                   AttentionParams(0.125, None, 0, dropout_p=0.1)):
        assert _eligible(q, k, v, params) == on_hopper
    q_odd, k_odd, v_odd, _ = make_inputs(1, 100, 100, 2, 2, 64, 64, torch.float16)
    assert not _eligible(q_odd, k_odd, v_odd, plain)
    q_short, k_long, v_long, _ = make_inputs(1, 128, 256, 2, 2, 64, 64, torch.float16)
    assert _eligible(q_short, k_long, v_long, plain) == on_hopper
    q80, k80, v80, _ = make_inputs(1, 128, 128, 2, 2, 80, 80, torch.float16)
    assert not _eligible(q80, k80, v80, plain)


CASES = [  # (dtype, head_dim, seqlen, nheads, nheads_k, causal)
    (torch.bfloat16, 128, 64, 2, 2, True), (torch.bfloat16, 128, 1088, 4, 1, True),
    (torch.float16, 128, 640, 4, 4, False), (torch.bfloat16, 64, 128, 3, 3, True),
    (torch.float16, 64, 1152, 4, 2, True), (torch.bfloat16, 64, 384, 2, 2, False),
    (torch.float16, 128, 256, 8, 2, False), (torch.bfloat16, 256, 1088, 4, 1, True),
    (torch.float16, 256, 640, 4, 4, False),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("path", ["default", "deterministic"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_gluon_backward_matches_oracle(case, path):
    """The Gluon dK/dV and dQ kernels, deterministic=False and True alike."""
    deterministic = path == "deterministic"
    dtype, head_dim, seqlen, nheads, nheads_k, causal = case
    q, k, v, dout = make_inputs(2, seqlen, seqlen, nheads, nheads_k, head_dim, head_dim, dtype,
                                "cuda")
    params = AttentionParams(head_dim ** -0.5, None, 0 if causal else None,
                             deterministic=deterministic)
    assert _eligible(q, k, v, params)
    check_against_oracle(q, k, v, dout, params)  # poisoned out, lse, dq, dk, dv


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_gluon_backward_deterministic_is_bitwise_reproducible(head_dim):
    """Repeated backward calls give the same bits (dQ is summed by one program per tile)."""
    q, k, v, dout = make_inputs(2, 1024, 1024, 8, 2, head_dim, head_dim, torch.bfloat16, "cuda")
    params = AttentionParams(head_dim ** -0.5, None, 0, deterministic=True)
    out, lse = triton_backend.forward(q, k, v, params)
    first = triton_backend.backward(dout, q, k, v, out, lse, params)[:3]
    for _ in range(3):
        again = triton_backend.backward(dout, q, k, v, out, lse, params)[:3]
        for name, a, b in zip(("dq", "dk", "dv"), first, again, strict=True):
            assert torch.equal(a, b), name


FEATURE_CASES = [  # (dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_k, params keywords)
    (torch.bfloat16, 128, 384, 384, 4, 2, dict(window_left=100, window_right=30)),
    (torch.float16, 64, 256, 640, 2, 2, dict(window_right=0)),  # causal, bottom-right
    (torch.bfloat16, 64, 640, 256, 4, 1, dict(window_right=0)),  # rows without keys
    (torch.float16, 128, 512, 256, 2, 2, dict(window_left=70, window_right=-40)),
    (torch.float16, 64, 384, 384, 2, 2, dict(window_left=64)),
    (torch.bfloat16, 128, 256, 512, 4, 4, dict()),
    (torch.bfloat16, 128, 384, 384, 4, 2, dict(window_right=0, alibi=True)),
    (torch.float16, 64, 256, 384, 4, 4, dict(alibi=True)),
    (torch.bfloat16, 64, 384, 384, 4, 2, dict(window_right=0, softcap=2.0)),
    (torch.float16, 128, 256, 256, 2, 2, dict(softcap=5.0)),
    (torch.bfloat16, 128, 640, 256, 4, 2, dict(window_right=0, sink=True)),
    (torch.float16, 64, 384, 384, 2, 1, dict(window_left=50, window_right=0, sink=True,
                                             alibi=True, softcap=3.0)),
    (torch.bfloat16, 256, 384, 384, 4, 2, dict(window_left=100, window_right=30, alibi=True)),
    (torch.float16, 256, 640, 256, 4, 2, dict(window_right=0, sink=True)),
    (torch.bfloat16, 256, 256, 384, 2, 2, dict(softcap=5.0)),
]


def _feature_params(nheads, head_dim, deterministic, window_left=None, window_right=None,
                    alibi=False, softcap=0.0, sink=False):
    return AttentionParams(
        head_dim ** -0.5, window_left, window_right, softcap=softcap,
        alibi_slopes=torch.rand(2, nheads, device="cuda") * 0.3 if alibi else None,
        sink=torch.randn(nheads, device="cuda") + 1.0 if sink else None,
        deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", FEATURE_CASES, ids=str)
def test_gpu_gluon_backward_features_match_oracle(case):
    """Each feature flag of both Gluon kernels (and dsink, which backward.py reduces from lse
    and delta) against the oracle, into NaN-poisoned buffers."""
    dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_k, features = case
    q, k, v, dout = make_inputs(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim,
                                dtype, "cuda")
    params = _feature_params(nheads, head_dim, False, **features)
    assert _eligible(q, k, v, params)
    _, _, grads = check_against_oracle(q, k, v, dout, params)
    if params.sink is not None:
        dsinks = []
        for t in (torch.float64, dtype):
            leaves = [x.detach().to(t).requires_grad_() for x in (q, k, v, params.sink)]
            out, _ = attention_with_params(*leaves[:3], dataclasses.replace(params,
                                                                            sink=leaves[3]))
            dsinks.append(torch.autograd.grad(out, leaves[3], dout.to(t))[0])
        assert_close_to_oracle("dsink", grads[3], *dsinks, factor=GRAD_FACTOR)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
def test_gpu_gluon_backward_features_deterministic_is_bitwise_reproducible():
    q, k, v, dout = make_inputs(2, 512, 768, 4, 2, 128, 128, torch.bfloat16, "cuda")
    params = _feature_params(4, 128, True, window_left=200, window_right=0, alibi=True,
                             softcap=4.0, sink=True)
    out, lse = triton_backend.forward(q, k, v, params)
    first = triton_backend.backward(dout, q, k, v, out, lse, params)
    again = triton_backend.backward(dout, q, k, v, out, lse, params)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), first, again, strict=True):
        assert torch.equal(a, b), name


DROPOUT_CASES = [  # (dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_k, window_right, seed)
    (torch.bfloat16, 128, 384, 384, 4, 2, 0, 2**40 + 7),
    (torch.float16, 128, 256, 512, 2, 2, None, 12345),
    (torch.float16, 64, 384, 256, 4, 1, 0, 2**61 + 3),  # rows without keys
    (torch.bfloat16, 64, 256, 384, 2, 2, None, 99),
    (torch.bfloat16, 256, 384, 256, 4, 1, 0, 2**50 + 1),
]


def _check_dropout(q, k, v, dout, params):
    """Gluon forward + backward into NaN-poisoned buffers against the oracle fed the Triton
    kernels' keep-mask (section 5's rule for out, lse and each gradient); returns the grads."""
    batch, seqlen_q, nheads, _ = q.shape
    out = poison(torch.empty_like(q))
    lse = poison(torch.empty(batch, nheads, seqlen_q, dtype=torch.float32, device=q.device))
    out, lse = triton_backend.forward(q, k, v, params, out=out, lse=lse)
    grads = triton_backend.backward(dout, q, k, v, out, lse, params,
                                    dq=poison(torch.empty_like(q)),
                                    dk=poison(torch.empty_like(k)),
                                    dv=poison(torch.empty_like(v)))
    mask = dropout_keep_mask(params.dropout_seed, batch, nheads, seqlen_q, k.shape[1],
                             params.dropout_p, backend="triton", device=q.device)
    results = []
    for t in (torch.float64, q.dtype):
        inputs = (q, k, v) if params.sink is None else (q, k, v, params.sink)
        leaves = [x.detach().to(t).requires_grad_() for x in inputs]
        ref_out, ref_lse = attention_with_params(
            *leaves[:3], dataclasses.replace(params, sink=None if len(leaves) == 3
                                             else leaves[3]), mask)
        results.append((ref_out, ref_lse, *torch.autograd.grad(ref_out, leaves, dout.to(t))))
    got = (out, lse, *grads[:3]) if params.sink is None else (out, lse, *grads)
    names = ("out", "lse", "dq", "dk", "dv", "dsink")[:len(got)]
    for name, tensor, want, base in zip(names, got, *results, strict=True):
        assert_close_to_oracle(name, tensor, want, base, factor=factor_for(name))
    return grads[:3]


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=str)
def test_gpu_gluon_backward_dropout_matches_oracle(case):
    """Both Gluon kernels regenerate the forward's keep-mask (the dK/dV kernel transposed)."""
    dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_k, window_right, seed = case
    q, k, v, dout = make_inputs(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim,
                                dtype, "cuda")
    params = AttentionParams(head_dim ** -0.5, None, window_right, dropout_p=0.17,
                             dropout_seed=seed)
    assert _eligible(q, k, v, params)
    _check_dropout(q, k, v, dout, params)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dropout_p", [0.6, 0.999], ids=str)
def test_gpu_gluon_backward_dropout_high_thresholds(dropout_p):
    """Thresholds from 128 (dropout.bytes_ge's and-form) and 256 (p rounds to 1: nothing
    kept) in both kernels, causal d128 and full d64."""
    for head_dim, window_right in ((128, 0), (64, None)):
        q, k, v, dout = make_inputs(1, 256, 384, 2, 1, head_dim, head_dim, torch.bfloat16,
                                    "cuda")
        params = AttentionParams(head_dim ** -0.5, None, window_right, dropout_p=dropout_p,
                                 dropout_seed=2**35 + 1)
        assert _eligible(q, k, v, params)
        _check_dropout(q, k, v, dout, params)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", [  # (head_dim, seqlen_q, seqlen_k, window_left, window_right)
    (128, 448, 320, 100, 0), (64, 192, 320, None, None), (128, 256, 448, 130, 60)], ids=str)
def test_gpu_gluon_backward_dropout_key_walks(case):
    """The dQ kernel's 64-key tiles hand the unused half of each Philox call to the next tile
    (dropout_gluon.keep_half_tiles): walks that start on a chunk's second half (left windows),
    cross from masked to visible tiles and back, and end on a half chunk (seqlen_k 320, 448);
    d64 (dK/dV tiles of 128 queries) runs them as varlen (dense_as_varlen)."""
    head_dim, seqlen_q, seqlen_k, window_left, window_right = case
    q, k, v, dout = make_inputs(2, seqlen_q, seqlen_k, 4, 2, head_dim, head_dim, torch.bfloat16,
                                "cuda")
    params = AttentionParams(head_dim ** -0.5, window_left, window_right, dropout_p=0.2,
                             dropout_seed=2**45 + 11)
    lse = torch.empty(2, 4, seqlen_q, device="cuda")
    assert (_eligible(q, k, v, params) if head_dim == 128 else
            hopper.dense_as_varlen(q, k, v, dout, lse, params, q, k, v, None))
    _check_dropout(q, k, v, dout, params)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
def test_gpu_gluon_backward_dropout_with_features_deterministic():
    """Dropout beside a window, ALiBi, softcap and sink; deterministic=True gives the same bits
    every run."""
    q, k, v, dout = make_inputs(2, 384, 512, 4, 2, 128, 128, torch.bfloat16, "cuda")
    params = dataclasses.replace(
        _feature_params(4, 128, True, window_left=150, window_right=0, alibi=True, softcap=4.0,
                        sink=True), dropout_p=0.1, dropout_seed=2**33 + 5)
    assert _eligible(q, k, v, params)
    out, lse = triton_backend.forward(q, k, v, params)
    first = triton_backend.backward(dout, q, k, v, out, lse, params)
    again = triton_backend.backward(dout, q, k, v, out, lse, params)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), first, again, strict=True):
        assert torch.equal(a, b), name
    _check_dropout(q, k, v, dout, params)


# ---- varlen: packed sequences through both Gluon kernels ---------------------------------------

def _cu_seqlens(lengths, device):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _varlen_case(lengths_q, lengths_k, nheads, nheads_k, head_dim, dtype, device=DEVICE,
                 **features):
    """Packed q (total_q, nheads, d), k/v (total_k, nheads_k, d), dout, and their params:
    features as _feature_params (ALiBi slopes per sequence and head), plus dropout_p /
    dropout_seed / deterministic."""
    q = torch.randn(sum(lengths_q), nheads, head_dim, dtype=dtype, device=device)
    k, v = (torch.randn(sum(lengths_k), nheads_k, head_dim, dtype=dtype, device=device)
            for _ in range(2))
    dout = torch.randn_like(q)
    alibi = features.pop("alibi", False)
    sink = features.pop("sink", False)
    params = AttentionParams(
        head_dim ** -0.5, features.pop("window_left", None), features.pop("window_right", None),
        alibi_slopes=(torch.rand(len(lengths_q), nheads, device=device) * 0.3
                      if alibi == "batch" else torch.rand(nheads, device=device) * 0.3
                      if alibi else None),
        sink=torch.randn(nheads, device=device) + 1.0 if sink else None,
        cu_seqlens_q=_cu_seqlens(lengths_q, device), cu_seqlens_k=_cu_seqlens(lengths_k, device),
        max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), **features)
    return q, k, v, dout, params


def test_varlen_taken_on_hopper():
    """Varlen takes the Gluon kernels at any lengths on sm_90 (tokens on both sides)."""
    on_hopper = DEVICE == "cuda" and _on_hopper()
    for lengths_q, lengths_k in (([5, 0, 130], [7, 1, 64]), ([64, 64], [64, 64])):
        q, k, v, dout, params = _varlen_case(lengths_q, lengths_k, 4, 2, 64, torch.float16,
                                             window_right=0, softcap=3.0)
        lse = torch.empty(4, q.shape[0], dtype=torch.float32, device=q.device)
        args = (dout, lse, params, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        assert hopper.eligible(q, k, v, *args, None) == on_hopper
        assert not hopper.eligible(q, k, v, *args, {"dkdv": (32, 32, 4, 1)})
    q, k, v, dout, params = _varlen_case([0, 0], [3, 4], 2, 2, 64, torch.float16)
    lse = torch.empty(2, 0, dtype=torch.float32, device=q.device)
    assert not hopper.eligible(q, k, v, dout, lse, params, q, k, v, None)  # no query token


GLUON_LAUNCHES = ["attention_backward_dq", "attention_backward_dkdv"]  # one backward's, in order


def _spy_gluon(monkeypatch) -> list:
    """Record every launch of the Gluon backward kernels (backward.py calls them through the
    module), so a test knows they, not the Triton kernels, computed the gradients."""
    calls = []

    def spy(name, launch):
        def launch_and_record(*args, **kwargs):
            if not ahead.active():  # not a first call compiling its kernels ahead
                calls.append(name)
            return launch(*args, **kwargs)
        return launch_and_record

    for name in ("attention_backward_dkdv", "attention_backward_dq"):
        monkeypatch.setattr(hopper, name, spy(name, getattr(hopper, name)))
    return calls


def _check_varlen(q, k, v, dout, params, monkeypatch):
    """Forward + the Gluon backward into NaN-poisoned buffers against the float64 oracle, which
    computes each packed sequence as its own dense problem (reference.attention_with_params),
    fed the kernels' keep-mask under dropout: section 5's rule for out, lse, dq, dk, dv and
    dsink. Returns (dq, dk, dv, dsink)."""
    nheads = q.shape[1]
    calls = _spy_gluon(monkeypatch)
    out = poison(torch.empty_like(q))
    lse = poison(torch.empty(nheads, q.shape[0], dtype=torch.float32, device=q.device))
    out, lse = triton_backend.forward(q, k, v, params, out=out, lse=lse)
    grads = triton_backend.backward(dout, q, k, v, out, lse, params,
                                    dq=poison(torch.empty_like(q)),
                                    dk=poison(torch.empty_like(k)),
                                    dv=poison(torch.empty_like(v)))
    assert calls == GLUON_LAUNCHES
    mask = None
    if params.dropout_p > 0:
        mask = dropout_keep_mask(params.dropout_seed, params.cu_seqlens_q.numel() - 1, nheads,
                                 params.max_seqlen_q, params.max_seqlen_k, params.dropout_p,
                                 backend="triton", device=q.device)
    results = []
    for t in (torch.float64, q.dtype):
        leaves = [x.detach().to(t).requires_grad_() for x in (q, k, v)]
        ref_params = params
        if params.sink is not None:
            leaves.append(params.sink.detach().to(t).requires_grad_())
            ref_params = dataclasses.replace(params, sink=leaves[3])
        ref_out, ref_lse = attention_with_params(*leaves[:3], ref_params, mask)
        results.append((ref_out, ref_lse, *torch.autograd.grad(ref_out, leaves, dout.to(t))))
    names = ("out", "lse", "dq", "dk", "dv", "dsink")
    got = (out, lse, *grads) if params.sink is not None else (out, lse, *grads[:3])
    for name, value, want, base in zip(names, got, *results, strict=False):
        assert_close_to_oracle(name, value, want, base, factor=factor_for(name))
    return grads


# Lengths 0 and 1 inside one batch, seqlen_q != seqlen_k both ways, lengths off every tile
# (1, 3, 17, 113, 203, 1000, 1023) beside whole tiles (64, 1024).
LENGTHS_Q = [1000, 1, 0, 203, 17, 64, 3, 1024, 113]
LENGTHS_K = [1023, 1, 5, 0, 17, 300, 64, 1024, 40]
VARLEN_CASES = [  # (dtype, head_dim, nheads, nheads_k, features)
    (torch.bfloat16, 128, 4, 2, dict()),
    (torch.float16, 64, 4, 1, dict(window_right=0)),
    (torch.bfloat16, 64, 2, 2, dict(window_left=100, window_right=30)),
    (torch.float16, 128, 4, 4, dict(window_left=70, window_right=-40)),
    (torch.bfloat16, 128, 4, 2, dict(window_right=0, alibi="batch")),
    (torch.float16, 64, 4, 2, dict(alibi=True)),
    (torch.bfloat16, 64, 4, 2, dict(window_right=0, softcap=2.0)),
    (torch.float16, 128, 2, 2, dict(softcap=5.0, sink=True)),
    (torch.bfloat16, 128, 4, 1, dict(window_right=0, sink=True)),
    (torch.bfloat16, 128, 4, 2, dict(dropout_p=0.17, dropout_seed=2**40 + 7, window_right=0)),
    (torch.float16, 64, 2, 2, dict(dropout_p=0.17, dropout_seed=12345, alibi="batch")),
    (torch.float16, 64, 4, 2, dict(window_left=50, window_right=0, sink=True, alibi=True,
                                   softcap=3.0, dropout_p=0.1, dropout_seed=2**61 + 3)),
    (torch.bfloat16, 256, 4, 2, dict(window_right=0, sink=True, softcap=3.0)),
    (torch.float16, 256, 2, 2, dict(dropout_p=0.17, dropout_seed=99, alibi="batch")),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
def test_gpu_gluon_backward_varlen_matches_oracle(case, monkeypatch):
    """Each feature (and pairs) of both Gluon kernels on packed sequences: tiles that run past a
    sequence's end read the next one's rows, which must weigh exactly 0 and never be stored."""
    dtype, head_dim, nheads, nheads_k, features = case
    q, k, v, dout, params = _varlen_case(LENGTHS_Q, LENGTHS_K, nheads, nheads_k, head_dim,
                                         dtype, "cuda", **features)
    _check_varlen(q, k, v, dout, params, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_gluon_backward_varlen_equal_lengths_equal_dense(head_dim, monkeypatch):
    """Equal lengths of whole tiles: the packed backward gives bitwise the dense backward's
    dq, dk, dv from the same out and lse (dsink: the same sum in another order)."""
    batch, seqlen, nheads = 3, 512, 4
    q, k, v, dout, params = _varlen_case([seqlen] * batch, [seqlen] * batch, nheads, 2,
                                         head_dim, torch.bfloat16, "cuda", window_right=0,
                                         alibi="batch", sink=True)
    out, lse = triton_backend.forward(q, k, v, params)
    calls = _spy_gluon(monkeypatch)
    packed = triton_backend.backward(dout, q, k, v, out, lse, params)
    dense_params = dataclasses.replace(params, cu_seqlens_q=None, cu_seqlens_k=None)
    dense = [x.view(batch, seqlen, *x.shape[1:]) for x in (q, k, v, dout, out)]
    lse_dense = lse.view(nheads, batch, seqlen).transpose(0, 1).contiguous()
    grads = triton_backend.backward(dense[3], *dense[:3], dense[4], lse_dense, dense_params)
    assert calls == GLUON_LAUNCHES * 2
    for name, a, b in zip(("dq", "dk", "dv"), packed, grads, strict=False):
        assert torch.equal(a, b.view(a.shape)), name
    torch.testing.assert_close(packed[3], grads[3], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
def test_gpu_gluon_backward_varlen_deterministic_is_bitwise_reproducible(monkeypatch):
    q, k, v, dout, params = _varlen_case(
        LENGTHS_Q, LENGTHS_K, 4, 2, 128, torch.bfloat16, "cuda", window_left=200,
        window_right=0, alibi=True, softcap=4.0, sink=True, dropout_p=0.1,
        dropout_seed=2**33 + 5, deterministic=True)
    calls = _spy_gluon(monkeypatch)
    out, lse = triton_backend.forward(q, k, v, params)
    first = triton_backend.backward(dout, q, k, v, out, lse, params)
    again = triton_backend.backward(dout, q, k, v, out, lse, params)
    assert len(calls) == 4
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), first, again, strict=True):
        assert torch.equal(a, b), name


def test_every_head_dim_has_both_gluon_tiles():
    """Each head dim the Gluon kernels take has a dQ and a dK/dV tile (head dim 256's dK/dV in
    two warpgroups), and dense lengths run as dense only on whole tiles of both."""
    assert set(GLUON_BACKWARD_DQ) == set(GLUON_BACKWARD_DKDV) == set(HEAD_DIMS)
    assert GLUON_BACKWARD_DKDV[256][2] == 8
    assert hopper._whole_tiles(torch.empty(1, 192, 1, 256), torch.empty(1, 64, 1, 256))
    assert not hopper._whole_tiles(torch.empty(1, 160, 1, 256), torch.empty(1, 64, 1, 256))


@pytest.mark.parametrize("planned", [False, True])
def test_varlen_lse_delta_copies_start_every_sequence_aligned(planned, monkeypatch):
    """The dK/dV kernel's TMA boxes of lse / delta must start on 16 bytes: the aligned copies put
    sequence b at _aligned_row (a multiple of 4 rows), in order, the gaps zero, written by the
    one launch into a NaN-poisoned allocation (interpreter); through a plan's prepared launch,
    twice, too."""
    lengths = [5, 0, 1, 130, 7, 64]
    _, _, _, _, params = _varlen_case(lengths, lengths, 2, 2, 16, torch.float32)
    lse, delta = (torch.randn(2, sum(lengths), device=DEVICE) for _ in range(2))
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    plan = {} if planned else None
    for _ in range(1 + planned):
        lse_aligned, delta_aligned = hopper._aligned_lse_delta(lse, delta, params, plan)
    assert lse_aligned.stride(0) % 4 == 0
    written = torch.zeros_like(lse_aligned, dtype=torch.bool)
    cu = params.cu_seqlens_q.tolist()
    for b, length in enumerate(lengths):
        start = (cu[b] + 3 * b + 3) // 4 * 4  # _aligned_row
        assert start % 4 == 0 and start >= (written.nonzero()[:, 1].max() + 1 if b else 0)
        for copy, packed in ((lse_aligned, lse), (delta_aligned, delta)):
            assert torch.equal(copy[:, start:start + length], packed[:, cu[b]:cu[b + 1]])
        written[:, start:start + length] = True
    assert not lse_aligned[~written].any() and not delta_aligned[~written].any()


# ---- NaN-safe tails and dense calls at any length (as varlen with equal lengths) --------------

def non_finite_(x):
    """Fill x in place with NaN, inf and -inf in turn (rows no other sequence may see)."""
    flat = x.view(-1)
    for i, value in enumerate((float("nan"), float("inf"), float("-inf"))):
        flat[i::3] = value
    return x


def _gluon_grads(q, k, v, dout, params, monkeypatch):
    """(dq, dk, dv) of forward + backward into NaN-poisoned buffers, asserting that the Gluon
    kernels computed them."""
    calls = _spy_gluon(monkeypatch)
    out, lse = triton_backend.forward(q, k, v, params)
    grads = triton_backend.backward(dout, q, k, v, out, lse, params,
                                    dq=poison(torch.empty_like(q)),
                                    dk=poison(torch.empty_like(k)),
                                    dv=poison(torch.empty_like(v)))[:3]
    assert calls == GLUON_LAUNCHES
    return grads


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_gluon_backward_varlen_non_finite_sequence_does_not_leak(head_dim, monkeypatch):
    """A packed sequence whose q, k, v and dout are NaN/inf: the tiles of the sequences before
    it read its rows (Q, dO, delta in the dK/dV kernel, K and V in the dQ kernel) and must
    still give the oracle's gradients on their finite data (0 * NaN would be NaN)."""
    lengths_q, lengths_k, bad = [70, 3, 200, 1, 129], [100, 1000, 33, 5, 130], 1
    q, k, v, dout, params = _varlen_case(lengths_q, lengths_k, 4, 2, head_dim, torch.bfloat16,
                                         "cuda", window_right=0, alibi="batch")
    cu_q, cu_k = params.cu_seqlens_q.tolist(), params.cu_seqlens_k.tolist()
    for x, cu in ((q, cu_q), (dout, cu_q), (k, cu_k), (v, cu_k)):
        non_finite_(x[cu[bad]:cu[bad + 1]])
    grads = _gluon_grads(q, k, v, dout, params, monkeypatch)
    rows_q, rows_k = ([torch.arange(cu[b], cu[b + 1]) for b in range(len(lengths_q)) if b != bad]
                      for cu in (cu_q, cu_k))
    rows_q, rows_k = torch.cat(rows_q).cuda(), torch.cat(rows_k).cuda()
    results = []
    for t in (torch.float64, q.dtype):
        leaves = [x.detach().to(t).requires_grad_() for x in (q, k, v)]
        ref_out, _ = attention_with_params(*leaves, params)
        results.append(torch.autograd.grad(ref_out, leaves, dout.to(t)))
    for name, got, want, base, rows in zip(("dq", "dk", "dv"), grads, *results,
                                           (rows_q, rows_k, rows_k), strict=True):
        assert_close_to_oracle(name, got[rows], want[rows], base[rows], factor=factor_for(name))


def test_dense_as_varlen_taken_on_hopper_at_odd_lengths():
    """Dense lengths off the tiles: not `eligible` as they are, but run as varlen on sm_90;
    whole tiles and a Triton tile override never take that route."""
    on_hopper = DEVICE == "cuda" and _on_hopper()
    plain = AttentionParams(0.125, None, 0)
    for seqlens in ((100, 100), (1, 63), (1000, 777)):
        q, k, v, _ = make_inputs(2, *seqlens, 4, 2, 64, 64, torch.float16)
        lse = torch.empty(2, 4, seqlens[0], dtype=torch.float32, device=q.device)
        args = (q, k, v, torch.empty_like(q), lse, plain, torch.empty_like(q),
                torch.empty_like(k), torch.empty_like(v))
        assert not hopper.eligible(*args, None)
        assert hopper.dense_as_varlen(*args, None) == on_hopper
        assert not hopper.dense_as_varlen(*args, {"dkdv": (32, 32, 4, 1)})
    q, k, v, _ = make_inputs(1, 128, 128, 2, 2, 64, 64, torch.float16)
    lse = torch.empty(1, 2, 128, dtype=torch.float32, device=q.device)
    assert not hopper.dense_as_varlen(q, k, v, q, lse, plain, q, k, v, None)


def test_dense_as_varlen_equals_dense():
    """dispatch._dense_as_varlen (the views, cu_seqlens, transposed lse and dlse, ALiBi's
    (batch, nheads) slopes and the keep-mask indexed by batch entry) gives the dense call's
    gradients, here through the Triton varlen kernels (interpreter on CPU)."""
    batch, seqlen_q, seqlen_k, nheads = 2, 37, 29, 2
    q, k, v, dout = make_inputs(batch, seqlen_q, seqlen_k, nheads, 1, 16, 16, torch.float32)
    params = AttentionParams(0.25, 20, 0, alibi_slopes=torch.rand(batch, nheads, device=DEVICE),
                             sink=torch.randn(nheads, device=DEVICE), dropout_p=0.2,
                             dropout_seed=77)
    out, lse = triton_backend.forward(q, k, v, params)
    dlse = torch.randn_like(lse)
    dense = backward.attention_backward(dout, q, k, v, out, lse, params, dlse=dlse)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    packed = dispatch._dense_as_varlen(dout, q, k, v, out, lse, params, *grads, dlse,
                                       gluon=False)
    assert all(a is b for a, b in zip(packed[:3], grads, strict=False))
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), packed, dense, strict=True):
        torch.testing.assert_close(a, b, msg=name)


def _lse_grad_check(q, k, v, dout, params) -> None:
    """Forward, then the backward of a loss on lse as well as out (dlse random), into
    NaN-poisoned buffers, against the float64 oracle's gradients of the same loss (section 5's
    rule for dq, dk, dv and dsink)."""
    out, lse = triton_backend.forward(q, k, v, params)
    dlse = torch.randn_like(lse)
    grads = triton_backend.backward(dout, q, k, v, out, lse, params, dlse=dlse,
                                    dq=poison(torch.empty_like(q)),
                                    dk=poison(torch.empty_like(k)),
                                    dv=poison(torch.empty_like(v)))
    results = []
    for t in (torch.float64, q.dtype):
        inputs = (q, k, v) if params.sink is None else (q, k, v, params.sink)
        leaves = [x.detach().to(t).requires_grad_() for x in inputs]
        ref_out, ref_lse = attention_with_params(
            *leaves[:3], dataclasses.replace(params, sink=None if len(leaves) == 3
                                             else leaves[3]))
        results.append(torch.autograd.grad((ref_out, ref_lse), leaves,
                                           (dout.to(t), dlse.to(ref_lse.dtype))))
    got = grads[:3] if params.sink is None else grads
    for name, tensor, want, base in zip(("dq", "dk", "dv", "dsink"), got, *results,
                                        strict=False):
        assert_close_to_oracle(name, tensor, want, base, factor=GRAD_FACTOR)


@pytest.mark.parametrize("features", [dict(window_right=0, sink=True), dict(softcap=3.0)],
                         ids=str)
def test_lse_gradient_enters_each_rows_delta(features):
    """A loss on lse too (dlse, as ring attention's merge or a user's loss give): the dQ
    programs store each row's delta = D - dlse (with a sink, rowsum(P * dP) - dlse) before
    the dK/dV programs read it. backward.py's kernels, odd lengths both ways, GQA."""
    q, k, v, dout = make_inputs(2, 37, 29, 4, 2, 16, 16, torch.float32)
    sink = features.pop("sink", False)
    params = AttentionParams(0.25, **features,
                             sink=torch.randn(4, device=DEVICE) if sink else None)
    _lse_grad_check(q, k, v, dout, params)


LSE_GRAD_CASES = [  # (dtype, head_dim, seqlen_q, seqlen_k, features)
    (torch.bfloat16, 128, 256, 256, dict(window_right=0)),
    (torch.float16, 64, 300, 517, dict(softcap=3.0, sink=True)),  # off the tiles: as varlen
    (torch.bfloat16, 256, 192, 320, dict(window_right=0, sink=True)),  # two-warpgroup dK/dV
]


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", LSE_GRAD_CASES, ids=str)
def test_gpu_gluon_backward_with_an_lse_gradient_matches_oracle(case, monkeypatch):
    """The same through the Gluon dQ kernel, which folds dlse into the delta it stores for the
    Gluon dK/dV launch after it."""
    dtype, head_dim, seqlen_q, seqlen_k, features = case
    q, k, v, dout = make_inputs(2, seqlen_q, seqlen_k, 4, 2, head_dim, head_dim, dtype, "cuda")
    calls = _spy_gluon(monkeypatch)
    _lse_grad_check(q, k, v, dout, _feature_params(4, head_dim, False, **features))
    assert calls == GLUON_LAUNCHES


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
def test_gpu_gluon_dq_reads_out_through_its_strides(monkeypatch):
    """The Gluon dQ kernel reads out for D = rowsum(dO * O) through all four strides: out as a
    view whose columns are every other element gives bitwise the gradients of a contiguous out."""
    q, k, v, dout = make_inputs(2, 256, 256, 4, 2, 128, 128, torch.bfloat16, "cuda")
    params = AttentionParams(128 ** -0.5, None, 0)
    calls = _spy_gluon(monkeypatch)
    out, lse = triton_backend.forward(q, k, v, params)
    strided = torch.zeros(*out.shape[:3], 2 * out.shape[3], dtype=out.dtype, device="cuda")
    strided[..., ::2] = out
    strided = strided[..., ::2]
    assert strided.stride(-1) == 2 and torch.equal(strided, out)
    want = triton_backend.backward(dout, q, k, v, out, lse, params)
    got = triton_backend.backward(dout, q, k, v, strided, lse, params)
    assert calls == GLUON_LAUNCHES * 2
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=False):
        assert torch.equal(a, b), name


DENSE_ODD_CASES = [  # (dtype, head_dim, batch, seqlen_q, seqlen_k, nheads, nheads_k, features)
    (torch.bfloat16, 128, 2, 1000, 777, 4, 2, dict(window_right=0)),
    (torch.float16, 64, 2, 777, 1000, 4, 1, dict(window_left=100, window_right=30)),
    (torch.bfloat16, 64, 3, 1, 63, 2, 2, dict()),
    (torch.float16, 128, 2, 63, 1, 2, 2, dict(window_right=0)),  # rows without keys
    (torch.bfloat16, 128, 2, 4000, 4000, 2, 1, dict(window_right=0, sink=True, alibi=True)),
    (torch.float16, 64, 2, 300, 517, 4, 2, dict(softcap=3.0, sink=True)),
    (torch.bfloat16, 128, 2, 517, 300, 4, 2, dict(window_right=0, dropout_p=0.17,
                                                 dropout_seed=2**40 + 7)),
    (torch.float16, 64, 2, 203, 203, 2, 2, dict(alibi=True, dropout_p=0.1, dropout_seed=99)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", DENSE_ODD_CASES, ids=str)
def test_gpu_gluon_backward_dense_any_length_matches_oracle(case, monkeypatch):
    """Dense lengths off every tile through the Gluon kernels (as varlen with equal lengths)
    against the float64 oracle into NaN-poisoned buffers, every feature and GQA (ALiBi slopes
    (batch = 2, nheads), _feature_params')."""
    dtype, head_dim, batch, seqlen_q, seqlen_k, nheads, nheads_k, features = case
    features = dict(features)
    dropout = dict(dropout_p=features.pop("dropout_p", 0.0),
                   dropout_seed=features.pop("dropout_seed", 0))
    q, k, v, dout = make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim,
                                head_dim, dtype, "cuda")
    params = dataclasses.replace(_feature_params(nheads, head_dim, False, **features), **dropout)
    calls = _spy_gluon(monkeypatch)
    if dropout["dropout_p"]:
        _check_dropout(q, k, v, dout, params)
    else:
        _, _, grads = check_against_oracle(q, k, v, dout, params)
        if params.sink is not None:
            dsinks = []
            for t in (torch.float64, dtype):
                leaves = [x.detach().to(t).requires_grad_() for x in (q, k, v, params.sink)]
                out, _ = attention_with_params(*leaves[:3],
                                               dataclasses.replace(params, sink=leaves[3]))
                dsinks.append(torch.autograd.grad(out, leaves[3], dout.to(t))[0])
            assert_close_to_oracle("dsink", grads[3], *dsinks, factor=GRAD_FACTOR)
    assert calls == ["attention_backward_dq", "attention_backward_dkdv"]


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_gluon_backward_dense_next_batch_entry_does_not_leak(head_dim, monkeypatch):
    """Dense at odd lengths: entry 0's last tiles read entry 1's first rows. With NaN/inf in
    entry 1's q, k, v and dout, entries 0 and 2 still equal the oracle on their finite data."""
    q, k, v, dout = make_inputs(3, 203, 300, 4, 2, head_dim, head_dim, torch.bfloat16, "cuda")
    for x in (q, k, v, dout):
        non_finite_(x[1])
    params = AttentionParams(head_dim ** -0.5, None, 0, softcap=4.0)
    grads = _gluon_grads(q, k, v, dout, params, monkeypatch)
    finite = [0, 2]
    results = []
    for t in (torch.float64, q.dtype):
        leaves = [x[finite].detach().to(t).requires_grad_() for x in (q, k, v)]
        ref_out, _ = attention_with_params(*leaves, params)
        results.append(torch.autograd.grad(ref_out, leaves, dout[finite].to(t)))
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, *results, strict=True):
        assert_close_to_oracle(name, got[finite], want, base, factor=factor_for(name))


def _sdpa_layout(x):
    """x (batch, seqlen, heads, d) with SDPA's (batch, heads, seqlen, d) memory, as a
    transformers model passes q.transpose(1, 2)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _packed_qkv(q, k, v):
    """q, k, v unbound from one (batch, seqlen, 3, heads, d) tensor (flash_attn_qkvpacked)."""
    return torch.stack((q, k, v), dim=2).unbind(2)


# (dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_k, layout, features, the kernels that
# run the forward and the backward). Layouts: "sdpa" q, k, v heads-major, "sdpa kv" k and v
# alone, "sdpa dout" dO too, "packed" q, k, v unbound from one packed qkv (rows 3 heads * d
# apart), "sliced" each the first half of a head dim twice as wide (no 2-D view: copies).
STRIDED_CASES = [
    (torch.bfloat16, 128, 1024, 1024, 16, 4, "sdpa", dict(window_right=0), "gluon", "gluon"),
    (torch.float16, 64, 1024, 768, 4, 2, "sdpa", dict(), "gluon", "gluon"),
    (torch.bfloat16, 256, 1024, 1024, 4, 2, "sdpa dout", dict(window_right=0, softcap=5.0),
     "gluon", "gluon"),
    (torch.bfloat16, 128, 512, 512, 8, 2, "sdpa kv", dict(window_left=100, window_right=0,
                                                          alibi=True, sink=True),
     "gluon", "gluon"),
    (torch.float16, 64, 256, 256, 4, 1, "sdpa dout", dict(window_right=0), "gluon", "gluon"),
    (torch.bfloat16, 128, 512, 640, 4, 2, "sdpa", dict(), "gluon", "gluon"),  # persistent
    (torch.bfloat16, 128, 2048, 2048, 4, 2, "sdpa kv", dict(window_right=0), "gluon", "gluon"),
    # lengths off the backward's tiles: the forward reads in place, the backward runs the
    # portable kernels (as varlen, the Gluon kernels write contiguous gradients)
    (torch.bfloat16, 128, 300, 200, 4, 2, "sdpa", dict(window_right=0), "gluon", "triton"),
    (torch.float16, 128, 1024, 1024, 4, 4, "packed", dict(window_left=100, window_right=0,
                                                            alibi=True, sink=True),
     "gluon", "gluon"),
    (torch.bfloat16, 64, 1024, 1024, 4, 2, "sliced", dict(window_right=0), dispatch.ON_COPIES,
     dispatch.ON_COPIES),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", STRIDED_CASES, ids=str)
def test_gpu_strided_inputs_run_the_gluon_kernels(case, monkeypatch, caplog):
    """q, k, v (and dO) in SDPA's heads-major memory seen as flash-attn's shape, or unbound
    from packed qkv, run the Gluon forward and backward in place (their 2-D views (batch *
    heads * seqlen, d), or (tokens, heads * d) with rows 3 heads * d apart); a sliced head dim
    runs them on contiguous copies (dispatch.ON_COPIES); into poisoned buffers laid out as the
    inputs, against the float64 oracle."""
    import logging

    (dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_k, layout, features, forward_ran,
     backward_ran) = case
    q, k, v, dout = make_inputs(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim,
                                dtype, "cuda")
    if layout == "packed":
        q, k, v = _packed_qkv(q, k, v)
    elif layout == "sliced":
        q, k, v = (torch.cat((x, x), dim=-1)[..., :head_dim] for x in (q, k, v))
    else:
        k, v = _sdpa_layout(k), _sdpa_layout(v)
        if layout != "sdpa kv":
            q = _sdpa_layout(q)
        if layout == "sdpa dout":
            dout = _sdpa_layout(dout)
    assert not all(x.is_contiguous() for x in (q, k, v))  # (a single head is both layouts)
    params = _feature_params(nheads, head_dim, False, **features)
    calls = _spy_gluon(monkeypatch)
    with caplog.at_level(logging.DEBUG, logger="flashkit.dispatch"):
        check_against_oracle(q, k, v, dout, params)
    gluon_backward = backward_ran != "triton"
    assert calls == (["attention_backward_dq", "attention_backward_dkdv"] if gluon_backward
                     else [])
    ran = [r.getMessage().split(";")[0] for r in caplog.records if r.name == "flashkit.dispatch"]
    assert f"forward ran {forward_ran}" in ran
    assert f"backward ran {backward_ran}" in ran
