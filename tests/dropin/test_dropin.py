"""The flash-attn drop-in: flash-attn 2.8.4's signatures, its semantics where they differ from
the native API, and the same numbers as the native API everywhere else (torch backend)."""

import inspect
import math
import sys
import types

import pytest
import torch

import flashkit
import flashkit.flash_attn as fa
from flashkit.flash_attn import bert_padding
from flashkit.flash_attn import flash_attn_interface as fai
from flashkit.flash_attn.layers.rotary import apply_rotary_emb
from flashkit.testing import dropout_keep_mask

W = ("window_size", (-1, -1))
COMMON = (("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), W, ("softcap", 0.0),
          ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False))
# flash-attn 2.8.4's flash_attn/flash_attn_interface.py, parameter by parameter
FLASH_ATTN_284 = {
    "flash_attn_qkvpacked_func": ("qkv", *COMMON),
    "flash_attn_kvpacked_func": ("q", "kv", *COMMON),
    "flash_attn_func": ("q", "k", "v", *COMMON),
    "flash_attn_varlen_qkvpacked_func": ("qkv", "cu_seqlens", "max_seqlen", *COMMON),
    "flash_attn_varlen_kvpacked_func": ("q", "kv", "cu_seqlens_q", "cu_seqlens_k",
                                        "max_seqlen_q", "max_seqlen_k", *COMMON),
    "flash_attn_varlen_func": ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                               "max_seqlen_k", *COMMON, ("block_table", None)),
    "flash_attn_with_kvcache": (
        "q", "k_cache", "v_cache", ("k", None), ("v", None), ("rotary_cos", None),
        ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None),
        ("cache_leftpad", None), ("block_table", None), ("softmax_scale", None),
        ("causal", False), W, ("softcap", 0.0), ("rotary_interleaved", True),
        ("alibi_slopes", None), ("num_splits", 0), ("return_softmax_lse", False)),
}


@pytest.mark.parametrize("name", list(FLASH_ATTN_284))
def test_signature_matches_flash_attn_2_8_4(name):
    fn = getattr(fa, name)
    assert fn is getattr(fai, name)
    params = list(inspect.signature(fn).parameters.values())
    got = tuple(p.name if p.default is inspect.Parameter.empty else (p.name, p.default)
                for p in params)
    assert got == FLASH_ATTN_284[name]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


def _qkv(b=2, sq=7, sk=9, h=4, hk=2, d=16, dtype=torch.float32):
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype))


def _same(a, b):
    assert a.shape == b.shape and torch.equal(a, b)


def test_dense_and_packed_match_the_native_api_with_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv())
    kw = dict(causal=True, window_size=(3, -1), softcap=2.0)
    out = fa.flash_attn_func(q, k, v, **kw)
    ref = flashkit.flash_attn_func(q, k, v, **kw)
    _same(out, ref)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    grads_ref = torch.autograd.grad(ref.sum(), (q, k, v))
    for g, r in zip(grads, grads_ref, strict=True):
        _same(g, r)
    kv = torch.stack((k, v), 2).detach()
    _same(fa.flash_attn_kvpacked_func(q, kv, **kw), flashkit.flash_attn_kvpacked_func(q, kv, **kw))
    qkv = torch.randn(2, 7, 3, 4, 16)
    _same(fa.flash_attn_qkvpacked_func(qkv, causal=True),
          flashkit.flash_attn_qkvpacked_func(qkv, causal=True))


def _varlen(lengths_q, lengths_k, h=4, hk=2, d=16):
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(lengths_q), h, d)
    k, v = torch.randn(sum(lengths_k), hk, d), torch.randn(sum(lengths_k), hk, d)
    return q, k, v, cu(lengths_q), cu(lengths_k), max(lengths_q), max(lengths_k)


def test_varlen_and_packed_varlen_match_the_native_api():
    args = _varlen([3, 0, 5], [4, 2, 6])
    out, lse, s_dmask = fa.flash_attn_varlen_func(*args, causal=True, return_attn_probs=True)
    ref, ref_lse = flashkit.flash_attn_varlen_func(*args, causal=True, return_softmax_lse=True)
    _same(out, ref)
    _same(lse, ref_lse)  # every row sees a key: no +inf conversion
    assert s_dmask.numel() == 0  # no dropout: nothing materialised, as flash-attn
    q, k, v, cu_q, _, max_q, _ = _varlen([3, 1, 5], [3, 1, 5], h=2)
    qkv = torch.stack((q, k, v), 1)
    _same(fa.flash_attn_varlen_qkvpacked_func(qkv, cu_q, max_q, causal=True),
          flashkit.flash_attn_varlen_func(q, k, v, cu_q, cu_q, max_q, max_q, causal=True))
    q, k, v, cu_q, cu_k, max_q, max_k = args
    kv = torch.stack((k, v), 1)
    _same(fa.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max_q, max_k),
          flashkit.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k))


