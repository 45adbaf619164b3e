"""The eager path (checks -> backend front door -> one autograd.Function) and the compiled path
(the torch.library custom op, taken under torch.compile) give the same outputs and gradients,
for every feature, on the tiled backend and on the Triton kernels (in the interpreter on CPU).
Both run the same backend code, so they agree to the last bit."""

from __future__ import annotations

import pytest
import torch

import flashkit
from flashkit.ops import custom_op
from helpers import alibi_slopes, random_qkv, random_varlen, sink

FEATURES = {  # name -> (shape keywords of random_qkv, flash_attn_func keywords)
    "plain": (dict(batch=2, seqlen_q=9, seqlen_k=9, nheads=2), dict()),
    "gqa_causal": (dict(batch=1, seqlen_q=7, seqlen_k=12, nheads=4, nheads_k=2),
                   dict(causal=True)),
    "window_softcap": (dict(batch=1, seqlen_q=11, seqlen_k=8, nheads=2),
                       dict(window_size=(3, 1), softcap=2.5)),
    "alibi_sink": (dict(batch=2, seqlen_q=5, seqlen_k=9, nheads=2),
                   dict(alibi_slopes="batch", sink=True, causal=True)),
    # 16-bit inputs with a sink: the custom op's backward returns the sink's gradient
    "sink_fp16": (dict(batch=2, seqlen_q=5, seqlen_k=9, nheads=2, dtype=torch.float16),
                  dict(sink=True, causal=True)),
    "dropout": (dict(batch=1, seqlen_q=8, seqlen_k=8, nheads=2), dict(dropout_p=0.25)),
    "deterministic_lse": (dict(batch=1, seqlen_q=6, seqlen_k=10, nheads=2),
                          dict(deterministic=True, return_attn_probs=True)),
}
BACKENDS = ["torch", "triton"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels' (else interpreted)


def _device(backend):
    return DEVICE if backend == "triton" else "cpu"


def _inputs(shape, kwargs, device):
    q, k, v = (t.to(device) for t in random_qkv(**shape, headdim=16))
    kwargs = dict(kwargs)
    nheads = shape["nheads"]
    if kwargs.pop("sink", False):
        kwargs["sink"] = sink(nheads).to(device)
    if kwargs.get("alibi_slopes") == "batch":
        kwargs["alibi_slopes"] = alibi_slopes(nheads, batch=shape["batch"]).to(device)
    return q, k, v, kwargs


def _run_both(fn, leaves, calls: list):
    """fn(*leaves) -> (outputs, loss) eagerly and compiled (fullgraph, aot_eager: the custom op
    traced, no code generation), each under the same torch.manual_seed; returns both
    (outputs, gradients) and records which path each call took in calls."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    results = []
    for run in (fn, compiled):
        inputs = [t.detach().requires_grad_() for t in leaves]
        torch.manual_seed(11)
        outs, loss = run(*inputs)
        results.append((outs, torch.autograd.grad(loss, inputs)))
    return results


@pytest.fixture
def op_calls(monkeypatch):
    """The names of the custom-op calls made (the compiled path's)."""
    calls = []
    attention = custom_op.attention

    def spy(*args, **kwargs):
        calls.append("custom_op")
        return attention(*args, **kwargs)

    monkeypatch.setattr(custom_op, "attention", spy)
    return calls


def _assert_equal(eager, compiled):
    (outs_e, grads_e), (outs_c, grads_c) = eager, compiled
    for i, (a, b) in enumerate(zip(outs_e, outs_c, strict=True)):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"output {i}")
    for i, (a, b) in enumerate(zip(grads_e, grads_c, strict=True)):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"gradient {i}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_dense_eager_equals_compiled(feature, backend, op_calls):
    q, k, v, kwargs = _inputs(*FEATURES[feature], _device(backend))
    grad_sink = kwargs.pop("sink", None)
    leaves = [t for t in (q, k, v, grad_sink) if t is not None]

    def fn(q, k, v, sink=None):
        got = flashkit.flash_attn_func(q, k, v, **kwargs, sink=sink, backend=backend)
        outs = got[:2] if isinstance(got, tuple) else (got,)
        weights = torch.linspace(-1, 1, outs[0].shape[-1], device=q.device)
        loss = (outs[0] * weights).sum() + (outs[1].sum() if len(outs) > 1 else 0)
        return outs, loss

    eager, compiled = _run_both(fn, leaves, op_calls)
    assert op_calls, "the compiled path did not take the custom op"
    _assert_equal(eager, compiled)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_eager_equals_compiled(backend, op_calls):
    device = _device(backend)
    inputs = {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in
              random_varlen([3, 0, 6], [4, 2, 6], nheads=2, nheads_k=1, headdim=16).items()}
    q, k, v = (inputs.pop(n) for n in ("q", "k", "v"))
    sinks = sink(2).to(device)

    def fn(q, k, v, sinks):
        out = flashkit.flash_attn_varlen_func(q, k, v, **inputs, causal=True, softcap=3.0,
                                              sink=sinks, backend=backend)
        return (out,), (out * torch.linspace(-1, 1, out.shape[-1], device=q.device)).sum()

    eager, compiled = _run_both(fn, [q, k, v, sinks], op_calls)
    assert op_calls, "the compiled path did not take the custom op"
    _assert_equal(eager, compiled)


def test_eager_calls_skip_the_custom_op(op_calls):
    """Eager calls, with and without gradients, never go through torch.library's dispatch."""
    q, k, v = random_qkv(1, 5, 5, 2, headdim=16)
    flashkit.flash_attn_func(q, k, v, backend="torch")
    q.requires_grad_()
    flashkit.flash_attn_func(q, k, v, backend="torch").sum().backward()
    assert op_calls == [] and q.grad is not None
