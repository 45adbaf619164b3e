"""The flash-attn style entry points: the acceptance case, packed layouts, dispatch, return
values, and every bad input raising a clear error that names the argument (docs/design.md
section 2)."""

from __future__ import annotations

import math

import pytest
import torch

import flashkit
from flashkit import checks, reference
from helpers import (
    alibi_slopes,
    api_attention,
    check_against_oracle,
    cu_seqlens,
    oracle,
    random_qkv,
    random_varlen,
    sink,
)


def flash_attn_out(**kwargs):
    """What a user calls: out only, default backend."""
    return (flashkit.flash_attn_func(**kwargs),)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths", [(150, 230), (230, 150)], ids=["q<k", "q>k"])
def test_acceptance(lengths, dtype):
    """causal + sliding window + ALiBi + softcap + sink, GQA, seqlen_q != seqlen_k, on CPU."""
    nheads, nheads_k = 8, 2
    q, k, v = random_qkv(2, *lengths, nheads, nheads_k, headdim=64, dtype=dtype)
    inputs = dict(q=q, k=k, v=v, causal=True, window_size=(32, 0),
                  alibi_slopes=alibi_slopes(nheads), softcap=30.0, sink=sink(nheads))
    check_against_oracle(flash_attn_out, inputs, output_names=("out",))
    check_against_oracle(api_attention, inputs)  # lse and its gradient too


ON_GPU = torch.cuda.is_available()
TRITON_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=str)
def test_acceptance_on_triton(dtype):
    """The acceptance case through the custom op on the Triton kernels (compiled on a GPU,
    interpreted without one): out, lse, probs and every gradient, through lse included."""
    nheads, nheads_k = 4, 2
    device = "cuda" if ON_GPU else "cpu"
    q, k, v = (t.to(device) for t in random_qkv(1, 37, 45, nheads, nheads_k, headdim=32,
                                                  dtype=dtype))
    inputs = dict(q=q, k=k, v=v, causal=True, window_size=(16, 0),
                  alibi_slopes=alibi_slopes(nheads).to(device), softcap=30.0,
                  sink=sink(nheads).to(device))
    check_against_oracle(lambda **kw: api_attention(backend="triton", **kw), inputs)


def test_default_backend_on_cpu_is_torch():
    q, k, v = random_qkv(2, 20, 30, 4, 2, headdim=16)
    out = flashkit.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, flashkit.flash_attn_func(q, k, v, causal=True, backend="torch"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=["fp32", "bf16", "fp64"])
def test_return_values(dtype):
    q, k, v = random_qkv(2, 9, 13, 4, 2, headdim=16, dtype=dtype)
    out = flashkit.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 9, 4, 16) and out.dtype == dtype
    out, lse, probs = flashkit.flash_attn_func(q, k, v, return_attn_probs=True)
    assert lse.shape == (2, 4, 9)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert probs.shape == (2, 4, 9, 13)


def test_reference_backend_is_the_oracle():
    q, k, v = random_qkv(2, 9, 13, 4, 2, headdim=16, dtype=torch.float64)
    kwargs = dict(causal=True, alibi_slopes=alibi_slopes(4), sink=sink(4).double())
    out, lse, probs = flashkit.flash_attn_func(q, k, v, return_attn_probs=True,
                                               backend="reference", **kwargs)
    expected = oracle(q, k, v, return_probs=True, **kwargs)
    for got, want in zip((out, lse, probs), expected, strict=True):
        assert torch.equal(got, want)


def test_reference_backend_refuses_dropout():
    q, k, v = random_qkv(1, 4, 4, 2, 2, headdim=16)
    with pytest.raises(NotImplementedError, match="reference.*dropout"):
        flashkit.flash_attn_func(q, k, v, dropout_p=0.1, backend="reference")


def test_qkvpacked_gradients_reach_qkv():
    def packed(q, k, v, **kw):
        out, lse, _ = flashkit.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), **kw,
                                                         return_attn_probs=True)
        return out, lse

    q, k, v = random_qkv(2, 19, 19, 4, 4, headdim=32)
    check_against_oracle(packed, dict(q=q, k=k, v=v, causal=True, sink=sink(4)))