def test_row_without_keys_gets_lse_plus_inf_and_window_may_be_a_tensor():
    q, k, v = _qkv(sq=9, sk=4)  # causal, bottom-right: the first 5 rows see no key
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, window_size=torch.tensor([2, 0]),
                                     return_attn_probs=True)
    ref, ref_lse = flashkit.flash_attn_func(q, k, v, causal=True, window_size=(2, 0),
                                            return_softmax_lse=True)
    _same(out, ref)
    assert torch.isinf(lse[..., :5]).all() and (lse[..., :5] > 0).all()
    assert torch.equal(ref_lse[..., :5], torch.full_like(ref_lse[..., :5], -math.inf))
    _same(lse[..., 5:], ref_lse[..., 5:])
    with pytest.raises(ValueError, match="window_size"):
        fa.flash_attn_func(q, k, v, window_size=torch.tensor([1.0, 2.0]))


def test_s_dmask_encodes_the_native_dropout_mask_and_probabilities():
    q, k, v = _qkv(b=2, sq=5, sk=6, h=2, hk=2, d=8, dtype=torch.float64)
    p = 0.3
    torch.manual_seed(7)
    seed = flashkit.api.draw_dropout_seed()
    torch.manual_seed(7)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, p, causal=True, return_attn_probs=True)
    torch.manual_seed(7)
    ref = flashkit.flash_attn_func(q, k, v, p, causal=True)
    _same(out, ref)  # the same seed: S_dmask describes the dropout this call applied
    assert s_dmask.shape == (2, 2, 128, 128) and s_dmask.dtype == q.dtype
    s = s_dmask[:, :, :5, :6]
    keep = dropout_keep_mask(seed, 2, 2, 5, 6, p)
    visible = torch.ones(5, 6, dtype=torch.bool).tril(1)  # bottom-right causal, shift 1
    assert torch.equal((s < 0) & visible, ~keep & visible)
    # |S| = exp(s_ij - m_i): times exp(m_i - lse_i) it is the pre-dropout probability
    probs = flashkit.reference.attention(q, k, v, causal=True, return_probs=True)[2]
    m = probs.amax(-1, keepdim=True)
    torch.testing.assert_close(s.abs() * m, probs, rtol=1e-12, atol=1e-15)
    assert (s_dmask[:, :, 5:] == 0).all() and (s_dmask[..., 6:] == 0).all()


def test_varlen_block_table_reads_the_paged_cache():
    page, hk, d = 4, 2, 16
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen([2, 3], [5, 7])
    num_blocks = 6
    k_cache, v_cache = torch.randn(num_blocks, page, hk, d), torch.randn(num_blocks, page, hk, d)
    table = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    for b, (start, n) in enumerate(((0, 5), (5, 7))):  # fill the pages with the packed keys
        for t in range(n):
            k_cache[table[b, t // page], t % page] = k[start + t]
            v_cache[table[b, t // page], t % page] = v[start + t]
    out = fa.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, causal=True,
                                    block_table=table)
    _same(out, flashkit.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True))
    with pytest.raises(RuntimeError, match="block_table"):
        fa.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k,
                                  block_table=table[:, :1])


def _paged(batch=2, pages=2, page=16, hk=2, d=16):
    q = torch.randn(batch, 1, 4, d)
    kc, vc = torch.randn(batch * pages, page, hk, d), torch.randn(batch * pages, page, hk, d)
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    return q, kc, vc, table


def test_kvcache_paged_overflow_raises_runtime_error_naming_block_table():
    q, kc, vc, table = _paged()
    full = torch.tensor([32, 3], dtype=torch.int32)
    k_new = torch.randn(2, 1, 2, 16)
    with pytest.raises(RuntimeError, match="block_table"):
        fa.flash_attn_with_kvcache(q, kc, vc, k_new, k_new.clone(), cache_seqlens=full,
                                   block_table=table)
    with pytest.raises(RuntimeError, match="block_table"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=full + 1, block_table=table)
    out, lse = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=full, block_table=table,
                                          return_softmax_lse=True)
    ref, ref_lse = flashkit.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=full,
                                                    block_table=table, return_softmax_lse=True)
    _same(out, ref)
    _same(lse, ref_lse)


