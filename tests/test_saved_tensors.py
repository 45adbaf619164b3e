"""What the forward keeps for the backward: besides its inputs, only O in the inputs' dtype and
the float32 LSE, as in every FlashAttention (a float32 O would triple the activation memory),
with every feature, a sink's included."""

from __future__ import annotations

import pytest
import torch

import flashkit
from helpers import alibi_slopes, random_qkv, random_varlen, sink

BACKENDS = ["torch", "triton"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels' (else interpreted)


def on(backend, *tensors):
    device = DEVICE if backend == "triton" else "cpu"
    return [t.to(device) for t in tensors]


def saved_by_forward(fn, inputs: dict) -> list[torch.Tensor]:
    """The tensors autograd keeps from fn(**inputs) that are not (views of) the inputs."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(**inputs)
    out.float().sum().backward()  # the saved tensors serve a working backward
    mine = {t.untyped_storage().data_ptr() for t in inputs.values()
            if isinstance(t, torch.Tensor)}
    return [t for t in saved if t.untyped_storage().data_ptr() not in mine]


def check_saved(saved, out, lse_shape):
    kept = sorted(((tuple(t.shape), t.dtype) for t in saved), key=str)
    expected = sorted([(tuple(out.shape), out.dtype), (lse_shape, torch.float32)], key=str)
    assert kept == expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("feature", ["plain", "sink", "alibi"])
def test_dense_forward_saves_out_and_lse(backend, dtype, feature):
    q, k, v = on(backend, *random_qkv(2, 9, 11, 4, 2, headdim=16, dtype=dtype))
    inputs = dict(q=q.requires_grad_(), k=k.requires_grad_(), v=v.requires_grad_(), causal=True,
                  backend=backend)
    if feature == "sink":
        inputs["sink"] = on(backend, sink(4))[0].requires_grad_()
    if feature == "alibi":
        inputs["alibi_slopes"] = on(backend, alibi_slopes(4))[0]
    saved = saved_by_forward(flashkit.flash_attn_func, inputs)
    check_saved(saved, q, (2, 4, 9))


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_forward_saves_out_and_lse(backend):
    inputs = random_varlen([3, 0, 7], [5, 2, 7], nheads=2, headdim=16, dtype=torch.bfloat16)
    for name in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"):
        inputs[name] = on(backend, inputs[name])[0]
    for name in ("q", "k", "v"):
        inputs[name].requires_grad_()
    saved = saved_by_forward(flashkit.flash_attn_varlen_func, dict(inputs, backend=backend))
    check_saved(saved, inputs["q"], (2, 10))