def test_kvpacked_gradients_reach_kv():
    def packed(q, k, v, **kw):
        out, lse, _ = flashkit.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), **kw,
                                                        return_attn_probs=True)
        return out, lse

    q, k, v = random_qkv(2, 11, 23, 4, 2, headdim=32)
    check_against_oracle(packed, dict(q=q, k=k, v=v, window_size=(4, 4),
                                      alibi_slopes=alibi_slopes(4, batch=2)))


def test_packed_inputs_are_views_not_modified():
    qkv = torch.randn(2, 16, 3, 4, 32, requires_grad=True)
    before = qkv.detach().clone()
    flashkit.flash_attn_qkvpacked_func(qkv, causal=True).sum().backward()
    assert torch.equal(qkv.detach(), before)
    q, k, v = (t.detach().requires_grad_() for t in before.unbind(2))
    flashkit.flash_attn_func(q, k, v, causal=True).sum().backward()
    torch.testing.assert_close(qkv.grad, torch.stack([q.grad, k.grad, v.grad], 2))


def test_deterministic_is_accepted():
    q, k, v = random_qkv(1, 8, 8, 2, 2, headdim=16)
    torch.testing.assert_close(flashkit.flash_attn_func(q, k, v, deterministic=True),
                               flashkit.flash_attn_func(q, k, v), rtol=0, atol=0)


# --- bad input: the exception type and a message that starts with the argument's name -------

def _dense(**changes):
    """Valid flash_attn_func arguments (b 2, sq 5, sk 7, h 4, hk 2, d 16) with some replaced."""
    q, k, v = random_qkv(2, 5, 7, 4, 2, headdim=16)
    return {**dict(q=q, k=k, v=v), **changes}


def _varlen(**changes):
    inputs = random_varlen([3, 2], [4, 3], nheads=4, nheads_k=2, headdim=16)
    return {**inputs, **changes}


DENSE_ERRORS = {  # name -> (arguments, exception, the argument the message names)
    "q_not_tensor": (lambda: _dense(q=[1.0]), TypeError, "q"),
    "q_rank": (lambda: _dense(q=torch.randn(2, 5, 64)), ValueError, "q"),
    "k_rank": (lambda: _dense(k=torch.randn(2, 7, 2, 16, 1)), ValueError, "k"),
    "k_batch": (lambda: _dense(k=torch.randn(3, 7, 2, 16)), ValueError, "k"),
    "v_batch": (lambda: _dense(v=torch.randn(1, 7, 2, 16)), ValueError, "v"),
    "v_seqlen": (lambda: _dense(v=torch.randn(2, 6, 2, 16)), ValueError, "v"),
    "v_heads": (lambda: _dense(v=torch.randn(2, 7, 1, 16)), ValueError, "v"),
    "heads_not_divisible": (lambda: _dense(k=torch.randn(2, 7, 3, 16),
                                           v=torch.randn(2, 7, 3, 16)), ValueError, "k"),
    "k_headdim": (lambda: _dense(k=torch.randn(2, 7, 2, 32)), ValueError, "k"),
    "headdim_too_big": (lambda: _dense(q=torch.randn(2, 5, 4, 264), k=torch.randn(2, 7, 2, 264),
                                       v=torch.randn(2, 7, 2, 264)), ValueError, "q"),
    "v_headdim_too_big": (lambda: _dense(v=torch.randn(2, 7, 2, 257)), ValueError, "v"),
    "int_dtype": (lambda: _dense(q=torch.ones(2, 5, 4, 16, dtype=torch.int32),
                                 k=torch.ones(2, 7, 2, 16, dtype=torch.int32),
                                 v=torch.ones(2, 7, 2, 16, dtype=torch.int32)), TypeError, "q"),
    "mixed_dtypes": (lambda: _dense(k=torch.randn(2, 7, 2, 16, dtype=torch.float16)),
                     TypeError, "k"),
    "mixed_devices": (lambda: _dense(v=torch.randn(2, 7, 2, 16, device="meta")),
                      ValueError, "v"),
    "scale_nan": (lambda: _dense(softmax_scale=math.nan), ValueError, "softmax_scale"),
    "scale_inf": (lambda: _dense(softmax_scale=math.inf), ValueError, "softmax_scale"),
    "scale_zero": (lambda: _dense(softmax_scale=0.0), ValueError, "softmax_scale"),
    "scale_negative": (lambda: _dense(softmax_scale=-0.5), ValueError, "softmax_scale"),
    "dropout_negative": (lambda: _dense(dropout_p=-0.1), ValueError, "dropout_p"),
    "dropout_one": (lambda: _dense(dropout_p=1.0), ValueError, "dropout_p"),
    "window_below_minus_one": (lambda: _dense(window_size=(-2, 0)), ValueError, "window_size"),
    "window_not_pair": (lambda: _dense(window_size=(3,)), ValueError, "window_size"),
    "softcap_negative": (lambda: _dense(softcap=-1.0), ValueError, "softcap"),
    "causal_not_bool": (lambda: _dense(causal="yes"), TypeError, "causal"),
    "alibi_shape": (lambda: _dense(alibi_slopes=torch.rand(2)), ValueError, "alibi_slopes"),
    "alibi_batch_shape": (lambda: _dense(alibi_slopes=torch.rand(3, 4)), ValueError,
                          "alibi_slopes"),
    "alibi_dtype": (lambda: _dense(alibi_slopes=torch.rand(4, dtype=torch.float64)), TypeError,
                    "alibi_slopes"),
    "alibi_device": (lambda: _dense(alibi_slopes=torch.rand(4, device="meta")), ValueError,
                     "alibi_slopes"),
    "sink_shape": (lambda: _dense(sink=torch.randn(2)), ValueError, "sink"),
    "sink_dtype": (lambda: _dense(sink=torch.ones(4, dtype=torch.int64)), TypeError, "sink"),
    "sink_device": (lambda: _dense(sink=torch.randn(4, device="meta")), ValueError, "sink"),
    "unknown_backend": (lambda: _dense(backend="cuda"), ValueError, "backend"),
}


