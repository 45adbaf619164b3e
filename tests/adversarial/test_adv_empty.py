"""Empty inputs (batch 0, seqlen_q 0, seqlen_k 0, varlen sequences of length 0) give correctly
shaped results: out 0 and lse -inf for rows without keys, zero gradients, never NaN."""

import math

import pytest
import torch
from adversarial_support import BACKENDS, DEVICE, qkv, randn

import flashkit


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k", [(0, 3, 4), (1, 0, 4), (1, 3, 0)])
def test_dense_empty(backend, batch, seqlen_q, seqlen_k):
    q, k, v = (t.requires_grad_() for t in qkv(batch, seqlen_q, seqlen_k))
    out, lse, _ = flashkit.flash_attn_func(q, k, v, causal=True, return_attn_probs=True,
                                           backend=backend)
    assert out.shape == (batch, seqlen_q, 2, 16) and lse.shape == (batch, 2, seqlen_q)
    assert (out == 0).all() and (lse == -math.inf).all() if seqlen_k == 0 else True
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and torch.isfinite(t.grad).all()
    if seqlen_k == 0:
        assert (q.grad == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_zero_lengths(backend):
    cu_q = torch.tensor([0, 0, 3, 3], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 2, 2, 5], dtype=torch.int32, device=DEVICE)
    q, k, v = (t.requires_grad_() for t in (randn(3, 2, 16), randn(5, 2, 16), randn(5, 2, 16)))
    out = flashkit.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, backend=backend)
    assert (out == 0).all()  # the only query rows (sequence 1) have no keys
    out.sum().backward()
    for t in (q, k, v):
        assert (t.grad == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("append", [False, True])
def test_kvcache_batch_zero(backend, append):
    with torch.no_grad():
        kc, vc = randn(2, 16, 2, 16), randn(2, 16, 2, 16)
        before = kc.clone(), vc.clone()
        new = (randn(0, 1, 2, 16), randn(0, 1, 2, 16)) if append else (None, None)
        out, lse = flashkit.flash_attn_with_kvcache(
            randn(0, 1, 2, 16), kc, vc, *new,
            cache_seqlens=torch.zeros(0, dtype=torch.int32, device=DEVICE),
            return_softmax_lse=True, backend=backend)
    assert out.shape == (0, 1, 2, 16) and lse.shape == (0, 2, 1)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_kvcache_seqlen_q_zero_still_appends(backend):
    with torch.no_grad():
        kc, vc = randn(2, 16, 2, 16), randn(2, 16, 2, 16)
        k, v = randn(2, 2, 2, 16), randn(2, 2, 2, 16)
        seqlens = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)
        out, lse = flashkit.flash_attn_with_kvcache(randn(2, 0, 2, 16), kc, vc, k, v,
                                                    cache_seqlens=seqlens,
                                                    return_softmax_lse=True, backend=backend)
    assert out.shape == (2, 0, 2, 16) and lse.shape == (2, 2, 0)
    assert torch.equal(kc[0, 3:5], k[0]) and torch.equal(vc[1, 9:11], v[1])
