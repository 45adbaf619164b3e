"""The built-in variants as test cases: each builds its modifiers from the inputs it is given,
so the oracle (float64 copies), the baseline and the kernel each see their own tensors."""

from __future__ import annotations

import torch

import flashkit
from flashkit import variants


def documents(seqlen: int, batch: int | None = None) -> torch.Tensor:
    """int32 document ids: runs of random lengths (some of length 1), one row per batch entry."""
    rows = []
    for _ in range(batch or 1):
        cuts = torch.randperm(seqlen - 1)[:max(1, seqlen // 9)] + 1
        ids = torch.zeros(seqlen, dtype=torch.int32)
        ids[cuts] = 1
        rows.append(ids.cumsum(0).to(torch.int32))
    return rows[0] if batch is None else torch.stack(rows)


def extras(name: str, batch: int, nheads: int, seqlen_q: int, seqlen_k: int) -> dict:
    """The tensors example `name` captures, random."""
    if name == "document":
        return dict(doc=documents(max(seqlen_q, seqlen_k), batch))
    if name == "prefix_lm":
        return dict(prefix=torch.randint(0, seqlen_k + 1, (batch,), dtype=torch.int32))
    if name == "alibi":
        return dict(slopes=torch.rand(nheads) * 0.9 + 0.05)
    if name == "relative_bias":
        return dict(table=torch.randn(nheads, 2 * 6 + 1))
    if name == "token_bias":
        return dict(bias=torch.randn(batch, seqlen_k))
    return {}


def mods(name: str, seqlen_q: int, seqlen_k: int, **captured) -> dict:
    """flash_attn_func keyword arguments of example `name`."""
    if name == "document":
        return dict(mask_mod=variants.document_mask(captured["doc"], causal=True))
    if name == "prefix_lm":
        return dict(mask_mod=variants.prefix_lm(captured["prefix"]))
    if name == "alibi":
        return dict(score_mod=variants.alibi(captured["slopes"], shift=seqlen_k - seqlen_q))
    if name == "softcap":
        return dict(score_mod=variants.softcap(3.0))
    if name == "softcap_approx":  # 16-bit inputs on a GPU (the interpreter's tanh is exact)
        return dict(score_mod=variants.softcap(3.0, approx=True))
    if name == "relative_bias":
        return dict(score_mod=variants.relative_bias(captured["table"]))
    if name == "token_bias":
        return dict(score_mod=variants.token_bias(captured["bias"]))
    if name == "window_globals":
        return dict(mask_mod=variants.sliding_window_with_globals(5, 3))
    raise ValueError(name)


EXAMPLES = ("document", "prefix_lm", "alibi", "softcap", "softcap_approx", "relative_bias",
            "window_globals")
# score modifiers whose captured tensor learns: example -> the captured tensor's name
CAPTURED_GRADS = {"relative_bias": "table", "alibi": "slopes", "token_bias": "bias"}


def attention(backend: str, name: str, **inputs):
    """(out,) of example `name` through flash_attn_func or flash_attn_varlen_func."""
    captured = {n: inputs.pop(n) for n in ("doc", "prefix", "slopes", "table", "bias")
                if n in inputs}
    varlen = "cu_seqlens_q" in inputs
    seqlen_q = inputs["max_seqlen_q"] if varlen else inputs["q"].shape[1]
    seqlen_k = inputs["max_seqlen_k"] if varlen else inputs["k"].shape[1]
    kwargs = mods(name, seqlen_q, seqlen_k, **captured)
    fn = flashkit.flash_attn_varlen_func if varlen else flashkit.flash_attn_func
    return (fn(**inputs, backend=backend, **kwargs),)
