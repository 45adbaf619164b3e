"""flashkit.scaled_dot_product_attention against torch.nn.functional.scaled_dot_product_attention.

PyTorch's conventions: (batch, nheads, L, E) layout, top-left causal, bool/float attn_mask. The
oracle is torch's SDPA on float64 copies; the baseline the same math materialised in the inputs'
dtype; the kernel passes under the docs/design.md section 5 rule, outputs and gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import flashkit
from flashkit.api import draw_dropout_seed
from flashkit.testing import dropout_keep_mask
from helpers import DTYPE_IDS, DTYPES, check_against_oracle, randn

SDPA_GRADS = ("query", "key", "value")


def materialised(query, key, value, attn_mask=None, is_causal=False, scale=None,
                 enable_gqa=False, dropout_p=0.0, dropout_mask=None):
    """softmax(q k^T * scale + mask) v in the inputs' dtype, fully masked rows giving 0;
    with dropout, the weights times dropout_mask / (1 - dropout_p)."""
    if enable_gqa:
        group = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(group, -3), value.repeat_interleave(group, -3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    s = query @ key.transpose(-1, -2) * scale
    if is_causal:
        attn_mask = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        s = s.masked_fill(~attn_mask, -math.inf)
    elif attn_mask is not None:
        s = s + attn_mask.to(s.dtype)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    if dropout_p > 0:
        p = p * dropout_mask / (1 - dropout_p)
    return (p @ value,)


def torch_sdpa(**kwargs):
    return (F.scaled_dot_product_attention(**kwargs),)


def flashkit_sdpa(**kwargs):
    return (flashkit.scaled_dot_product_attention(**kwargs),)


def check_sdpa(query, key, value, **kwargs):
    return check_against_oracle(flashkit_sdpa, dict(query=query, key=key, value=value, **kwargs),
                                oracle_fn=torch_sdpa, baseline_fn=materialised,
                                grad_names=SDPA_GRADS, output_names=("out",))[0]


def random_bhsd(batch, nheads, nheads_k, seqlen_q, seqlen_k, headdim=32, dtype=torch.float32):
    return (randn(batch, nheads, seqlen_q, headdim, dtype=dtype),
            randn(batch, nheads_k, seqlen_k, headdim, dtype=dtype),
            randn(batch, nheads_k, seqlen_k, headdim, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(1, 1), (17, 17), (9, 40), (40, 9)])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_matches_torch(is_causal, seqlen_q, seqlen_k, dtype):
    """is_causal is top-left aligned: with L > S the last rows see every key, with L < S the
    first row sees only key 0."""
    check_sdpa(*random_bhsd(2, 4, 4, seqlen_q, seqlen_k, dtype=dtype), is_causal=is_causal)


MASK_SHAPES = {  # name -> mask shape for (batch 2, heads 4, L 13, S 21)
    "full": (2, 4, 13, 21),
    "per_batch": (2, 1, 13, 21),
    "per_head": (4, 13, 21),
    "2d": (13, 21),
    "key_padding": (2, 1, 1, 21),
    "per_query": (13, 1),
}


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=DTYPE_IDS[:2])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", list(MASK_SHAPES))
def test_attn_mask_broadcasting(shape, kind, dtype):
    size = MASK_SHAPES[shape]
    if kind == "bool":
        mask = torch.rand(size) > 0.3
    else:
        mask = (torch.randn(size) * 2).to(dtype)
    check_sdpa(*random_bhsd(2, 4, 4, 13, 21, dtype=dtype), attn_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("nheads_k", [1, 2])
def test_enable_gqa(nheads_k, dtype):
    query, key, value = random_bhsd(2, 4, nheads_k, 15, 26, dtype=dtype)
    check_sdpa(query, key, value, enable_gqa=True, is_causal=True, scale=0.3)
    check_sdpa(query, key, value, enable_gqa=True, attn_mask=torch.rand(15, 26) > 0.5)
    per_head = (torch.randn(2, 4, 15, 26) * 3).to(dtype)  # query heads of a group differ
    check_sdpa(query, key, value, enable_gqa=True, attn_mask=per_head)


def test_three_dim_inputs():
    query, key, value = (t[0] for t in random_bhsd(1, 4, 4, 11, 7))
    assert query.dim() == 3
    out = check_sdpa(query, key, value, is_causal=True, scale=0.5)
    assert out.shape == (4, 11, 32)


def test_strided_inputs():
    query = randn(2, 13, 4, 32).transpose(1, 2)  # (b, h, L, E) viewed from (b, L, h, E)
    key, value = randn(2, 4, 19, 32, strided=True), randn(2, 4, 19, 32, strided=True)
    assert not (query.is_contiguous() or key.is_contiguous())
    check_sdpa(query, key, value, attn_mask=torch.rand(13, 19) > 0.2)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zero(kind):
    """Rows where every key is masked: 0 (as torch), never NaN, in the output and gradients."""
    query, key, value = (t.requires_grad_() for t in random_bhsd(1, 2, 2, 6, 5))
    keep = torch.rand(6, 5) > 0.4
    keep[[1, 4]] = False
    mask = keep if kind == "bool" else torch.zeros(6, 5).masked_fill(~keep, -math.inf)
    out = flashkit.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    assert (out[:, :, [1, 4]] == 0).all()
    grads = torch.autograd.grad(out.sum(), (query, key, value))
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][:, :, [1, 4]] == 0).all()
    check_sdpa(query.detach(), key.detach(), value.detach(), attn_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=DTYPE_IDS[:2])
def test_dropout(dtype):
    """Against the materialised math with the keep-mask rebuilt from the call's seed."""
    p = 0.2
    query, key, value = random_bhsd(2, 4, 2, 11, 17, dtype=dtype)
    torch.manual_seed(5)
    mask = dropout_keep_mask(draw_dropout_seed(), 2, 4, 11, 17, p)

    def kernel(**kwargs):
        torch.manual_seed(5)  # the call draws the same seed
        return flashkit_sdpa(**kwargs)

    def with_mask(**kwargs):
        return materialised(**kwargs, dropout_mask=mask)

    check_against_oracle(kernel, dict(query=query, key=key, value=value, dropout_p=p,
                                      is_causal=True, enable_gqa=True),
                         oracle_fn=with_mask, grad_names=SDPA_GRADS, output_names=("out",))


