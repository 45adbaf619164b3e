"""A small GPT whose attention is a plug: the materialised reference or flashkit's kernels.

    model = GPT(GPTConfig(vocab_size=65), attention="flashkit")
    logits, loss = model(idx, targets)

Token and learned position embeddings, pre-LayerNorm blocks (x + attn(ln(x)), x + mlp(ln(x))),
causal self-attention and a language-model head tied to the token embedding. Attention is any
function `attend(q, k, v) -> out` on (batch, seqlen, nheads, headdim) tensors that is causal;
ATTENTION names the two this project compares:

    naive     flashkit.reference.attention: the whole score matrix, materialised
    flashkit  flashkit.flash_attn_func with the default backend (Triton on CUDA, tiled elsewhere)

Each attention layer exposes its steps (`qkv`, `project`) so a decoder with a KV cache can run
`q, k, v = layer.qkv(x)`, attend over its cache, and `layer.project(out)` without this module
knowing about caches; `GPT.embed(idx, start=...)` places new tokens after cached ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

import flashkit
from flashkit import reference

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def naive_attention(q, k, v):
    """Causal attention through the materialised oracle (in the dtype of its inputs)."""
    return reference.attention(q, k, v, causal=True)[0]


def flashkit_attention(q, k, v, backend: str | None = None):
    """Causal attention through flashkit (backend None: the device's default)."""
    return flashkit.flash_attn_func(q, k, v, causal=True, backend=backend)


ATTENTION: dict[str, Attend] = {"naive": naive_attention, "flashkit": flashkit_attention}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 128  # the longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd {config.n_embd} is not a multiple of n_head "
                             f"{config.n_head}")
        self.n_head = config.n_head
        self.qkv_proj = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd)

    def qkv(self, x):
        """x (batch, seqlen, n_embd) -> q, k, v, each (batch, seqlen, n_head, headdim)."""
        return self.qkv_proj(x).unflatten(-1, (3, self.n_head, -1)).unbind(2)

    def project(self, out):
        """Attention output (batch, seqlen, n_head, headdim) -> (batch, seqlen, n_embd)."""
        return self.out_proj(out.flatten(-2))

    def forward(self, x, attend: Attend):
        return self.project(attend(*self.qkv(x)))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x, attend: Attend):
        x = x + self.attn(self.ln_1(x), attend)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, attention: str | Attend = "flashkit"):
        super().__init__()
        self.config = config
        self.attend = ATTENTION[attention] if isinstance(attention, str) else attention
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.apply(_init_weights)

    def embed(self, idx, start: int = 0):
        """Token + position embedding of idx (batch, seqlen) at positions start, start + 1, ..."""
        if start + idx.shape[1] > self.config.block_size:
            raise ValueError(f"idx: positions up to {start + idx.shape[1]} exceed block_size "
                             f"{self.config.block_size}")
        pos = torch.arange(start, start + idx.shape[1], device=idx.device)
        return self.tok_emb(idx) + self.pos_emb(pos)

    def head(self, x):
        """Final LayerNorm and the LM head, whose weight is the token embedding (tied)."""
        return self.ln_f(x) @ self.tok_emb.weight.T

    def forward(self, idx, targets=None):
        """logits (batch, seqlen, vocab) and the mean cross-entropy against targets (or None)."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, self.attend)
        logits = self.head(x)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: normal(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
