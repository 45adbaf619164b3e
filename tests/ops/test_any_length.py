"""A decoding step over a cache one key longer each call (transformers' DynamicCache reaching
flash_attn_func heads-major): one plan runs every key length of the call's class.

On the CPU: the Gluon forward's launch for every key length passes, at each length, what a
launch made for that length alone passes (scalars, descriptors, constexprs but KEY_TAIL), the
decode kernel's gives what a launch made for that length alone gives (the interpreter), and
flash_attn_func keeps one such plan per class, runs every later length through it, and leaves
to the checks and the dispatch whatever the plan cannot run (another length of v, gradients,
128 heads, a plan that declines). On an sm_90 GPU: a decoding loop gives, step by step, bitwise
what the dispatch's plan for each length gives, and the oracle's results within DESIGN
section 5's rule.
"""

from __future__ import annotations

import pytest
import torch

from flashkit import api, flash_attn_func
from flashkit.ops.triton import dispatch
from helpers import ON_HOPPER, check_against_oracle

gluon_forward = pytest.importorskip("flashkit.ops.triton.forward_hopper")


def _cache(batch, length, heads_k, head_dim, heads_major, dtype=torch.bfloat16, device="cpu"):
    """A key or value cache as a model's decoding step passes it: (batch, length, heads_k, d),
    heads-major memory (a DynamicCache's torch.cat result seen through transpose(1, 2)) or
    contiguous."""
    if heads_major:
        return torch.randn(batch, heads_k, length, head_dim, dtype=dtype,
                           device=device).transpose(1, 2)
    return torch.randn(batch, length, heads_k, head_dim, dtype=dtype, device=device)


@pytest.mark.skipif(gluon_forward.gluon is None, reason="a Triton without Gluon")
@pytest.mark.parametrize("heads_major", [True, False], ids=["heads-major", "contiguous"])
@pytest.mark.parametrize("softcap, window", [(0.0, (-1, -1)), (30.0, (-1, -1)), (0.0, (64, 0))],
                         ids=["plain", "softcap", "window"])
def test_the_launch_for_every_length_passes_each_length_what_its_own_launch_passes(
        heads_major, softcap, window):
    """One launch per specialisation of (seqlen_k, kv_geo) and per whether the window's left
    edge cuts the keys, made at the first length of each: at every later length of the same
    kind, with that length's values passed, it passes what that length's own launch passes."""
    from flashkit.ops.triton.features import cuts_left
    from flashkit.ops.triton.hopper_common import view_geometry
    from flashkit.ops.triton.launch import _rebased, specialisation

    q = torch.randn(2, 8, 1, 128, dtype=torch.bfloat16).transpose(1, 2)
    params = api.build_params(q, 0.0, None, True, window, softcap, None, False, None,
                              batch=2)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(2, 8, 1)

    def prepare(k, v, any_length):
        return gluon_forward._prepare(q, k, v, params, out, lse, None, None, None, any_length)

    made, compared = {}, set()
    for length in (2, 3, 15, 17, 16, 48, 8, 24, 63, 64, 65, 66, 67, 80, 127, 128, 129, 136,
                   1000, 1001, 1008, 4095):
        k, v = _cache(2, length, 2, 128, heads_major), _cache(2, length, 2, 128, heads_major)
        keys = (length, view_geometry(k))
        name = (*specialisation(keys), cuts_left(params, length))
        if name not in made:
            made[name] = prepare(k, v, True)
            continue
        every, own = made[name], prepare(k, v, False)
        compared.add(name)
        scalars = list(every.scalars)
        for at, value in zip(every.varying[2:], keys, strict=True):
            scalars[at] = value
        assert tuple(scalars) == own.scalars, length
        names = list(every.constexprs)
        assert every.grid == own.grid and list(own.constexprs) == names
        assert {n: every.constexprs[n] for n in names if n != "KEY_TAIL"} == {
            n: own.constexprs[n] for n in names if n != "KEY_TAIL"}
        assert every.constexprs["KEY_TAIL"]  # a last tile that is full zeroes nothing
        for i, x in ((0, q), (1, k), (2, v)):
            got = _rebased(every.descriptors[i], x, every.sized.get(i, 0))
            want = _rebased(own.descriptors[i], x)
            assert (got.shape, got.strides, got.block_shape, got.layout) == (
                want.shape, want.strides, want.block_shape, want.layout)
            assert got.base.data_ptr() == want.base.data_ptr()
    assert compared == set(made)  # every kind met at two lengths at least
    assert len({name[-1] for name in made}) == (2 if window[0] >= 0 else 1)