@pytest.mark.parametrize("case", list(DENSE_ERRORS))
def test_bad_dense_input(case):
    make, error, argname = DENSE_ERRORS[case]
    with pytest.raises(error, match=rf"^{argname}\b"):
        flashkit.flash_attn_func(**make())


def test_kept_params_never_let_a_refused_argument_through():
    """Calls without tensor arguments or dropout reuse the params checked for the same scalar
    arguments; an argument that the checks refuse by its type (causal=1, a float window
    entry) is refused after a call whose arguments compare equal to it, and a list window,
    which is accepted, is checked each time."""
    from flashkit import api
    q, k, v = random_qkv(1, 5, 5, 2, 2, headdim=16)
    first = api.build_params(q, 0.0, None, True, (-1, -1), 0.0, None, False, None, batch=1)
    assert api.build_params(q, 0, None, True, (-1, -1), 0.0, None, False, None,
                            batch=1) is first
    flashkit.flash_attn_func(q, k, v, causal=True, window_size=(3, -1))
    with pytest.raises(TypeError, match="^causal"):
        flashkit.flash_attn_func(q, k, v, causal=1, window_size=(3, -1))
    with pytest.raises(ValueError, match="^window_size"):
        flashkit.flash_attn_func(q, k, v, causal=True, window_size=(3.0, -1))
    torch.testing.assert_close(flashkit.flash_attn_func(q, k, v, window_size=[3, -1]),
                               flashkit.flash_attn_func(q, k, v, window_size=(3, -1)),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="^softmax_scale"):  # NaN never matches a kept key
        flashkit.flash_attn_func(q, k, v, softmax_scale=math.nan)



