"""A drop-in for torch.nn.functional.scaled_dot_product_attention, computed by flashkit.

PyTorch's conventions, not flash-attn's: layout (batch, nheads, seqlen, headdim) (or without the
batch dim), `is_causal` aligned top-left (query i sees keys j <= i), `attn_mask` boolean (True =
take part) or float (added to the scores) broadcastable to (batch, nheads, L, S), `enable_gqa`
to let key/value have fewer heads. Rows that see no key give 0 rather than NaN.
"""

from __future__ import annotations

import math

import torch

from flashkit import checks
from flashkit.api import draw_dropout_seed, run_backend
from flashkit.ops.params import AttentionParams

__all__ = ["scaled_dot_product_attention"]


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *, backend=None):
    """`torch.nn.functional.scaled_dot_product_attention`, computed by flashkit.

    softmax(query @ key^T * scale + mask) @ value, exactly, tile by tile: the (L, S) score
    matrix is never stored (an `attn_mask` is read one tile at a time).

    Args:
        query: (batch, nheads, L, E), or (nheads, L, E).
        key: (batch, nheads_k, S, E); nheads_k == nheads unless enable_gqa.
        value: (batch, nheads_k, S, Ev).
        attn_mask: optional, broadcastable to (batch, nheads, L, S): boolean (True = the
            query may attend to the key) or float (added to the scores). Not with is_causal.
        dropout_p: probability in [0, 1) of dropping each attention weight (kept ones scaled
            by 1 / (1 - p)); the seed comes from torch's default generator.
        is_causal: query i sees keys j <= i, aligned top-left as in PyTorch (flash_attn_func
            aligns bottom-right instead).
        scale: multiplies the scores; default 1 / sqrt(E).
        enable_gqa: let key and value have fewer heads than query (nheads_k dividing nheads).
        backend: keyword-only, as in `flash_attn_func`: None picks Triton for CUDA tensors and
            the tiled PyTorch backend otherwise.

    Returns:
        (batch, nheads, L, Ev) (or (nheads, L, Ev)) in query's dtype. Unlike PyTorch, a row
        whose mask hides every key gives 0 rather than NaN.

    Raises:
        ValueError / TypeError naming the argument for mismatched shapes, dtypes or devices,
        heads that differ without enable_gqa, or attn_mask together with is_causal.
    """
    squeeze = isinstance(query, torch.Tensor) and query.dim() == 3
    if squeeze:  # (nheads, L, E): a batch of one
        query, key, value = (t.unsqueeze(0) if isinstance(t, torch.Tensor) else t
                             for t in (query, key, value))
    checks.tensor("query", query, "(batch, nheads, L, E)")
    checks.tensor("key", key, "(batch, nheads_k, S, E)")
    checks.tensor("value", value, "(batch, nheads_k, S, Ev)")
    checks.same_dtype_and_device({"query": query, "key": key, "value": value})
    batch, nheads, seqlen_q, _ = query.shape
    seqlen_k, nheads_k = key.shape[2], key.shape[1]
    for name, t in (("key", key), ("value", value)):
        if t.shape[0] != batch:
            raise ValueError(f"{name}: batch {t.shape[0]} differs from query's {batch}")
    if value.shape[2] != seqlen_k:
        raise ValueError(f"value: length {value.shape[2]} differs from key's {seqlen_k}")
    if nheads_k != nheads and not enable_gqa:
        raise ValueError(f"key: {nheads_k} heads differ from query's {nheads}; pass "
                         "enable_gqa=True for grouped-query attention")
    names = ("query", "key", "value")
    checks.heads(nheads, nheads_k, key, value, dim=1, names=names)
    checks.head_dims(query, key, value, names=names)
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask: cannot be combined with is_causal=True")
    dropout_p = checks.dropout_p(dropout_p)

    params = AttentionParams(
        softmax_scale=checks.softmax_scale(scale, query.shape[-1], "scale"),
        window_right=seqlen_q - seqlen_k if is_causal else None,  # top-left: j <= i
        attn_bias=_bias(attn_mask, batch, nheads, seqlen_q, seqlen_k, query.device),
        dropout_p=dropout_p, dropout_seed=draw_dropout_seed() if dropout_p > 0 else 0)
    out = run_backend(*(t.transpose(1, 2) for t in (query, key, value)), params, backend, False,
                      False)
    out = out.transpose(1, 2)  # (batch, nheads, L, Ev)
    return out.squeeze(0) if squeeze else out


def _bias(mask, batch, nheads, seqlen_q, seqlen_k, device):
    """attn_mask -> a float bias viewed as (batch|1, nheads|1, L, S), or None."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask: expected a tensor, got {type(mask).__name__}")
    if mask.device != device:
        raise ValueError(f"attn_mask: device {mask.device} differs from query's {device}")
    target = (batch, nheads, seqlen_q, seqlen_k)
    if mask.dim() > 4 or any(m not in (1, t) for m, t in zip(mask.shape[::-1], target[::-1],
                                                              strict=False)):
        raise ValueError(f"attn_mask: shape {tuple(mask.shape)} does not broadcast to {target}")
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, device=device).masked_fill(~mask, -math.inf)
    elif not mask.is_floating_point():
        raise TypeError(f"attn_mask: expected a bool or floating tensor, got {mask.dtype}")
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    # Keep size-1 batch/head dims (broadcast in the tiles); give the query/key dims full size.
    return mask.expand(mask.shape[0], mask.shape[1], seqlen_q, seqlen_k)
