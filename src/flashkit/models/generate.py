"""Autoregressive decoding from the small GPT (models.gpt) with a paged KV cache.

    tokens = generate(model, prompt, max_new_tokens=50, temperature=0.8, top_k=40)

The prompt is one prefill pass: each layer appends its keys and values to its pages and attends
causally (flash_attn_with_kvcache with k, v). Every new token then costs one step per layer that
appends one key/value and attends over the cache: O(context) work per token instead of the
O(context^2) of recomputing the whole sequence, with the same result. The model is used through
its own steps (GPT.embed, Block(x, attend), GPT.head): `attend` is the layer's cached attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashkit.kvcache import flash_attn_with_kvcache

__all__ = ["PagedKVCache", "generate"]


@dataclass
class PagedKVCache:
    """Per-layer K and V pages (num_blocks, page_size, n_head, headdim) and one block table.

    Sequence b owns pages block_table[b] (batch, pages_per_seq) int32; pages are dealt out
    interleaved across sequences (b, b + batch, ...), as a pool allocator would, so a sequence's
    pages are not contiguous in memory.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_table: torch.Tensor

    @classmethod
    def allocate(cls, n_layer: int, batch: int, capacity: int, n_head: int, head_dim: int,
                 page_size: int, dtype: torch.dtype, device) -> PagedKVCache:
        pages = -(-capacity // page_size)
        table = torch.arange(batch * pages, dtype=torch.int32, device=device)
        table = table.reshape(pages, batch).T.contiguous()
        shape = (batch * pages, page_size, n_head, head_dim)
        return cls(k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)],
                   v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)],
                   block_table=table)


@torch.no_grad()
def generate(model, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, page_size: int = 16, num_splits: int = 0,
             backend: str | None = None, generator: torch.Generator | None = None,
             return_logits: bool = False):
    """Continue idx (batch, prompt_len) by max_new_tokens tokens from a models.gpt.GPT.

    temperature 0 picks the most likely token (greedy); otherwise tokens are sampled from
    softmax(logits / temperature), restricted to the top_k most likely when given, with
    `generator`. page_size, num_splits and backend go to flash_attn_with_kvcache.
    Returns tokens (batch, prompt_len + max_new_tokens), and with return_logits also the logits
    each new token was chosen from (batch, max_new_tokens, vocab).
    """
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise ValueError(f"idx: expected (batch, prompt_len >= 1) token ids, got shape "
                         f"{tuple(idx.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    config = model.config
    length = idx.shape[1] + max_new_tokens - 1  # the last token is never fed back
    if length > config.block_size:
        raise ValueError(f"idx: prompt_len {idx.shape[1]} + max_new_tokens {max_new_tokens} "
                         f"- 1 exceeds the model's block_size {config.block_size}")
    weight = model.tok_emb.weight
    cache = PagedKVCache.allocate(config.n_layer, idx.shape[0], length, config.n_head,
                                  config.n_embd // config.n_head, page_size, weight.dtype,
                                  weight.device)

    tokens, logits_seen, pos, new = idx, [], 0, idx
    for _ in range(max_new_tokens):
        x = model.embed(new, start=pos)
        for layer, block in enumerate(model.blocks):
            x = block(x, _cached_attention(cache, layer, pos, num_splits, backend))
        logits = model.head(x[:, -1])  # (batch, vocab)
        pos += new.shape[1]
        new = _pick(logits, temperature, top_k, generator)
        tokens = torch.cat((tokens, new), dim=1)
        logits_seen.append(logits)
    return (tokens, torch.stack(logits_seen, 1)) if return_logits else tokens


def _cached_attention(cache: PagedKVCache, layer: int, pos: int, num_splits: int, backend):
    """attend(q, k, v) for one layer: append k, v at slot pos, attend causally over the cache."""
    def attend(q, k, v):
        return flash_attn_with_kvcache(q, cache.k[layer], cache.v[layer], k, v,
                                       cache_seqlens=pos, block_table=cache.block_table,
                                       causal=True, num_splits=num_splits, backend=backend)
    return attend


def _pick(logits, temperature: float, top_k: int | None, generator) -> torch.Tensor:
    """The next token (batch, 1): argmax, or a sample at `temperature` from the top_k."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
