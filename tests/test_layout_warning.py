"""flash_attn_func warns when its inputs look like SDPA's (batch, nheads, seqlen, headdim) layout,
and stays quiet on ordinary (batch, seqlen, nheads, headdim) shapes, decoding included."""

import warnings

import pytest
import torch

import flashkit


def test_sdpa_layout_tensors_raise_a_warning():
    q, k, v = (torch.randn(1, 2, 130, 8) for _ in range(3))  # (batch, nheads, seqlen, headdim)
    with pytest.warns(UserWarning, match="transpose"):
        flashkit.flash_attn_func(q, k, v)


@pytest.mark.parametrize("q_shape, k_shape", [
    ((2, 3, 4, 8), (2, 5, 2, 8)),  # tiny problems: fewer positions than heads, few heads
    ((1, 1, 128, 8), (1, 300, 128, 8)),  # decoding one token over a longer cache
    ((1, 130, 2, 8), (1, 130, 2, 8)),  # the warning's case, transposed as it should be
])
def test_ordinary_shapes_raise_no_warning(q_shape, k_shape):
    q, k, v = torch.randn(q_shape), torch.randn(k_shape), torch.randn(k_shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flashkit.flash_attn_func(q, k, v)
