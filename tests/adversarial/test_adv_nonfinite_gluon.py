"""The one-key promise of docs/robustness.md on the sm_90 Gluon kernels: fp16/bf16 at head dims
64/128 in the flash layout, shapes the Gluon path takes (the other adversarial modules use fp32
at head dim 16, which it declines). Every test asserts that the Gluon backward computed the
result (its launchers are wrapped and counted). Rows that see exactly one key get exactly zero
dq and dk (window (0, 0); causal with seqlen_q > seqlen_k); the shapes of the adversarial
modules reach the Gluon kernels (dense on and off the tiles, varlen)."""

from __future__ import annotations

import importlib

import pytest
import torch

import flashkit
from flashkit.ops.params import AttentionParams
from flashkit.ops.triton import ahead
from flashkit.reference import attention_with_params
from flashkit.testing import assert_close_to_oracle
from helpers import ON_HOPPER

forward_hopper = importlib.import_module("flashkit.ops.triton.forward_hopper")
backward_hopper = importlib.import_module("flashkit.ops.triton.backward_hopper")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")]

def _spy(monkeypatch) -> list:
    """Record every call of the Gluon launchers (dispatch and backward.py call them through
    their modules) that launches: not those of a first call compiling its kernels ahead."""
    calls = []
    for module, name in ((forward_hopper, "attention_forward"),
                         (backward_hopper, "attention_backward_dkdv"),
                         (backward_hopper, "attention_backward_dq")):
        launcher = getattr(module, name)

        def record(*args, _name=name, _launcher=launcher, **kwargs):
            if not ahead.active():
                calls.append(_name)
            return _launcher(*args, **kwargs)
        monkeypatch.setattr(module, name, record)
    return calls


def _visible(seqlen_q, seqlen_k, window) -> torch.Tensor:
    """[seqlen_q, seqlen_k] bool: key j visible from query i (docs/design.md section 1)."""
    left, right = window
    i = torch.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k)[None, :]
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def _window(window):
    left, right = window
    return (None if left < 0 else left), (None if right < 0 else right)


def _grads(q, k, v, dout, window, **kwargs):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = flashkit.flash_attn_func(*leaves, window_size=window, backend="triton", **kwargs)
    return torch.autograd.grad(out, leaves, dout)


def _oracle_grads(q, k, v, dout, window, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, _ = attention_with_params(*leaves, AttentionParams(q.shape[-1] ** -0.5,
                                                            *_window(window)))
    return torch.autograd.grad(out, leaves, dout.to(dtype))


# (head_dim, seqlen_q, seqlen_k, window): every row of (0, 0) sees one key; causal with
# seqlen_q > seqlen_k: row seqlen_q - seqlen_k sees key 0 alone (rows above it see none)
ONE_KEY = [(64, 256, 256, (0, 0)), (128, 192, 192, (0, 0)), (128, 200, 130, (0, 0)),
           (64, 320, 128, (-1, 0)), (128, 333, 201, (-1, 0))]


@pytest.mark.parametrize("case", ONE_KEY, ids=str)
def test_gluon_backward_one_key_rows_get_exact_zero(case, monkeypatch):
    calls = _spy(monkeypatch)
    head_dim, seqlen_q, seqlen_k, window = case
    q = torch.randn(2, seqlen_q, 4, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, seqlen_k, 2, head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    dout = torch.randn_like(q)
    dq, dk, dv = _grads(q, k, v, dout, window)
    assert "attention_backward_dq" in calls
    vis = _visible(seqlen_q, seqlen_k, window)
    one = (vis.sum(1) == 1).cuda()
    assert one.any() and (dq[:, one] == 0).all()
    only_one = (vis.sum(0) > 0) & (vis & (vis.sum(1, keepdim=True) == 1)).sum(0).eq(
        vis.sum(0))  # keys seen only by one-key rows
    assert (dk[:, only_one.cuda()] == 0).all()
    want, base = (_oracle_grads(q, k, v, dout, window, t) for t in (torch.float64, q.dtype))
    for name, got, w, b in zip(("dq", "dk", "dv"), (dq, dk, dv), want, base, strict=True):
        assert_close_to_oracle(name, got, w, b, factor=3)
    sink = torch.zeros(4, device="cuda")  # a sink makes the one score matter: no exact zero
    dq_sink = _grads(q, k, v, dout, window, sink=sink)[0]
    assert (dq_sink[:, one] != 0).any()


def test_gluon_takes_the_adversarial_shapes(monkeypatch):
    """The module's shapes do reach the Gluon kernels through the public API (dense at lengths
    on the tiles, dense off them, varlen)."""
    calls = _spy(monkeypatch)
    for seqlen in (256, 190):
        q, k, v = (torch.randn(1, seqlen, 2, 64, device="cuda", dtype=torch.float16,
                               requires_grad=True) for _ in range(3))
        flashkit.flash_attn_func(q, k, v, causal=True, backend="triton").sum().backward()
    cu = torch.tensor([0, 70, 71, 300], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(300, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    flashkit.flash_attn_varlen_func(q, k, v, cu, cu, 229, 229, causal=True,
                                    backend="triton").sum().backward()
    assert calls == ["attention_forward", "attention_backward_dq",
                     "attention_backward_dkdv"] * 3
