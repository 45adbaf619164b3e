"""The Triton backend's front door (flashkit.ops.triton.dispatch): each choice logs the kernel
that ran and why the others declined, is cached per plan key, and FLASHKIT_LOG_DISPATCH=1
turns the log on."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import torch

import flashkit
from flashkit.ops.triton import dispatch
from helpers import random_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels' (else interpreted)


def test_log_names_the_kernel_and_the_declines(caplog, monkeypatch):
    monkeypatch.setattr(dispatch, "_plans", {})
    q, k, v = (t.to(DEVICE).requires_grad_() for t in random_qkv(1, 5, 5, 2, headdim=16))
    with caplog.at_level(logging.DEBUG, logger="flashkit.dispatch"):
        flashkit.flash_attn_func(q, k, v, causal=True, backend="triton").sum().backward()
    messages = [r.getMessage() for r in caplog.records if r.name == "flashkit.dispatch"]
    assert messages[0].startswith("forward ran triton; declined: gluon: ")
    assert messages[1].startswith("backward ran triton; declined: gluon: ")
    assert "gluon as varlen: " in messages[1]


def test_choices_are_cached_per_key(monkeypatch):
    monkeypatch.setattr(dispatch, "_plans", {})
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
    assert "forward ran triton; declined: gluon: " in run.stderr
    assert torch.cuda.is_available() or "no Gluon" in run.stderr


def test_backward_reads_an_expanded_dout_as_a_contiguous_copy(monkeypatch):
    """out.sum().backward() hands the backward an expanded dout (stride 0), which the TMA
    kernels cannot read: the Triton backend passes a contiguous copy to the kernel choice."""
    seen, backward_call = [], dispatch.backward_call

    def spy(dout, *args, **kwargs):
        seen.append(dout)
        return backward_call(dout, *args, **kwargs)

    monkeypatch.setattr(dispatch, "backward_call", spy)
    q, k, v = (torch.randn(1, 20, 2, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    flashkit.flash_attn_func(q, k, v, causal=True, backend="triton").sum().backward()
    assert len(seen) == 1 and seen[0].is_contiguous() and 0 not in seen[0].stride()
