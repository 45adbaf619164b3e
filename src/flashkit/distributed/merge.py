"""Merge partial attention results by their log-sum-exp (the online softmax, one block at a time).

If rows attend to two disjoint sets of keys A and B, with outputs o_A, o_B and log-sum-exps
lse_A, lse_B, attention over A + B is

    m   = max(lse_A, lse_B)
    lse = m + log(exp(lse_A - m) + exp(lse_B - m))
    o   = (exp(lse_A - m) o_A + exp(lse_B - m) o_B) / exp(lse - m)

(the state merge of flashkit.algorithms.merge with l = 1 per normalised part), computed by the
tiled backend's merge_by_lse, the one the split-KV decode path uses too. A row that has seen no
key yet has lse = -inf and weight 0, so the merge needs no special first step, and a row with no
visible key at all keeps out = 0 and lse = -inf, never NaN.
"""

from __future__ import annotations

import torch

from flashkit.ops.tiled.tile import merge_by_lse

__all__ = ["merge_"]


def merge_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor) -> None:
    """Fold (out, lse) into (out_acc, lse_acc) in place.

    out_acc (b, s, h, dv) and lse_acc (b, h, s) in the accumulation dtype (views are fine: the
    result is written through them); out, lse the same shapes, any floating dtype.
    """
    merged_out, merged_lse = merge_by_lse(
        torch.stack([out_acc, out.to(out_acc.dtype)]),  # (2, b, s, h, dv)
        torch.stack([lse_acc, lse.to(lse_acc.dtype)]).transpose(-1, -2))  # (2, b, s, h)
    out_acc.copy_(merged_out)
    lse_acc.copy_(merged_lse.transpose(-1, -2))
