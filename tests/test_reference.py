"""The float64 oracle (flashkit.reference) against PyTorch's own math.

Each feature is rebuilt independently: masks and ALiBi as an explicit float mask for
torch.nn.functional.scaled_dot_product_attention, GQA by repeating kv heads, the sink as one
extra key column with a zero value, softcap and dropout written out with torch.softmax.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashkit import reference
from helpers import alibi_slopes, random_qkv, random_varlen, sink

F64 = torch.float64


def band(seqlen_q, seqlen_k, left=-1, right=-1):
    """(sq, sk) bool: flash-attn's bottom-right aligned window, written out entry by entry."""
    shift = seqlen_k - seqlen_q
    return torch.tensor([[(left < 0 or j >= i + shift - left)
                          and (right < 0 or j <= i + shift + right)
                          for j in range(seqlen_k)] for i in range(seqlen_q)], dtype=torch.bool)


def alibi_bias(slopes, seqlen_q, seqlen_k):
    """-slope * |i + shift - j| as (b|1, h, sq, sk)."""
    shift = seqlen_k - seqlen_q
    dist = torch.tensor([[abs(i + shift - j) for j in range(seqlen_k)] for i in range(seqlen_q)],
                        dtype=F64)
    slopes = slopes.to(F64)
    slopes = slopes[None] if slopes.dim() == 1 else slopes
    return -slopes[..., None, None] * dist


