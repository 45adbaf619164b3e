"""Attention for one query by online softmax: the 2-pass and 1-pass recurrences of the derivation.

One query q (d,) against keys K (N, d) and values V (N, dv), scores x_i = scale * q . K[i]
(the derivation folds the scale into q; here it defaults to 1/sqrt(d) like every flashkit backend).
The output is o = sum_i softmax(x)_i V[i], a vector (dv,). Scores are made one at a time and
never stored: the N scores of this row exist only as the loop variable.

2-pass: online softmax for (m_N, d_N), then a second pass over K and V that recomputes x_i:

    for i = 1..N:  x_i = q . K[i];  m_i = max(m_{i-1}, x_i)
                   d_i = d_{i-1} e^{m_{i-1} - m_i} + e^{x_i - m_i}
    for i = 1..N:  x_i = q . K[i];  a_i = e^{x_i - m_N} / d_N;  o_i = o_{i-1} + a_i V[i]

1-pass (FlashAttention for one row): keep o_i normalised by the running d_i,

    o_i = sum_{j<=i} e^{x_j - m_i} / d_i V[j]

and rescale it by the same argument as d_i (the old terms were divided by d_{i-1} and measured
against m_{i-1}):

    o_i = o_{i-1} (d_{i-1} e^{m_{i-1} - m_i} / d_i) + (e^{x_i - m_i} / d_i) V[i]

At i = N, m_N and d_N are the true max and denominator, so o_N is the answer. The second pass is
gone because attention never needs the individual a_i, only their weighted sum with V.
(`merge.py` keeps the numerator unnormalised instead and divides once at the end: same values.)
"""

from __future__ import annotations

import math

import torch

from flashkit.algorithms.softmax import online_normalizer

__all__ = ["two_pass_attention", "one_pass_attention"]


def _scorer(q: torch.Tensor, k: torch.Tensor, scale: float | None):
    """i -> x_i = scale * q . K[i], a Python float."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return lambda i: scale * float(q @ k[i])


def two_pass_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float | None = None) -> torch.Tensor:
    """q (d,), k (N, d), v (N, dv) -> o (dv,). Reads K twice, V once."""
    x = _scorer(q, k, scale)
    m, d = online_normalizer(x(i) for i in range(len(k)))  # pass 1: scores stream through
    o = torch.zeros_like(v[0])
    for i in range(len(k)):  # pass 2: recompute x_i rather than store N scores
        a_i = math.exp(x(i) - m) / d
        o = o + a_i * v[i]
    return o


def one_pass_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float | None = None) -> torch.Tensor:
    """q (d,), k (N, d), v (N, dv) -> o (dv,). Reads K and V once."""
    x = _scorer(q, k, scale)
    m, d = -math.inf, 0.0
    o = torch.zeros_like(v[0])
    for i in range(len(k)):
        x_i = x(i)
        m_new = max(m, x_i)
        d_new = d * math.exp(m - m_new) + math.exp(x_i - m_new)
        o = o * (d * math.exp(m - m_new) / d_new) + (math.exp(x_i - m_new) / d_new) * v[i]
        m, d = m_new, d_new
    return o