def test_kept_calls_check_every_tensor_fact_again():
    """flash_attn_func keeps a call's checked params under its tensors' types, shapes, dtypes and
    devices too: a tensor that differs in any of them from an accepted call's is checked (and
    refused) as if it were the first call, and an unhashable backend is refused by name."""
    q, k, v = random_qkv(1, 5, 5, 4, 2, headdim=16)
    for _ in range(2):
        flashkit.flash_attn_func(q, k, v, causal=True)
    with pytest.raises(ValueError, match="^v: 2 heads differ from k's 3"):
        flashkit.flash_attn_func(q, k[:, :, :1].expand(1, 5, 3, 16), v, causal=True)
    with pytest.raises(TypeError, match="^k: dtype"):
        flashkit.flash_attn_func(q, k.double(), v, causal=True)
    with pytest.raises(ValueError, match="^v: seqlen"):
        flashkit.flash_attn_func(q, k, v[:, :4], causal=True)
    with pytest.raises(TypeError, match="^q: expected a torch.Tensor"):
        flashkit.flash_attn_func(q.tolist(), k, v, causal=True)
    with pytest.raises(ValueError, match="^backend"):
        flashkit.flash_attn_func(q, k, v, causal=True, backend="cuda")
    with pytest.raises(ValueError, match="^backend"):
        flashkit.flash_attn_func(q, k, v, causal=True, backend=["torch"])
    torch.testing.assert_close(flashkit.flash_attn_func(q, k, v, causal=True),
                               flashkit.flash_attn_func(q, k, v, causal=True, backend="reference"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kept_varlen_calls_check_new_cu_seqlens_values(backend, monkeypatch):
    """flash_attn_varlen_func keeps a call's checks under its scalars, max_seqlen_q/k and its
    tensors' facts. An equal call passing the same two cu_seqlens tensors, unchanged, checks
    nothing again and reuses the call's params; one whose cu_seqlens was written in place, or
    that passes other tensors of the same layout, has their values checked (a bad one refused
    by name) and gets results of its own values; gradients of a kept call match the first's.
    On a GPU the Triton calls check on the host (sync_checks), to see the bad values refused."""
    from flashkit import api
    device = "cuda" if ON_GPU and backend == "triton" else "cpu"
    monkeypatch.setattr(api, "_VARLEN_CALLS", {})
    checked, varlen_values = [], checks.varlen_values
    monkeypatch.setattr(checks, "varlen_values",
                        lambda *a, **kw: checked.append(a[2]) or varlen_values(*a, **kw))
    inputs = {name: t.to(device) if isinstance(t, torch.Tensor) else t
              for name, t in random_varlen([3, 5, 1], [4, 2, 6], nheads=4, nheads_k=2,
                                           headdim=16).items()}

    def call(**changed):
        return flashkit.flash_attn_varlen_func(**{**inputs, **changed}, causal=True,
                                               backend=backend, return_softmax_lse=True,
                                               sync_checks=device == "cuda")

    def oracle_of(**changed):
        out, lse = reference.attention(**{key: value for key, value in {**inputs, **changed}.items()
                                          if not key.startswith("max_")}, causal=True)
        return out.float(), lse.float()

    first = call()
    assert len(checked) == 1 and len(api._VARLEN_CALLS) == 1
    again = call()
    assert len(checked) == 1  # the same tensors, unchanged: no check
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    cu_q = inputs["cu_seqlens_q"]
    cu_q[1:3] = torch.tensor([4, 8], dtype=torch.int32, device=device)  # lengths 4, 4, 1
    torch.testing.assert_close(call(), oracle_of(), atol=2e-5, rtol=2e-5)
    assert len(checked) == 2 and len(api._VARLEN_CALLS) == 1
    cu_q[1] = 6  # lengths 6, 2, 1: 6 > max_seqlen_q
    with pytest.raises(ValueError, match="^max_seqlen_q"):
        call()
    cu_q[1] = 3
    other = cu_seqlens([1, 7, 1]).to(device)  # another tensor of the same layout: checked
    with pytest.raises(ValueError, match="^max_seqlen_q"):
        call(cu_seqlens_q=other)  # 7 > max_seqlen_q
    other = cu_seqlens([2, 5, 2]).to(device)
    torch.testing.assert_close(call(cu_seqlens_q=other), oracle_of(cu_seqlens_q=other),
                               atol=2e-5, rtol=2e-5)
    assert checked[-1] is other and len(api._VARLEN_CALLS) == 1
    leaves = {name: inputs[name].clone().requires_grad_() for name in ("q", "k", "v")}
    grads = [torch.autograd.grad(call(**leaves)[0].square().sum(), list(leaves.values()))
             for _ in range(2)]
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    with torch.inference_mode():  # an inference tensor has no version counter: always checked
        frozen = cu_seqlens([3, 5, 1]).to(device)
        checks_before = len(checked)
        for _ in range(2):
            call(cu_seqlens_q=frozen)
        assert len(checked) == checks_before + 2


VARLEN_ERRORS = {
    "cu_not_int32": (lambda: _varlen(cu_seqlens_q=torch.tensor([0, 3, 5])), TypeError,
                     "cu_seqlens_q"),
    "cu_not_tensor": (lambda: _varlen(cu_seqlens_k=[0, 4, 7]), TypeError, "cu_seqlens_k"),
    "cu_2d": (lambda: _varlen(cu_seqlens_q=cu_seqlens([3, 2])[None]), TypeError,
              "cu_seqlens_q"),
    "cu_too_short": (lambda: _varlen(cu_seqlens_q=torch.tensor([5], dtype=torch.int32)),
                     ValueError, "cu_seqlens_q"),
    "cu_not_monotone": (lambda: _varlen(cu_seqlens_q=torch.tensor([0, 6, 5],
                                                                  dtype=torch.int32)),
                        ValueError, "cu_seqlens_q"),
    "cu_first_not_zero": (lambda: _varlen(cu_seqlens_k=torch.tensor([1, 4, 7],
                                                                    dtype=torch.int32)),
                          ValueError, "cu_seqlens_k"),
    "cu_last_not_total": (lambda: _varlen(cu_seqlens_k=cu_seqlens([4, 2])), ValueError,
                          "cu_seqlens_k"),
    "cu_wrong_length": (lambda: _varlen(cu_seqlens_k=cu_seqlens([4, 2, 1])), ValueError,
                        "cu_seqlens_k"),
    "max_seqlen_q_too_small": (lambda: _varlen(max_seqlen_q=2), ValueError, "max_seqlen_q"),
    "max_seqlen_k_too_small": (lambda: _varlen(max_seqlen_k=3), ValueError, "max_seqlen_k"),
    "q_rank": (lambda: _varlen(q=torch.randn(1, 5, 4, 16)), ValueError, "q"),
    "v_tokens": (lambda: _varlen(v=torch.randn(6, 2, 16)), ValueError, "v"),
    "alibi_batch_shape": (lambda: _varlen(alibi_slopes=torch.rand(3, 4)), ValueError,
                          "alibi_slopes"),
    "cu_device": (lambda: _varlen(cu_seqlens_q=cu_seqlens([3, 2]).to("meta")), ValueError,
                  "cu_seqlens_q"),
}


@pytest.mark.parametrize("case", list(VARLEN_ERRORS))
def test_bad_varlen_input(case):
    make, error, argname = VARLEN_ERRORS[case]
    with pytest.raises(error, match=rf"^{argname}\b"):
        flashkit.flash_attn_varlen_func(**make())


def test_bad_packed_input():
    with pytest.raises(ValueError, match=r"^qkv\b"):
        flashkit.flash_attn_qkvpacked_func(torch.randn(2, 5, 2, 4, 16))
    with pytest.raises(ValueError, match=r"^kv\b"):
        flashkit.flash_attn_kvpacked_func(torch.randn(2, 5, 4, 16), torch.randn(2, 5, 3, 4, 16))


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"^backend 'triton'.*TRITON_INTERPRET"):
        flashkit.flash_attn_func(**_dense(backend="triton"))


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_alibi_slopes_gradient_is_never_silently_dropped(backend):
    q, k, v = random_qkv(1, 9, 9, 2, 2, headdim=16)
    slopes = torch.rand(2, requires_grad=True)
    if backend == "reference":
        out = flashkit.flash_attn_func(q, k, v, alibi_slopes=slopes, backend=backend)
        (grad,) = torch.autograd.grad(out.sum(), slopes)
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    else:
        with pytest.raises(NotImplementedError, match="^alibi_slopes"):
            flashkit.flash_attn_func(q, k, v, alibi_slopes=slopes, backend=backend)