def torch_attention(q, k, v, bias, scale=None):
    """(out, lse) from torch's SDPA on flash-attn layouts; kv heads repeated for GQA, bias float
    (b|1, h|1, sq, sk). Rows with no visible key are left to the caller."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=scale)
    lse = torch.logsumexp(qh @ kh.transpose(-1, -2) * scale + bias, -1)
    return out.transpose(1, 2), lse


def mask_bias(keep):
    return torch.zeros(keep.shape, dtype=F64).masked_fill(~keep, -math.inf)


CASES = [  # (seqlen_q, seqlen_k, nheads, nheads_k, window (left, right), causal)
    (1, 1, 2, 1, (-1, -1), False),
    (3, 17, 4, 2, (-1, -1), True),
    (17, 17, 4, 4, (5, 2), False),
    (17, 40, 4, 1, (8, 0), True),
    (20, 20, 2, 1, (-1, 3), False),
    (40, 33, 4, 2, (4, -1), False),
    (33, 40, 4, 4, (0, 0), False),
]


@pytest.mark.parametrize("alibi", [None, "head", "batch"])
@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "nheads", "nheads_k", "window", "causal"), CASES)
def test_masks_and_alibi_match_torch(seqlen_q, seqlen_k, nheads, nheads_k, window, causal,
                                     alibi):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, headdim=16, dtype=F64)
    slopes = None if alibi is None else alibi_slopes(nheads, 2 if alibi == "batch" else None)
    out, lse = reference.attention(q, k, v, causal=causal, window_size=window,
                                   alibi_slopes=slopes)
    keep = band(seqlen_q, seqlen_k, window[0], 0 if causal else window[1])
    bias = mask_bias(keep)
    if slopes is not None:
        bias = bias + alibi_bias(slopes, seqlen_q, seqlen_k)
    expected_out, expected_lse = torch_attention(q, k, v, bias)
    rows = keep.any(-1)  # rows that see some key; the others are tested in test_empty_rows
    torch.testing.assert_close(out[:, rows], expected_out[:, rows])
    torch.testing.assert_close(lse[..., rows], expected_lse[..., rows])


def test_scale_and_headdim_v():
    q, k, v = random_qkv(2, 9, 14, 4, 2, headdim=24, headdim_v=40, dtype=F64)
    out, lse = reference.attention(q, k, v, softmax_scale=0.37)
    expected_out, expected_lse = torch_attention(q, k, v, torch.zeros(9, 14, dtype=F64), 0.37)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)


def test_softcap_matches_written_out_math():
    q, k, v = random_qkv(2, 11, 19, 4, 2, headdim=16, dtype=F64)
    cap, scale = 1.5, 0.4
    out, lse, probs = reference.attention(q, k, v, softcap=cap, softmax_scale=scale,
                                          causal=True, return_probs=True)
    kh = k.transpose(1, 2).repeat_interleave(2, 1)
    vh = v.transpose(1, 2).repeat_interleave(2, 1)
    s = cap * torch.tanh(q.transpose(1, 2) @ kh.transpose(-1, -2) * scale / cap)
    s = s.masked_fill(~band(11, 19, -1, 0), -math.inf)
    torch.testing.assert_close(probs, torch.softmax(s, -1))
    torch.testing.assert_close(out, (torch.softmax(s, -1) @ vh).transpose(1, 2))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))


@pytest.mark.parametrize("causal", [False, True])
def test_sink_is_an_extra_column(causal):
    """The sink behaves as one more key whose score is sink_h and whose value is zero."""
    q, k, v = random_qkv(2, 13, 10, 4, 2, headdim=16, dtype=F64)
    logits = sink(4).to(F64) * 3
    out, lse = reference.attention(q, k, v, sink=logits, causal=causal)
    k_ext = torch.cat([k, torch.zeros(2, 1, 2, 16, dtype=F64)], 1)
    v_ext = torch.cat([v, torch.zeros(2, 1, 2, 16, dtype=F64)], 1)
    keep = torch.cat([band(13, 10, -1, 0 if causal else -1), torch.ones(13, 1, dtype=bool)], 1)
    bias = mask_bias(keep).expand(1, 4, 13, 11).clone()
    bias[..., -1] = logits[:, None]  # q . 0 = 0, so the extra score is the sink alone
    expected_out, expected_lse = torch_attention(q, k_ext, v_ext, bias)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(lse, expected_lse)


def test_dropout_with_given_mask():
    q, k, v = random_qkv(2, 12, 15, 4, 2, headdim=16, dtype=F64)
    p = 0.25
    mask = torch.rand(2, 4, 12, 15) >= p
    out, lse, probs = reference.attention(q, k, v, causal=True, dropout_p=p, dropout_mask=mask,
                                          return_probs=True)
    kh = k.transpose(1, 2).repeat_interleave(2, 1)
    vh = v.transpose(1, 2).repeat_interleave(2, 1)
    s = (q.transpose(1, 2) @ kh.transpose(-1, -2) / 4).masked_fill(~band(12, 15, -1, 0),
                                                                   -math.inf)
    dropped = torch.softmax(s, -1) * mask / (1 - p)
    torch.testing.assert_close(probs, dropped)
    torch.testing.assert_close(out, (dropped @ vh).transpose(1, 2))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))  # lse is the pre-dropout one


def test_dropout_needs_the_mask():
    q, k, v = random_qkv(1, 4, 4, 2, 2, headdim=16, dtype=F64)
    with pytest.raises(ValueError, match="dropout_mask"):
        reference.attention(q, k, v, dropout_p=0.1)


def test_varlen_is_per_sequence_dense():
    lengths_q, lengths_k = [5, 0, 1, 12, 3], [7, 4, 1, 12, 0]
    inputs = random_varlen(lengths_q, lengths_k, nheads=4, nheads_k=2, headdim=16, dtype=F64)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    slopes, logits = alibi_slopes(4, batch=5), sink(4).to(F64)
    out, lse = reference.attention(q, k, v, cu_seqlens_q=inputs["cu_seqlens_q"],
                                   cu_seqlens_k=inputs["cu_seqlens_k"], causal=True,
                                   alibi_slopes=slopes, sink=logits)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    cu_q, cu_k = inputs["cu_seqlens_q"].tolist(), inputs["cu_seqlens_k"].tolist()
    for b in range(5):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        dense_out, dense_lse = reference.attention(q[None, sq], k[None, sk], v[None, sk],
                                                   causal=True, alibi_slopes=slopes[b],
                                                   sink=logits)
        torch.testing.assert_close(out[sq], dense_out[0], rtol=0, atol=0)
        torch.testing.assert_close(lse[:, sq], dense_lse[0], rtol=0, atol=0)


EMPTY_ROW_CASES = {  # name -> (seqlen_q, seqlen_k, keyword arguments, rows that see nothing)
    "causal_q>k": (10, 4, dict(causal=True), slice(0, 6)),
    "diagonal_q>k": (10, 4, dict(window_size=(0, 0)), slice(0, 6)),
    "window_q>k": (12, 5, dict(window_size=(2, 1)), slice(0, 6)),
    "no_keys": (5, 0, dict(), slice(0, 5)),
}


@pytest.mark.parametrize("with_sink", [False, True], ids=["no_sink", "sink"])
@pytest.mark.parametrize("case", list(EMPTY_ROW_CASES))
def test_empty_rows(case, with_sink):
    """A row with no visible key: out 0, lse -inf (the sink's logit with a sink), no NaN in
    any gradient, and the rows that do see keys unaffected."""
    seqlen_q, seqlen_k, kwargs, empty = EMPTY_ROW_CASES[case]
    q, k, v = (t.requires_grad_() for t in random_qkv(2, seqlen_q, seqlen_k, 4, 2, headdim=8,
                                                       dtype=F64))
    logits = sink(4).to(F64).requires_grad_() if with_sink else None
    out, lse = reference.attention(q, k, v, sink=logits, **kwargs)
    assert (out[:, empty] == 0).all()
    expected_lse = logits[None, :, None].expand(2, 4, seqlen_q) if with_sink else \
        torch.full_like(lse, -math.inf)
    assert torch.equal(lse[..., empty], expected_lse[..., empty])
    loss = (out * torch.randn_like(out)).sum() + (lse.masked_fill(torch.isinf(lse), 0)
                                                  * torch.randn_like(lse)).sum()
    grads = torch.autograd.grad(loss, [q, k, v] + ([logits] if with_sink else []))
    for g in grads:
        assert torch.isfinite(g).all()
    assert (grads[0][:, empty] == 0).all()


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(causal=True, softcap=2.0),
    dict(window_size=(3, 1), alibi_slopes="head"),
    dict(causal=True, alibi_slopes="batch", sink=True),
    dict(sink=True, softcap=1.0, softmax_scale=0.7),
], ids=["plain", "causal_softcap", "window_alibi", "causal_alibi_sink", "sink_softcap"])
def test_gradcheck(kwargs):
    """Autograd through the oracle (incl. the sink) agrees with finite differences."""
    q, k, v = random_qkv(2, 5, 6, 4, 2, headdim=4, dtype=F64)
    kwargs = dict(kwargs)
    if "alibi_slopes" in kwargs:
        kwargs["alibi_slopes"] = alibi_slopes(4, 2 if kwargs["alibi_slopes"] == "batch" else None)
    logits = sink(4).to(F64) if kwargs.pop("sink", False) else None

    def fn(q, k, v, *maybe_sink):
        return reference.attention(q, k, v, sink=maybe_sink[0] if maybe_sink else None,
                                   **kwargs)

    inputs = [t.requires_grad_() for t in (q, k, v)] + \
        ([logits.requires_grad_()] if logits is not None else [])
    assert torch.autograd.gradcheck(fn, inputs)
