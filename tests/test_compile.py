"""flashkit under torch.compile: the custom ops trace without graph breaks (fullgraph=True), give
what eager gives, and pass torch.library.opcheck; their signatures follow AttentionParams."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashkit
from flashkit.ops import custom_op
from flashkit.ops.params import AttentionParams
from helpers import alibi_slopes, cu_seqlens, random_qkv, sink

COMPILE_CASES = {  # name -> (q, k, v shapes as random_qkv arguments, flash_attn_func keywords)
    "dense": (dict(batch=2, seqlen_q=17, seqlen_k=17, nheads=2, nheads_k=2), dict()),
    "gqa_causal_sink": (dict(batch=2, seqlen_q=19, seqlen_k=40, nheads=4, nheads_k=1),
                        dict(causal=True, sink=True)),
    "window_alibi_softcap": (dict(batch=1, seqlen_q=33, seqlen_k=21, nheads=4, nheads_k=2),
                             dict(window_size=(6, 2), alibi_slopes=True, softcap=4.0)),
    "return_lse": (dict(batch=1, seqlen_q=9, seqlen_k=12, nheads=2, nheads_k=1),
                   dict(causal=True, return_attn_probs=True)),
}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_compiled_matches_eager(case, backend):
    shape, kwargs = COMPILE_CASES[case]
    q, k, v = random_qkv(**shape, headdim=16)
    kwargs = dict(kwargs)
    if kwargs.pop("sink", False):
        kwargs["sink"] = sink(shape["nheads"])
    if kwargs.pop("alibi_slopes", False):
        kwargs["alibi_slopes"] = alibi_slopes(shape["nheads"])
    leaves = [t for t in (q, k, v, kwargs.get("sink")) if t is not None]

    def loss(q, k, v, sink=None):
        out = flashkit.flash_attn_func(q, k, v, **{**kwargs, "sink": sink}, backend="torch")
        if isinstance(out, tuple):  # (out, lse, probs): let a gradient flow through lse too
            return out[0], (out[0] * 1.5).sum() + out[1].sum()
        return out, (out * torch.linspace(-1, 1, out.shape[-1])).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    results = []
    for fn in (loss, compiled):
        inputs = [t.detach().requires_grad_() for t in leaves]
        out, total = fn(*inputs)
        results.append((out, *torch.autograd.grad(total, inputs)))
    for name, eager, comp in zip(["out", "dq", "dk", "dv", "dsink"], *results, strict=False):
        torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_with_scalars_as_arguments_matches_eager(dynamic):
    """softcap and softmax_scale passed in (symbolic floats under dynamic=True), two lengths."""
    def fn(q, k, v, softcap, scale):
        return flashkit.flash_attn_func(q, k, v, causal=True, softcap=softcap,
                                        softmax_scale=scale, backend="torch")

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for seqlen, softcap, scale in ((17, 5.0, 0.3), (30, 7.5, 0.2)):
        q, k, v = random_qkv(1, seqlen, seqlen, 2, 2, headdim=16)
        torch.testing.assert_close(compiled(q, k, v, softcap, scale), fn(q, k, v, softcap, scale),
                                   rtol=1e-6, atol=1e-6)


def test_compiled_sdpa_matches_eager():
    query, key, value = (t.transpose(1, 2) for t in random_qkv(2, 13, 21, 4, 2, headdim=16))
    mask = torch.rand(13, 21) > 0.3

    def fn(query, key, value):
        return flashkit.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                     enable_gqa=True)

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(query, key, value),
                               fn(query, key, value), rtol=1e-6, atol=1e-6)


def test_compiled_dropout_draws_a_seed_per_call():
    """The seed is drawn at run time, not baked into the graph: compiled == eager under the
    same torch.manual_seed, and two compiled calls drop differently."""
    q, k, v = random_qkv(1, 16, 16, 2, 2, headdim=16)

    def fn(q, k, v):
        return flashkit.flash_attn_func(q, k, v, dropout_p=0.5, backend="torch")

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    eager = fn(q, k, v)
    torch.manual_seed(3)
    first = compiled(q, k, v)
    torch.testing.assert_close(first, eager, rtol=0, atol=0)
    assert not torch.equal(compiled(q, k, v), first)


def _forward_args(q, k, v, params, backend="torch"):
    return (q, k, v, *(getattr(params, f) for f in custom_op._FIELDS), backend)


def _op_inputs():
    """(q, k, v, params) sets: dense with every tensor feature, varlen, an SDPA bias."""
    q, k, v = random_qkv(2, 11, 14, 4, 2, headdim=16)
    yield pytest.param(q, k, v, AttentionParams(softmax_scale=0.25, window_left=5, window_right=0,
                                            softcap=3.0, alibi_slopes=alibi_slopes(4, batch=2),
                                            sink=sink(4).requires_grad_()), id="dense")
    q, k, v = (t[0] for t in random_qkv(1, 12, 15, 2, 1, headdim=16))
    yield pytest.param(q, k, v, AttentionParams(
        softmax_scale=0.25, window_right=0, alibi_slopes=alibi_slopes(2),
        cu_seqlens_q=cu_seqlens([5, 0, 7]), cu_seqlens_k=cu_seqlens([6, 2, 7]),
        max_seqlen_q=7, max_seqlen_k=7), id="varlen")
    q, k, v = random_qkv(1, 6, 9, 2, 2, headdim=16)
    bias = torch.randn(1, 1, 6, 9).expand(1, 1, 6, 9)
    yield pytest.param(q, k, v, AttentionParams(softmax_scale=0.25, attn_bias=bias), id="bias")


@pytest.mark.parametrize(("q", "k", "v", "params"), list(_op_inputs()))
def test_opcheck(q, k, v, params):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(torch.ops.flashkit.attention_forward.default,
                          _forward_args(*leaves, params))
    # The backward op has no autograd formula of its own (no double backward): plain inputs.
    params = dataclasses.replace(params, sink=None if params.sink is None
                                 else params.sink.detach())
    out, lse = custom_op.attention(q, k, v, params, "torch")
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.library.opcheck(torch.ops.flashkit.attention_backward.default,
                          (dout, q, k, v, out, lse, dlse, *_forward_args(q, k, v, params)[3:]))


def test_op_signatures_follow_attention_params():
    """custom_op.py passes AttentionParams' fields positionally: names and order must agree."""
    fields = [f.name for f in dataclasses.fields(AttentionParams) if f.name != "variant"]
    forward = [a.name for a in torch.ops.flashkit.attention_forward.default._schema.arguments]
    backward = [a.name for a in torch.ops.flashkit.attention_backward.default._schema.arguments]
    assert forward == ["q", "k", "v", *fields, "backend"]
    assert backward == ["dout", "q", "k", "v", "out", "lse", "dlse", *fields, "backend"]
