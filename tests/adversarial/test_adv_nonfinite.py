"""NaN and inf in each input. The contract: a key a row cannot see (outside its band, past its
sequence, a cache slot past the filled length) changes nothing in that row, even if its key or
value is NaN or inf; a row with no visible key gives out 0 and lse -inf. A non-finite value in a
position a row does see makes that row's output non-finite (NaN, or inf where the math gives it)."""

import math

import pytest
import torch
from adversarial_support import BACKENDS, DEVICE, qkv, randn

import flashkit


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arg", ["k", "v"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_masked_key_or_value_changes_nothing(backend, arg, bad):
    # seqlen_q 7 > seqlen_k 5, causal: rows 0, 1 see no key; key 4 is seen by row 6 only
    q, k, v = qkv(seqlen_q=7, seqlen_k=5)
    clean = flashkit.flash_attn_func(q, k, v, causal=True, return_attn_probs=True,
                                     backend=backend)[:2]
    poisoned = {"k": k.clone(), "v": v.clone()}
    poisoned[arg][0, 4, 0, 3] = bad
    out, lse, _ = flashkit.flash_attn_func(q, poisoned["k"], poisoned["v"], causal=True,
                                           return_attn_probs=True, backend=backend)
    assert torch.equal(out[:, :6], clean[0][:, :6])
    assert torch.equal(lse[..., :6], clean[1][..., :6])
    assert (out[:, :2] == 0).all() and (lse[..., :2] == -math.inf).all()
    if arg == "v" or math.isnan(bad):  # row 6 sees it (an infinite key may score -inf: p 0)
        assert not torch.isfinite(out[0, 6, 0]).all()
    assert torch.equal(out[:, :, 1], clean[0][:, :, 1])  # the other head


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_query_row_stays_in_its_row(backend):
    q, k, v = qkv()
    clean = flashkit.flash_attn_func(q, k, v, backend=backend)
    q2 = q.clone()
    q2[0, 2, 1, 0] = math.nan
    out = flashkit.flash_attn_func(q2, k, v, backend=backend)
    assert out[0, 2, 1].isnan().all()
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[0, 2, 1] = False
    assert torch.equal(out[keep], clean[keep])


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_spare_cache_slots(backend):
    with torch.no_grad():
        kc, vc = randn(2, 32, 2, 16), randn(2, 32, 2, 16)
        seqlens = torch.tensor([5, 17], dtype=torch.int32, device=DEVICE)
        q = randn(2, 1, 2, 16)
        clean = flashkit.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                                 backend=backend)
        kc[0, 5:], vc[0, 5:], kc[1, 17:], vc[1, 17:] = math.nan, math.inf, -math.inf, math.nan
        out = flashkit.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, backend=backend)
    assert torch.equal(out, clean)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_sink_and_slopes_reach_only_their_head(backend):
    q, k, v = qkv()
    sink = torch.tensor([math.nan, 0.5], device=DEVICE)
    out = flashkit.flash_attn_func(q, k, v, sink=sink, backend=backend)
    assert out[:, :, 0].isnan().all() and torch.isfinite(out[:, :, 1]).all()
    slopes = torch.tensor([0.25, math.nan], device=DEVICE)
    out = flashkit.flash_attn_func(q, k, v, alibi_slopes=slopes, backend=backend)
    assert torch.isfinite(out[:, :, 0]).all() and out[:, :, 1].isnan().all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_value_changes_no_gradient_of_rows_that_cannot_see_it(backend):
    q, k, v = qkv(seqlen_q=7, seqlen_k=5)
    dout = torch.randn_like(q)

    def grads(v_in):
        ins = [t.clone().requires_grad_() for t in (q, k, v_in)]
        flashkit.flash_attn_func(*ins, causal=True, backend=backend).backward(dout)
        return [t.grad for t in ins]
    clean = grads(v)
    poisoned = v.clone()
    poisoned[0, 4, 0, 3] = math.nan  # key 4 of head 0: seen by row 6 only
    got = grads(poisoned)
    assert torch.equal(got[0][:, :6], clean[0][:, :6])  # dq of the rows that cannot see it
    assert torch.equal(got[0][:, :, 1], clean[0][:, :, 1])  # the other head
    assert torch.equal(got[2], clean[2])  # dv = P^T dO does not read v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_masked_key_changes_nothing(backend, paged):
    """Three causal query rows over the cache: the last cached key is seen by the last row
    only; NaN in its value reaches no other row."""
    with torch.no_grad():
        shape = (4, 16, 2, 16) if paged else (2, 64, 2, 16)
        kc, vc = randn(*shape), randn(*shape)
        table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device=DEVICE) if paged \
            else None
        q = randn(2, 3, 4, 16)
        seqlens = torch.tensor([10, 20], dtype=torch.int32, device=DEVICE)

        def run():
            return flashkit.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                                    block_table=table, causal=True,
                                                    backend=backend)
        clean = run()
        if paged:
            vc[2, 9, 0] = math.nan  # sequence 0's key 9: page 2, slot 9
        else:
            vc[0, 9, 0] = math.nan
        out = run()
    assert torch.equal(out[0, :2], clean[0, :2]) and torch.equal(out[1], clean[1])
    assert out[0, 2, :2].isnan().all()  # heads 0, 1 read kv head 0
