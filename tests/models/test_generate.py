"""generate() with a paged KV cache against recomputing the whole sequence at every step."""

from __future__ import annotations

import os

import pytest
import torch

from flashkit.models.generate import PagedKVCache, generate
from flashkit.models.gpt import GPT, GPTConfig

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _model(dtype=torch.float64, **kw):
    config = GPTConfig(vocab_size=37, block_size=64, n_layer=2, n_head=4, n_embd=64, **kw)
    return GPT(config, attention="naive").to(dtype).eval()


def _recompute(model, idx, max_new_tokens, pick):
    """The slow way: run the whole sequence through the model for every new token."""
    tokens, logits_seen = idx, []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(tokens)[0][:, -1]
            tokens = torch.cat((tokens, pick(logits)), 1)
            logits_seen.append(logits)
    return tokens, torch.stack(logits_seen, 1)


@pytest.mark.parametrize("page_size, num_splits, prompt_len", [(16, 0, 1), (16, 3, 7),
                                                               (32, 1, 20)])
def test_greedy_matches_full_recomputation(page_size, num_splits, prompt_len):
    model = _model()
    idx = torch.randint(0, 37, (3, prompt_len))
    tokens, logits = generate(model, idx, 12, page_size=page_size, num_splits=num_splits,
                              return_logits=True)
    expected, expected_logits = _recompute(model, idx, 12, lambda l: l.argmax(-1, keepdim=True))
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-10)


def test_sampling_matches_full_recomputation():
    model = _model()
    idx = torch.randint(0, 37, (2, 5))
    gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    tokens = generate(model, idx, 10, temperature=0.9, top_k=8, generator=gen_a)

    def pick(logits):
        logits = logits.float() / 0.9
        kth = torch.topk(logits, 8, dim=-1).values[:, -1:]
        probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), -1)
        return torch.multinomial(probs, 1, generator=gen_b)

    assert torch.equal(tokens, _recompute(model, idx, 10, pick)[0])


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors: needs TRITON_INTERPRET=1")
def test_triton_backend_in_float32():
    """The Triton decode kernel (interpreted on CPU) drives the same greedy continuation."""
    model = _model(torch.float32)
    idx = torch.randint(0, 37, (2, 6))
    tokens, logits = generate(model, idx, 4, backend="triton", num_splits=2,
                              return_logits=True)
    expected, expected_logits = _recompute(model, idx, 4, lambda l: l.argmax(-1, keepdim=True))
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size, num_splits", [(16, 0), (64, 1)])
def test_triton_backend_on_gpu(page_size, num_splits):
    """The compiled decode kernel (fp32 inputs, IEEE dots) drives the same greedy continuation
    as recomputation: head dim 64, up to 259 keys (one split of 5 key tiles takes the decode
    tile's sub-tiles)."""
    config = GPTConfig(vocab_size=37, block_size=320, n_layer=2, n_head=4, n_embd=256)
    model = GPT(config, attention="naive").cuda().eval()
    idx = torch.randint(0, 37, (3, 200), device="cuda")
    tokens, logits = generate(model, idx, 60, backend="triton", page_size=page_size,
                              num_splits=num_splits, return_logits=True)
    expected, expected_logits = _recompute(model, idx, 60, lambda l: l.argmax(-1, keepdim=True))
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-5)


def test_pages_are_not_contiguous_per_sequence():
    cache = PagedKVCache.allocate(1, batch=3, capacity=40, n_head=2, head_dim=8, page_size=16,
                                  dtype=torch.float32, device="cpu")
    assert cache.block_table.tolist() == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert cache.k[0].shape == (9, 16, 2, 8)


def test_errors():
    model = _model()
    with pytest.raises(ValueError, match="block_size"):
        generate(model, torch.zeros(1, 60, dtype=torch.long), 6)
    with pytest.raises(ValueError, match="idx"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 0)
