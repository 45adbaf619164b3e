"""Windows at the integer limits mean what they say: a side wider than the keys is unbounded,
forward and backward, dense, varlen and kv decode (no int32 overflow in the band edges)."""

import pytest
import torch
from adversarial_support import BACKENDS, DEVICE, qkv, randn

import flashkit

INT32_MAX = 2**31 - 1
LIMITS = [((-1, INT32_MAX), (-1, -1)), ((0, INT32_MAX), (0, -1)),
          ((INT32_MAX, INT32_MAX), (-1, -1)), ((-1, INT32_MAX - 7), (-1, -1)),
          ((INT32_MAX, 0), (-1, 0)), ((2**62, 2**62), (-1, -1))]


def _grads(fn, *inputs):
    inputs = [t.clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out.backward(torch.ones_like(out))
    return [out.detach()] + [t.grad for t in inputs]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window, same", LIMITS)
def test_dense_window_limits(backend, window, same):
    q, k, v = qkv(seqlen_q=5, seqlen_k=9)
    got = _grads(lambda *x: flashkit.flash_attn_func(*x, window_size=window, backend=backend),
                 q, k, v)
    want = _grads(lambda *x: flashkit.flash_attn_func(*x, window_size=same, backend=backend),
                  q, k, v)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window, same", LIMITS[:3])
def test_varlen_window_limits(backend, window, same):
    lengths_q, lengths_k = [3, 0, 5], [4, 2, 6]
    q, k, v = randn(8, 2, 16), randn(12, 2, 16), randn(12, 2, 16)
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 4, 6, 12], dtype=torch.int32, device=DEVICE)

    def run(w):
        return _grads(lambda *x: flashkit.flash_attn_varlen_func(
            *x, cu_q, cu_k, max(lengths_q), max(lengths_k), window_size=w, backend=backend),
            q, k, v)
    for g, w in zip(run(window), run(same), strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window, same", LIMITS[:3])
def test_kvcache_window_limits(backend, window, same):
    q = randn(2, 3, 2, 16)
    seqlens = torch.tensor([5, 11], dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        outs = []
        for w in (window, same):
            torch.manual_seed(1)  # the same cache and new keys for both windows
            kc, vc = randn(2, 32, 2, 16), randn(2, 32, 2, 16)
            outs.append(flashkit.flash_attn_with_kvcache(
                q, kc, vc, randn(2, 1, 2, 16), randn(2, 1, 2, 16), cache_seqlens=seqlens,
                window_size=w, backend=backend))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window, seqlen_k", [((0, 0), 9), ((-1, -1), 1), ((3, 0), 9)])
def test_rows_with_one_key_get_exact_zero_gradients(backend, dtype, window, seqlen_k):
    """A row that sees one key (and no sink) has softmax 1 whatever its score: dq of the row
    and its share of dk are exactly 0 (window (3, 0): row 0 only; the rest see more)."""
    q, k, v = qkv(seqlen_q=9, seqlen_k=seqlen_k, dtype=dtype)
    dq, dk, dv = _grads(lambda *x: flashkit.flash_attn_func(
        *x, window_size=window, backend=backend), q * 3, k * 3, v)[1:]
    if window == (3, 0):
        assert (dq[:, 0] == 0).all() and (dq[:, 1:] != 0).any()
    else:
        assert (dq == 0).all() and (dk == 0).all() and (dv != 0).any()
    sink = torch.zeros(2, device=DEVICE)  # a sink makes two logits: gradients again
    dq_sink = _grads(lambda *x: flashkit.flash_attn_func(
        *x, window_size=window, sink=sink, backend=backend), q * 3, k * 3, v)[1]
    assert (dq_sink != 0).any()
