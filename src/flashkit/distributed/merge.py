"""Merge partial attention results by their log-sum-exp (the online softmax, one block at a time).

If rows attend to two disjoint sets of keys A and B, with outputs o_A, o_B and log-sum-exps
lse_A, lse_B, attention over A + B is

    m   = max(lse_A, lse_B)
    lse = m + log(exp(lse_A - m) + exp(lse_B - m))
    o   = (exp(lse_A - m) o_A + exp(lse_B - m) o_B) / exp(lse - m)

(the state merge of flashkit.algorithms.merge with l = 1 per normalised part). A row that has
seen no key yet has lse = -inf and weight 0, so the merge needs no special first step, and a
row with no visible key at all keeps out = 0 and lse = -inf, never NaN.
"""

from __future__ import annotations

import math

import torch

__all__ = ["merge_"]


def merge_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor) -> None:
    """Fold (out, lse) into (out_acc, lse_acc) in place.

    out_acc (b, s, h, dv) and lse_acc (b, h, s) in the accumulation dtype (views are fine: the
    result is written through them); out, lse the same shapes, any floating dtype.
    """
    lse = lse.to(lse_acc.dtype)
    m = torch.maximum(lse_acc, lse)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)  # exp(-inf - 0) = 0, not NaN
    w_acc, w = torch.exp(lse_acc - m), torch.exp(lse - m)  # (b, h, s)
    total = w_acc + w
    has_mass = total > 0
    total = torch.where(has_mass, total, torch.ones_like(total))
    scale_acc = (w_acc / total).transpose(1, 2).unsqueeze(-1)  # (b, s, h, 1)
    scale = (w / total).transpose(1, 2).unsqueeze(-1)
    out_acc.copy_(scale_acc * out_acc + scale * out.to(out_acc.dtype))
    lse_acc.copy_(torch.where(has_mass, m + torch.log(total), torch.full_like(m, -math.inf)))