def test_is_causal_with_empty_rows_past_keys():
    """L > S with a float mask of -inf below: a bias that kills whole rows also gives 0."""
    query, key, value = random_bhsd(1, 2, 2, 9, 3)
    mask = torch.zeros(9, 3)
    mask[5:] = -math.inf
    check_sdpa(query, key, value, attn_mask=mask)


@pytest.mark.parametrize(("kwargs", "error", "argname"), [
    (dict(is_causal=True, attn_mask=torch.ones(5, 7, dtype=torch.bool)), ValueError,
     "attn_mask"),
    (dict(attn_mask=torch.ones(5, 6, dtype=torch.bool)), ValueError, "attn_mask"),
    (dict(attn_mask=torch.ones(3, 5, 7, dtype=torch.bool)), ValueError, "attn_mask"),
    (dict(attn_mask=torch.ones(5, 7, dtype=torch.int32)), TypeError, "attn_mask"),
    (dict(scale=0.0), ValueError, "scale"),
    (dict(dropout_p=1.5), ValueError, "dropout_p"),
], ids=["causal_and_mask", "mask_shape", "mask_heads", "mask_dtype", "scale", "dropout"])
def test_errors(kwargs, error, argname):
    query, key, value = random_bhsd(2, 4, 4, 5, 7)
    with pytest.raises(error, match=rf"^{argname}\b"):
        flashkit.scaled_dot_product_attention(query, key, value, **kwargs)


def test_heads_mismatch_needs_enable_gqa():
    """Errors name SDPA's own arguments (query, key, value), not flash-attn's."""
    query, key, value = random_bhsd(2, 4, 2, 5, 7)
    with pytest.raises(ValueError, match=r"^key\b.*enable_gqa"):
        flashkit.scaled_dot_product_attention(query, key, value)
    query, key, value = random_bhsd(2, 4, 3, 5, 7)
    with pytest.raises(ValueError, match=r"^key\b.*divide"):
        flashkit.scaled_dot_product_attention(query, key, value, enable_gqa=True)
    query, key, value = random_bhsd(2, 4, 4, 5, 7)
    with pytest.raises(ValueError, match=r"^key\b.*head dim"):
        flashkit.scaled_dot_product_attention(query, key[..., :16], value)
    with pytest.raises(ValueError, match=r"^value\b.*heads"):
        flashkit.scaled_dot_product_attention(query, key, value[:, :2], enable_gqa=True)


def test_float_mask_requiring_grad_is_refused():
    query, key, value = random_bhsd(1, 2, 2, 4, 4)
    mask = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        flashkit.scaled_dot_product_attention(query, key, value, attn_mask=mask)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), seqlen_q=st.integers(1, 40), seqlen_k=st.integers(1, 40),
       nheads_k=st.sampled_from([1, 2, 4]), mask=st.sampled_from([None, "causal", "bool",
                                                                  "float"]),
       mask_dims=st.lists(st.booleans(), min_size=4, max_size=4),
       dtype=st.sampled_from(DTYPES[:2]))
def test_random_against_torch(seed, seqlen_q, seqlen_k, nheads_k, mask, mask_dims, dtype):
    """Random lengths, GQA and masks whose every dim is either full or broadcast."""
    torch.manual_seed(seed)
    query, key, value = random_bhsd(2, 4, nheads_k, seqlen_q, seqlen_k, dtype=dtype)
    kwargs = dict(enable_gqa=nheads_k != 4)
    if mask == "causal":
        kwargs["is_causal"] = True
    elif mask is not None:
        shape = [n if full else 1 for n, full in zip((2, 4, seqlen_q, seqlen_k), mask_dims,
                                                     strict=True)]
        kwargs["attn_mask"] = (torch.rand(shape) > 0.25 if mask == "bool"
                               else (torch.randn(shape) * 2).to(dtype))
    check_sdpa(query, key, value, **kwargs)
