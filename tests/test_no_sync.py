"""No host-device synchronisation on the Triton paths (dense, varlen, a decoding step), forward
and backward, unless the caller asks for host checks (sync_checks=True): checked with
torch.cuda.set_sync_debug_mode("error"), which raises at any synchronising CUDA call."""

from __future__ import annotations

import contextlib

import pytest
import torch

import flashkit
from helpers import cu_seqlens

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def syncs_raise():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _grad_inputs(*shape):
    return [torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for _ in range(3)]


def _dense_step(q, k, v):
    out = flashkit.flash_attn_func(q, k, v, causal=True)
    out.backward(torch.ones_like(out))


def _varlen_step(q, k, v, cu, max_seqlen, **kwargs):
    out = flashkit.flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True,
                                          **kwargs)
    out.backward(torch.ones_like(out))


@pytest.mark.parametrize("seqlen", [128, 1000])
def test_dense_forward_backward_never_sync(seqlen):
    q, k, v = _grad_inputs(2, seqlen, 8, 64)
    _dense_step(q, k, v)  # compiles the kernels (may synchronise)
    with syncs_raise():
        _dense_step(q, k, v)


def test_varlen_forward_backward_never_sync():
    lengths = [5, 0, 300, 77]
    cu = cu_seqlens(lengths).cuda()
    q, k, v = _grad_inputs(sum(lengths), 8, 128)
    _varlen_step(q, k, v, cu, 300)
    with syncs_raise():
        _varlen_step(q, k, v, cu, 300)
    with pytest.raises(RuntimeError), syncs_raise():  # host checks read cu_seqlens: a sync
        _varlen_step(q, k, v, cu, 300, sync_checks=True)


def test_decode_step_never_syncs():
    batch, d = 4, 128
    q = torch.randn(batch, 1, 32, d, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(batch, 4096, 4, d, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    k_new, v_new = (torch.randn(batch, 1, 4, d, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
    lens = torch.tensor([1, 1000, 4000, 17], dtype=torch.int32, device="cuda")

    def step():
        with torch.no_grad():
            flashkit.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                             cache_seqlens=lens, causal=True)

    step()
    with syncs_raise():
        step()
