"""Any batch x heads and any number of varlen sequences: the kernels fold their (batch, head)
programs into grid dims y and z (flashkit.ops.triton.launch.fold), so no grid dim passes CUDA's
limit of 65535. On CPU the limit is lowered (launch.MAX_GRID_YZ) so tiny problems fold; on a GPU
the real sizes run."""

from __future__ import annotations

import pytest
import torch

import flashkit
from flashkit.ops.triton import launch
from helpers import api_attention, check_against_oracle, cu_seqlens, random_qkv, random_varlen


def triton_attention(**inputs):
    return api_attention(backend="triton", **inputs)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("n", "limit", "folded"), [
    (12, 5, (4, 3)), (7, 7, (7, 1)), (70000, 65535, (35000, 2)), (17000 * 4, 65535, (34000, 2)),
])
def test_fold(n, limit, folded, monkeypatch):
    monkeypatch.setattr(launch, "MAX_GRID_YZ", limit)
    y, z = launch.fold(n)
    assert (y, z) == folded and y * z == n and max(y, z) <= limit


def test_fold_refuses_a_prime_past_the_limit(monkeypatch):
    monkeypatch.setattr(launch, "MAX_GRID_YZ", 5)
    with pytest.raises(NotImplementedError, match="batch x heads = 7"):
        launch.fold(7)


@pytest.fixture
def low_limit(monkeypatch):
    """Grid dims y and z of at most 4 programs: every launch below folds."""
    monkeypatch.setattr(launch, "MAX_GRID_YZ", 4)


def test_dense_folded_matches_oracle(low_limit):
    """b x h = 12 > 4: forward (y, z) = (4, 3), backward's dK/dV over b x hk = 6 = (3, 2)."""
    q, k, v = (t.to(DEVICE) for t in random_qkv(3, 9, 11, 4, 2, headdim=16))
    check_against_oracle(triton_attention, dict(q=q, k=k, v=v, causal=True))


def test_varlen_folded_matches_oracle(low_limit):
    """6 sequences x 2 heads = 12 programs per query block."""
    inputs = random_varlen([3, 1, 0, 5, 2, 4], [2, 6, 1, 5, 3, 4], nheads=2, headdim=16)
    check_against_oracle(triton_attention, {name: t.to(DEVICE) if isinstance(t, torch.Tensor)
                                            else t for name, t in inputs.items()})


def test_decode_folded_matches_oracle(low_limit):
    """A decoding step of batch 6 x 2 kv heads = 12 > 4 (y, x) programs, split along the keys."""
    batch, nheads, nheads_k, d = 6, 4, 2, 16
    q = torch.randn(batch, 1, nheads, d, device=DEVICE)
    k_cache, v_cache = (torch.randn(batch, 40, nheads_k, d, device=DEVICE) for _ in range(2))
    lens = torch.tensor([3, 40, 17, 0, 29, 8], dtype=torch.int32, device=DEVICE)
    got, lse = flashkit.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                                num_splits=2, return_softmax_lse=True,
                                                backend="triton")
    want, want_lse = flashkit.flash_attn_with_kvcache(q.double(), k_cache.double(),
                                                      v_cache.double(), cache_seqlens=lens,
                                                      return_softmax_lse=True,
                                                      backend="reference")
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


# ---- GPU: the real limit ---------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 40])
def test_gpu_batch_times_heads_past_the_grid_limit(head_dim):
    """b x h = 4375 x 16 = 70000 (> 65535): forward and backward against the float32 reference
    on a slice and NaN-free everywhere."""
    q, k, v = (t.to(DEVICE, torch.bfloat16).requires_grad_()
               for t in random_qkv(4375, 8, 8, 16, 16, headdim=head_dim))
    out = flashkit.flash_attn_func(q, k, v, causal=True)
    out.backward(torch.ones_like(out))
    assert not any(torch.isnan(t).any() for t in (out, q.grad, k.grad, v.grad))
    ref = flashkit.reference.attention(*(t[-3:].detach().float() for t in (q, k, v)),
                                       causal=True)[0]
    torch.testing.assert_close(out[-3:].float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_70000_varlen_sequences():
    lengths = [1 + i % 5 for i in range(70000)]
    total = sum(lengths)
    q, k, v = (torch.randn(total, 2, 64, device=DEVICE, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    cu = cu_seqlens(lengths).to(DEVICE)
    out = flashkit.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    out.backward(torch.ones_like(out))
    assert not any(torch.isnan(t).any() for t in (out, q.grad, k.grad, v.grad))
    last = slice(int(cu[-2]), total)
    ref = flashkit.reference.attention(*(t[None, last].detach().float() for t in (q, k, v)),
                                       causal=True)[0][0]
    torch.testing.assert_close(out[last].float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_decode_batch_17000():
    """A decoding step at batch 17000 x 4 kv heads = 68000 programs per split."""
    batch, d = 17000, 64
    q = torch.randn(batch, 1, 32, d, device=DEVICE, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(batch, 64, 4, d, device=DEVICE, dtype=torch.bfloat16)
                        for _ in range(2))
    lens = torch.full((batch,), 50, dtype=torch.int32, device=DEVICE)
    out = flashkit.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)
    assert not torch.isnan(out).any()
    ref = flashkit.reference.attention(q[-2:].float(), k_cache[-2:, :50].float(),
                                       v_cache[-2:, :50].float())[0]
    torch.testing.assert_close(out[-2:].float(), ref, atol=2e-2, rtol=2e-2)
