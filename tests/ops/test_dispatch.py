"""The Triton backend's front door (flashkit.ops.triton.dispatch): each choice logs the kernel
that ran and why the others declined, is cached per plan key, and FLASHKIT_LOG_DISPATCH=1
turns the log on."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import flashkit
from flashkit import variants
from flashkit.ops.triton import ahead, dispatch, hopper_common
from flashkit.variants.mods import Variant
from helpers import random_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels' (else interpreted)


@pytest.mark.usefixtures("fresh_plans")
def test_log_names_the_kernel_and_the_declines(caplog):
    q, k, v = (t.to(DEVICE).requires_grad_() for t in random_qkv(1, 5, 5, 2, headdim=16))
    with caplog.at_level(logging.DEBUG, logger="flashkit.dispatch"):
        flashkit.flash_attn_func(q, k, v, causal=True, backend="triton").sum().backward()
    messages = [r.getMessage() for r in caplog.records if r.name == "flashkit.dispatch"]
    assert messages[0].startswith("forward ran triton; declined: decode: 5 keys < ")
    assert "; gluon: " in messages[0]
    assert messages[1].startswith("backward ran triton; declined: gluon: ")
    assert "gluon as varlen: " in messages[1]


@pytest.mark.usefixtures("fresh_plans")
def test_choices_are_cached_per_key():
    q, k, v = (t.to(DEVICE) for t in random_qkv(1, 5, 5, 2, headdim=16))
    for _ in range(3):
        flashkit.flash_attn_func(q, k, v, backend="triton")
    assert len(dispatch._plans) == 1
    flashkit.flash_attn_func(q, k, v, causal=True, backend="triton")  # a new feature flag
    assert len(dispatch._plans) == 2


def test_environment_variable_turns_the_log_on():
    code = ("import torch, flashkit; q = torch.randn(1, 3, 1, 16); "
            "flashkit.flash_attn_func(q, q, q, backend='triton')")
    env = dict(os.environ, FLASHKIT_LOG_DISPATCH="1", TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    assert "forward ran triton; declined: decode: " in run.stderr
    assert "; gluon: " in run.stderr
    assert torch.cuda.is_available() or "no Gluon" in run.stderr


def test_backward_reads_an_expanded_dout_as_a_contiguous_copy(monkeypatch):
    """out.sum().backward() hands the backward an expanded dout (stride 0), which the TMA
    kernels cannot read: the Triton backend passes a contiguous copy to the kernel choice."""
    seen, backward_call = [], dispatch.backward_call

    def spy(dout, *args, **kwargs):
        if not ahead.active():  # not a first call compiling its backward ahead
            seen.append(dout)
        return backward_call(dout, *args, **kwargs)

    monkeypatch.setattr(dispatch, "backward_call", spy)
    q, k, v = (torch.randn(1, 20, 2, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    flashkit.flash_attn_func(q, k, v, causal=True, backend="triton").sum().backward()
    assert len(seen) == 1 and seen[0].is_contiguous() and 0 not in seen[0].stride()


def test_the_plan_key_holds_every_field_a_launch_reads():
    """A launch plan bakes params' values into its prepared launches, so two params that differ
    in any field but the dropout seed (passed per call) and a tensor's contents must differ in
    the key: a new AttentionParams field fails this until dispatch._values reads it."""
    import dataclasses

    from flashkit.ops.params import AttentionParams

    base = AttentionParams(0.125, window_left=3, window_right=0, softcap=5.0,
                           alibi_slopes=torch.rand(4), sink=torch.randn(4), dropout_p=0.1,
                           dropout_seed=7, cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32),
                           cu_seqlens_k=torch.tensor([0, 5], dtype=torch.int32),
                           max_seqlen_q=5, max_seqlen_k=5)
    changed = dict(softmax_scale=0.25, window_left=None, window_right=None, softcap=0.0,
                   alibi_slopes=torch.rand(2, 4), sink=torch.randn(4, dtype=torch.float16),
                   attn_bias=torch.zeros(1, 4, 5, 5), dropout_p=0.0,
                   cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
                   cu_seqlens_k=torch.tensor([0, 1, 5], dtype=torch.int32), max_seqlen_q=3,
                   max_seqlen_k=4, deterministic=True,
                   variant=Variant(mask_mod=variants.causal_mask()))
    per_call = {"dropout_seed"}
    fields = {f.name for f in dataclasses.fields(AttentionParams)}
    assert fields == set(changed) | per_call, "a new AttentionParams field: add it here"
    for name, value in changed.items():
        assert dispatch._values(dataclasses.replace(base, **{name: value})) != \
            dispatch._values(base), name
    same = dataclasses.replace(base, dropout_seed=8, alibi_slopes=torch.rand(4),
                               sink=torch.randn(4))
    assert dispatch._values(same) == dispatch._values(base)


def test_the_plan_key_tells_user_modifiers_apart_but_not_their_tensors():
    """A plan's launches compile in a user's functions, its captured numbers and dtypes and a
    block mask's geometry, and the Gluon backward takes no gradients for captured tensors:
    calls that differ in any of these must not share a plan. Calls that differ only in the
    captured tensors' or the mask lists' contents do: each call passes its own to the
    launches."""
    import dataclasses

    from flashkit.ops.params import AttentionParams

    base = AttentionParams(0.125)
    masks = [flashkit.create_block_mask(variants.causal_mask(), None, None, 64, 64, device="cpu",
                                        BLOCK_SIZE=block) for block in (32, (32, 16))]
    table = torch.randn(2, 5)
    kinds = [Variant(score_mod=variants.softcap(5.0)), Variant(mask_mod=variants.causal_mask()),
             *[Variant(mask_mod=variants.causal_mask(), block_mask=m) for m in masks],
             Variant(score_mod=variants.relative_bias(table), captured_grads=[table, None]),
             None]
    kinds += [Variant(score_mod=variants.softcap(6.0)),  # another captured number
              Variant(score_mod=variants.relative_bias(table)),
              Variant(score_mod=variants.relative_bias(table.double())),  # another dtype
              Variant(mask_mod=variants.causal_mask(), block_mask=flashkit.create_block_mask(
                  variants.causal_mask(), None, None, 64, 96, device="cpu", BLOCK_SIZE=32))]
    keys = [dispatch._values(dataclasses.replace(base, variant=v)) for v in kinds]
    assert len(set(keys)) == len(kinds)
    same = [Variant(score_mod=variants.relative_bias(torch.randn(2, 5))),
            Variant(mask_mod=variants.causal_mask(), block_mask=flashkit.create_block_mask(
                variants.causal_mask(), None, None, 64, 64, device="cpu", BLOCK_SIZE=32))]
    for at, variant in zip((-3, 2), same, strict=True):
        assert dispatch._values(dataclasses.replace(base, variant=variant)) == keys[at]


@pytest.mark.usefixtures("fresh_plans")
def test_a_kept_call_without_grad_runs_its_kept_forward_plan(caplog, monkeypatch):
    """flash_attn_func keeps, with a call's checked arguments, the forward plan its first run
    without grad chose (dispatch.PlannedForward): an equal call runs it without the dispatch's
    key, gives what the first gave and logs the choice. A call with another layout and a call
    after forget_plans go through the dispatch; one with grad runs the kept plan too."""
    from flashkit import api

    monkeypatch.setattr(api, "_DENSE_CALLS", {})
    chosen, choose = [], dispatch._choose
    monkeypatch.setattr(dispatch, "_choose", lambda op, *a: chosen.append(op) or choose(op, *a))
    q, k, v = (t.to(DEVICE) for t in random_qkv(2, 37, 45, 2, headdim=16))

    def call(*qkv):
        return flashkit.flash_attn_func(*qkv, causal=True, backend="triton")

    with torch.no_grad():
        first = call(q, k, v)
        planned = len(chosen)  # the call's choice, then the plan's lookup to keep it
        (kept_call,) = api._DENSE_CALLS.values()
        assert isinstance(kept_call.forward, dispatch.PlannedForward)
        with caplog.at_level(logging.DEBUG, logger="flashkit.dispatch"):
            again = call(q, k, v)
        assert len(chosen) == planned  # the kept plan ran
        assert torch.equal(again, first)
        assert [r.getMessage()[:18] for r in caplog.records] == ["forward ran triton"]
        strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, other strides
        assert torch.equal(call(strided, k, v), first)
        assert len(chosen) == 2 * planned and len(api._DENSE_CALLS) == 2
        dispatch.forget_plans()
        assert torch.equal(call(q, k, v), first)
        assert len(chosen) == 3 * planned
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    assert torch.equal(call(*leaves), first)
    assert len(chosen) == 3 * planned


@pytest.mark.usefixtures("fresh_plans")
def test_a_kept_call_with_grad_runs_its_kept_forward_and_backward_plans(caplog, monkeypatch):
    """A kept call whose q, k or v needs a gradient runs the kept forward plan under autograd,
    and its backward the backward plan that the first such backward chose, kept with the
    forward plan (PlannedForward.backward): no dispatch key, the same gradients, the choice
    logged. A dout of another layout (off 16 bytes) and a backward after forget_plans choose
    again; an lse gradient is part of the key."""
    from flashkit import api

    monkeypatch.setattr(api, "_DENSE_CALLS", {})
    chosen, choose = [], dispatch._choose
    monkeypatch.setattr(dispatch, "_choose", lambda op, *a: chosen.append(op) or choose(op, *a))
    # a GPU's first call of a plan with grad would also choose its backward to compile it
    # ahead (test_compile_ahead.py): the same choices on every device
    monkeypatch.setattr(dispatch, "_compiles_ahead", lambda q, k, v: False)
    leaves = [t.to(DEVICE).requires_grad_() for t in random_qkv(2, 37, 45, 2, headdim=16)]
    dout = torch.randn(2, 37, 2, 16, device=DEVICE)

    def step(dout=dout, lse_grad=False):
        out, lse = flashkit.flash_attn_func(*leaves, causal=True, backend="triton",
                                            return_softmax_lse=True)
        outputs, grads = (out, lse), (dout, torch.ones_like(lse))
        if not lse_grad:
            outputs, grads = out, dout
        return out, torch.autograd.grad(outputs, leaves, grads)

    first, first_grads = step()  # the dispatch chooses; the forward plan is kept
    assert chosen == ["forward", "forward", "backward"]  # the call's, the plan's to keep it
    (kept_call,) = api._DENSE_CALLS.values()
    planned = kept_call.forward
    assert isinstance(planned, dispatch.PlannedForward) and not planned.backwards
    chosen.clear()
    out, grads = step()  # the kept forward plan; the backward chooses (a plan lookup) and keeps
    assert chosen == ["backward"] and len(planned.backwards) == 1
    with caplog.at_level(logging.DEBUG, logger="flashkit.dispatch"):
        again, again_grads = step()
    assert chosen == ["backward"]  # both kept plans ran
    assert [r.getMessage()[:19] for r in caplog.records] == ["forward ran triton;",
                                                              "backward ran triton"]
    for result in (out, again):
        assert torch.equal(result, first)
    for result in (grads, again_grads):
        assert all(torch.equal(a, b) for a, b in zip(result, first_grads, strict=True))
    step(dout=torch.ones((), device=DEVICE).expand(2, 37, 2, 16))  # read as a contiguous copy
    assert chosen == ["backward"] and len(planned.backwards) == 1
    misaligned = torch.empty(dout.numel() + 1, device=DEVICE)[1:].view(dout.shape)
    misaligned.copy_(dout)  # its address off 16 bytes: another key
    _, moved = step(dout=misaligned)
    assert chosen == ["backward"] * 2 and len(planned.backwards) == 2
    assert all(torch.equal(a, b) for a, b in zip(moved, first_grads, strict=True))
    _, with_lse = step(lse_grad=True)
    assert chosen == ["backward"] * 3 and len(planned.backwards) == 3
    assert not torch.equal(with_lse[0], first_grads[0])
    dispatch.forget_plans()  # retires the kept plans: the dispatch chooses again
    _, forgotten = step()
    assert chosen == ["backward"] * 3 + ["forward", "forward", "backward"]
    assert all(torch.equal(a, b) for a, b in zip(forgotten, first_grads, strict=True))


@pytest.mark.usefixtures("fresh_plans")
def test_a_strided_call_runs_the_flash_layout_kernels_on_contiguous_copies(caplog, monkeypatch):
    """Where only the layout of q, k or v keeps the Gluon kernels from a call (a head dim
    sliced out of a wider tensor: no 2-D view reads it), the dispatch runs them on
    contiguous copies: forward and backward, the kept plans included, with the results and
    gradients of the same call on contiguous inputs, nothing the caller passed changed. The
    Gluon kernels are stood in for by the portable ones behind a predicate that takes the flash
    layout alone (the interpreter cannot run Gluon)."""
    from flashkit.ops.triton import backward_hopper, forward_hopper

    forward, backward = dispatch.forward, dispatch.backward  # the kernels' modules
    seen = []

    def layout_only(q, k, v, *args, copies=False):
        return None if copies or all(x.is_contiguous() for x in (q, k, v)) else "the layout"

    def gluon_forward(q, k, v, params, out=None, lse=None, plan=None):
        seen.append(("forward", all(x.is_contiguous() for x in (q, k, v))))
        return forward.attention_forward(q, k, v, params, out=out, lse=lse)

    portable_backward = backward.attention_backward

    def gluon_backward(dout, q, k, v, out, lse, params, dq, dk, dv, dlse=None, gluon=False,
                       own_lse=True, plan=None):
        seen.append(("backward", gluon and all(x.is_contiguous() for x in (q, k, v))))
        return portable_backward(dout, q, k, v, out, lse, params, dq, dk, dv, dlse=dlse,
                                 own_lse=own_lse)

    monkeypatch.setattr(forward_hopper, "declines", lambda q, k, v, *a, copies=False:
                        layout_only(q, k, v, copies=copies))
    monkeypatch.setattr(backward_hopper, "declines", lambda q, k, v, *a, copies=False:
                        layout_only(q, k, v, copies=copies))
    monkeypatch.setattr(backward_hopper, "as_varlen_declines",
                        lambda *a, copies=False: "lengths on the tiles")
    monkeypatch.setattr(forward_hopper, "attention_forward", gluon_forward)
    monkeypatch.setattr(backward, "attention_backward", gluon_backward)
    monkeypatch.setattr(dispatch, "_compiles_ahead", lambda q, k, v: False)
    monkeypatch.setattr(dispatch, "GLUON_COPIES_MIN_QUERIES", 24)  # at the interpreter's sizes

    q, k, v = (t.to(DEVICE) for t in random_qkv(2, 24, 24, 4, nheads_k=2, headdim=16))
    # each one the first half of a head dim twice as wide
    strided = [torch.cat((x, x), dim=-1)[..., :x.shape[-1]].requires_grad_() for x in (q, k, v)]
    assert not any(hopper_common.tma_layout(x) for x in strided)
    before = [x.detach().clone() for x in strided]
    plain = [x.clone().requires_grad_() for x in (q, k, v)]
    dout = torch.randn_like(q)
    expected = flashkit.flash_attn_func(*plain, causal=True, backend="triton")
    expected_grads = torch.autograd.grad(expected, plain, dout)
    for _ in range(3):  # the first call plans; later equal calls run the kept plans
        seen.clear()
        with caplog.at_level(logging.DEBUG, logger="flashkit.dispatch"):
            out = flashkit.flash_attn_func(*strided, causal=True, backend="triton")
            grads = torch.autograd.grad(out, strided, dout)
        assert seen == [("forward", True), ("backward", True)]
        assert torch.equal(out, expected)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(strided, before, strict=True))
    messages = [r.getMessage() for r in caplog.records if r.name == "flashkit.dispatch"]
    assert any(m.startswith("forward ran gluon on contiguous copies;") for m in messages)
    assert any(m.startswith("backward ran gluon on contiguous copies;") for m in messages)
    # fewer query rows than GLUON_COPIES_MIN_QUERIES: a copy would cost what the attention
    # does, so the portable kernels read the strides
    seen.clear()
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="flashkit.dispatch"):
        flashkit.flash_attn_func(strided[0][:, :23].detach(), *(x.detach() for x in strided[1:]),
                                 causal=True, backend="triton")
    assert seen == []
    assert "23 query rows < 24" in caplog.records[-1].getMessage()
