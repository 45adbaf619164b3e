"""Overlapping memory: inputs with stride 0 are read correctly; a cache the append would write
through overlapping elements, the same tensor as k_cache and v_cache, or a written page shared
between sequences are rejected, and the rejected call leaves the cache bit for bit unchanged."""

import pytest
import torch
from adversarial_support import BACKENDS, DEVICE, qkv, randn, rejects

import flashkit


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_inputs_read_correctly(backend):
    q, k, v = qkv(batch=1)
    expanded = [t.expand(3, *t.shape[1:]) for t in (q, k, v)]
    out = flashkit.flash_attn_func(*expanded, causal=True, backend=backend)
    one = flashkit.flash_attn_func(q, k, v, causal=True, backend=backend)
    assert (out - one).abs().max() < 1e-6  # each batch entry reads the same memory


def _append(backend, kc, vc, **kwargs):
    q = randn(2, 1, 2, 16)
    return lambda: flashkit.flash_attn_with_kvcache(
        q, kc, vc, randn(2, 1, 2, 16), randn(2, 1, 2, 16), backend=backend, sync_checks=True,
        **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_cache_append_rejected(backend):
    with torch.no_grad():
        seqlens = torch.tensor([3, 4], dtype=torch.int32, device=DEVICE)
        kc = randn(1, 16, 2, 16).expand(2, 16, 2, 16)
        vc = randn(2, 16, 2, 16)
        rejects(ValueError, "k_cache", _append(backend, kc, vc, cache_seqlens=seqlens), kc, vc)
        kc2 = randn(2, 16, 1, 16).expand(2, 16, 2, 16)  # heads share memory
        rejects(ValueError, "v_cache", _append(backend, vc, kc2, cache_seqlens=seqlens), vc, kc2)
        rejects(ValueError, "v_cache", _append(backend, vc, vc, cache_seqlens=seqlens), vc)
        # without an append nothing is written: an expanded cache is fine to read
        out = flashkit.flash_attn_with_kvcache(randn(2, 1, 2, 16), kc, vc, cache_seqlens=seqlens,
                                               backend=backend)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_written_page_rejected(backend):
    with torch.no_grad():
        kc, vc = randn(4, 16, 2, 16), randn(4, 16, 2, 16)
        seqlens = torch.tensor([20, 20], dtype=torch.int32, device=DEVICE)
        table = torch.tensor([[0, 1], [2, 1]], dtype=torch.int32, device=DEVICE)  # both write 1
        rejects(ValueError, "block_table", _append(backend, kc, vc, cache_seqlens=seqlens,
                                                   block_table=table), kc, vc, table)
        twice = torch.tensor([[1, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
        rejects(ValueError, "block_table", _append(backend, kc, vc, cache_seqlens=seqlens,
                                                   block_table=twice), kc, vc, twice)
        # a shared read-only prefix page (page 0, full, written by neither) is allowed
        prefix = torch.tensor([[0, 1], [0, 2]], dtype=torch.int32, device=DEVICE)
        _append(backend, kc, vc, cache_seqlens=seqlens, block_table=prefix)()
