"""The training text shipped with flashkit and a character-level tokenizer for it.

The text (src/flashkit/data/shakespeare.txt) is public domain; its first line names the source
and is not part of the training text. Nothing is downloaded.
"""

from __future__ import annotations

from importlib import resources

import torch


def load_text(name: str = "shakespeare.txt") -> str:
    """The shipped text without its one-line source header."""
    raw = resources.files("flashkit").joinpath("data", name).read_text(encoding="utf-8")
    return raw.split("\n", 1)[1]


class CharTokenizer:
    """One token per distinct character of the text, in sorted order."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


def random_batch(tokens: torch.Tensor, batch: int, seqlen: int, generator: torch.Generator):
    """(inputs, targets), each (batch, seqlen): random windows, targets shifted by one token."""
    starts = torch.randint(0, tokens.numel() - seqlen - 1, (batch,), generator=generator)
    windows = torch.stack([tokens[s:s + seqlen + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]