def test_kvcache_rotary_with_leftpad_rotates_at_absolute_slots():
    """flash-attn rotates new key i at slot cache_seqlens + i, whatever cache_leftpad is."""
    b, cap, hk, d = 2, 12, 2, 16
    q, k_new, v_new = torch.randn(b, 2, 4, d), torch.randn(b, 2, hk, d), torch.randn(b, 2, hk, d)
    kc, vc = torch.randn(b, cap, hk, d), torch.randn(b, cap, hk, d)
    seqlens = torch.tensor([5, 7], dtype=torch.int32)
    leftpad = torch.tensor([2, 0], dtype=torch.int32)
    angles = torch.rand(cap, d // 4) * 2 * math.pi
    cos, sin = angles.cos(), angles.sin()
    kc_out = kc.clone()
    fa.flash_attn_with_kvcache(q, kc_out, vc.clone(), k_new, v_new, cos, sin, seqlens,
                               cache_leftpad=leftpad, causal=True, rotary_interleaved=False)
    rotated = apply_rotary_emb(k_new, cos, sin, seqlen_offsets=seqlens)
    for i in range(b):
        n = int(seqlens[i])
        torch.testing.assert_close(kc_out[i, n:n + 2], rotated[i])


def test_bert_padding_round_trip_and_five_values():
    x = torch.randn(3, 6, 2, 4, requires_grad=True)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6, [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    packed, indices, cu, max_len, seqused = bert_padding.unpad_input(x, mask)
    assert packed.shape == (11, 2, 4) and cu.tolist() == [0, 4, 10, 11] and max_len == 6
    assert seqused.tolist() == [4, 6, 1] and cu.dtype == torch.int32
    back = bert_padding.pad_input(packed, indices, 3, 6)
    _same(back, x.detach() * mask[..., None, None])
    back.sum().backward()
    _same(x.grad, mask[..., None, None].expand_as(x).to(x.dtype))
    unused = torch.zeros_like(mask)
    unused[0, 1] = True
    packed, _, cu, _, seqused = bert_padding.unpad_input(x, mask, unused)
    assert cu.tolist() == [0, 5, 11, 12] and seqused.tolist() == [4, 6, 1]
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    packed, indices, cu, max_len = bert_padding.unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.tolist() == [0, 2, 5, 11, 12] and max_len == 6 and packed.shape[0] == 12


def test_apply_rotary_emb_dense_varlen_inplace_and_gradient():
    x = torch.randn(2, 5, 3, 16, dtype=torch.float64, requires_grad=True)
    angles = torch.rand(9, 4, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    offsets = torch.tensor([0, 3])
    out = apply_rotary_emb(x, cos, sin, interleaved=True, seqlen_offsets=offsets)
    # by hand: pair (2f, 2f + 1) of token t in sequence b turns by angle[offset_b + t, f]
    for b in range(2):
        a = angles[offsets[b]:offsets[b] + 5][:, None, :]
        x1, x2 = x[b, ..., 0:8:2], x[b, ..., 1:8:2]
        torch.testing.assert_close(out[b, ..., 0:8:2], x1 * a.cos() - x2 * a.sin())
        torch.testing.assert_close(out[b, ..., 1:8:2], x1 * a.sin() + x2 * a.cos())
    _same(out[..., 8:], x[..., 8:])
    (g,) = torch.autograd.grad(out.pow(2).sum(), x)  # a rotation keeps the norm
    torch.testing.assert_close(g, 2 * x.detach())
    packed = x.detach().flatten(0, 1)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    varlen = apply_rotary_emb(packed, cos, sin, True, seqlen_offsets=offsets, cu_seqlens=cu,
                              max_seqlen=5)
    _same(varlen, out.detach().flatten(0, 1))
    y = packed.clone()
    assert apply_rotary_emb(y, cos, sin, True, True, offsets, cu, 5) is y
    _same(y, varlen)


def test_install_alias_is_explicit_and_refuses_a_real_flash_attn(monkeypatch, caplog):
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    import importlib.util

    real_find_spec = importlib.util.find_spec
    real = types.SimpleNamespace(origin="/site-packages/flash_attn/__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: real if n == "flash_attn" else real_find_spec(n, *a))
    with pytest.raises(RuntimeError, match="real flash-attn"):
        fa.install_alias()
    assert "flash_attn" not in sys.modules
    monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)
    with caplog.at_level("WARNING", logger="flashkit"):
        fa.install_alias()
    assert "flash_attn" in caplog.text
    for name in ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn.bert_padding",
                 "flash_attn.layers.rotary"):
        monkeypatch.setitem(sys.modules, name, sys.modules[name])  # undone after the test
    from flash_attn import flash_attn_func
    from flash_attn.layers.rotary import apply_rotary_emb as aliased

    assert flash_attn_func is fa.flash_attn_func and aliased is apply_rotary_emb


@pytest.mark.slow
def test_triton_interpreter_smoke():
    """The drop-in on the Triton backend (interpreted on the CPU): the same as native."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or a GPU")
    q, k, v = _qkv(b=1, sq=3, sk=5, h=2, hk=1, d=16)
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref, ref_lse = flashkit.flash_attn_func(q, k, v, causal=True, backend="triton",
                                            return_softmax_lse=True)
    torch.testing.assert_close(out, flashkit.flash_attn_func(q, k, v, causal=True))
    torch.testing.assert_close(ref, out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ref_lse, lse, rtol=1e-4, atol=1e-5)