@pytest.mark.parametrize("heads_major", [True, False], ids=["heads-major", "contiguous"])
@pytest.mark.parametrize("window", [(-1, -1), (40, 0)], ids=["causal", "window"])
def test_the_decode_kernel_for_every_length_gives_each_lengths_own_launch(heads_major, window):
    """The decode kernel's plan for every key length (the interpreter): a launch shape per
    key-tile count, launches per shape, the cache strides' specialisation and whether the
    window's left edge cuts the keys (from 42 keys here), each call passing its strides and
    length, give bitwise what a launch made for that length alone gives."""
    from flashkit.ops.triton import decode

    torch.manual_seed(0)
    q = torch.randn(2, 4, 1, 32).transpose(1, 2)
    params = api.build_params(q, 0.0, None, True, window, 0.0, None, False, None, batch=2)
    plan = {}
    lengths = (40, 41, 48, 63, 64, 65, 96, 97, 200, 41)
    for length in lengths:
        k, v = (_cache(2, length, 2, 32, heads_major, torch.float32) for _ in range(2))
        out, lse = decode.dense(q, k, v, params, plan=plan, any_length=True)
        own_out, own_lse = decode.dense(q, k, v, params)
        assert torch.equal(out, own_out) and torch.equal(lse, own_lse), length
    blocks = sorted({name[1] for name in plan if name[0] == "shape"})
    assert blocks == sorted({-(-n // 32) for n in lengths})  # one shape per key-tile count
    shapes = {plan[name] for name in plan if name[0] == "shape"}
    launches = [name for name in plan if name[0] == "decode"]
    assert {name[1] for name in launches} == shapes  # key-tile counts of one shape share


class _Recorder:
    """Stands in for the Triton backend's plan for every key length: made once per class
    (made: the length it was made at), then called for each later call (ran: their lengths);
    it computes through the dispatch, or declines (returns None) when told to."""

    def __init__(self):
        self.made, self.ran, self.declines = [], [], False

    def any_length_forward(self, planned, q, k, v, params, kept=None):
        assert isinstance(planned, dispatch.PlannedForward) and planned.live
        assert kept in (None, self)
        self.made.append(k.shape[1])
        return self

    def __call__(self, params, q, k, v):
        self.ran.append(k.shape[1])
        return None if self.declines else dispatch.forward_call(q, k, v, params)


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(dispatch, "any_length_forward", rec.any_length_forward)
    for name in ("_DENSE_CALLS", "_ANY_LENGTH_CALLS"):
        monkeypatch.setattr(api, name, {})
    return rec


def _step(q, k, v, **kwargs):
    return flash_attn_func(q, k, v, causal=True, backend="triton", **kwargs)


def test_a_growing_cache_runs_every_later_length_through_one_plan(recorder):
    q = torch.randn(1, 4, 1, 32).transpose(1, 2)
    for length in range(20, 26):
        k, v = (_cache(1, length, 2, 32, True, torch.float32) for _ in range(2))
        check_against_oracle(
            lambda **kw: flash_attn_func(**kw, backend="triton", return_softmax_lse=True),
            dict(q=q, k=k, v=v, causal=True), grads=False)
    assert recorder.made == [20] and recorder.ran == list(range(21, 26))
    assert len(api._DENSE_CALLS) == 1 and len(api._ANY_LENGTH_CALLS) == 1


def test_what_the_plan_cannot_run_takes_the_checks_and_the_dispatch(recorder):
    q = torch.randn(1, 1, 4, 32)
    k, v = torch.randn(1, 20, 2, 32), torch.randn(1, 20, 2, 32)
    _step(q, k, v)
    assert recorder.made == [20]
    with pytest.raises(ValueError, match="v: seqlen 21 differs from k's 22"):
        _step(q, torch.randn(1, 22, 2, 32), torch.randn(1, 21, 2, 32))
    k2, v2 = torch.randn(1, 23, 2, 32), torch.randn(1, 23, 2, 32)
    _step(q.clone().requires_grad_(), k2, v2).sum().backward()  # gradients: the dispatch's
    assert recorder.ran == []
    recorder.declines = True  # forgotten plans, another device: the dispatch runs the call
    k3, v3 = torch.randn(1, 24, 2, 32), torch.randn(1, 24, 2, 32)
    check_against_oracle(
        lambda **kw: flash_attn_func(**kw, backend="triton", return_softmax_lse=True),
        dict(q=q, k=k3, v=v3, causal=True), grads=False)
    assert recorder.ran == [24]


def test_many_heads_take_no_plan_for_every_length(recorder):
    """With 128 query heads or more, whether the checks warn of SDPA's layout depends on the
    key length: every new length takes the checks."""
    q = torch.randn(1, 1, 128, 8)
    for length in (4, 5):
        _step(q, torch.randn(1, length, 2, 8), torch.randn(1, length, 2, 8))
    assert recorder.made == [] and api._ANY_LENGTH_CALLS == {}


# --- on the GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("heads_major", [True, False], ids=["heads-major", "contiguous"])
@pytest.mark.parametrize("head_dim, softcap, window", [
    (64, 0.0, (-1, -1)), (128, 30.0, (-1, -1)), (128, 0.0, (-1, -1)), (128, 0.0, (1000, 0))])
def test_gpu_a_decoding_loop_over_a_growing_cache(heads_major, head_dim, softcap, window,
                                                   monkeypatch):
    """Each step of a loop over lengths that cross 16-, 64- and 128-key multiples, the decode
    kernel's threshold and its split counts (and where a window's left edge starts to cut the
    keys), gives bitwise what the dispatch's plan for that
    length gives, and the oracle's result; the steps run through two plans, the Gluon
    forward's below the threshold and the decode kernel's from there."""
    monkeypatch.setattr(api, "_ANY_LENGTH_CALLS", {})
    torch.manual_seed(0)
    q = torch.randn(2, 8, 1, head_dim, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    params = api.build_params(q, 0.0, None, True, window, softcap, None, False, None,
                              batch=2)
    lengths = [*range(120, 136), 255, 256, 257, 1000, 1001, 1002, 1003, 4094, 4095, 4096,
               4097, 4160, 8191, 8192, 8193, 16000, 200]
    for step, length in enumerate(lengths):
        k, v = (_cache(2, length, 2, head_dim, heads_major, device="cuda") for _ in range(2))
        out, lse = flash_attn_func(q, k, v, causal=True, softcap=softcap, window_size=window,
                                   return_softmax_lse=True)
        own_out, own_lse = dispatch.forward_call(q, k, v, params)
        assert torch.equal(out, own_out) and torch.equal(lse, own_lse), length
        if step % 5 == 0 or length >= 4094:
            check_against_oracle(lambda **kw: flash_attn_func(**kw, return_softmax_lse=True),
                                 dict(q=q, k=k, v=v, causal=True, softcap=softcap,
                                      window_size=window), grads=False)
    (kept_call,) = api._ANY_LENGTH_CALLS.values()
    below, above = kept_call.forward.plans
    assert below.kernel == "gluon" and above.kernel == "decode"
    assert 1 <= len(below.launches) <= 4  # one launch per specialisation of the key length
