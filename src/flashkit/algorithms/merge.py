"""The online-softmax state of attention rows, and the merge of two partial states (the essay).

For one query row with scores x_j and value rows v_j, the partial state of a set J of keys is

    m = max_{j in J} x_j                    running max                  (..., 1)
    l = sum_{j in J} e^{x_j - m}            denominator, measured at m   (..., 1)
    o = sum_{j in J} e^{x_j - m} v_j        numerator (NOT normalised)   (..., dv)

and the attention output over J is o / l (its log-sum-exp is m + log l). Two disjoint sets
merge by bringing both to the common max m = max(m_a, m_b):

    m = max(m_a, m_b)
    l = l_a e^{m_a - m} + l_b e^{m_b - m}
    o = o_a e^{m_a - m} + o_b e^{m_b - m}

The factors are scalars per row, so they distribute over the vector o, and the exponents are
<= 0, so nothing overflows. The merge is commutative (exactly, in floating point too) and
associative (exactly on paper, to rounding in floating point), with identity the empty state
(m, l, o) = (-inf, 0, 0). So a row can be cut into chunks of any sizes, each chunk reduced on its
own, and the chunk states folded in any grouping: one element at a time is the online softmax of
`softmax.py`; one tile at a time is FlashAttention; one GPU's share at a time is ring attention.

Keeping o unnormalised (as the essay's `num` and FlashAttention-2 do) makes the merge two
multiply-adds and puts the division o / l once, at the end, in `finalize`.

Row statistics keep a trailing dimension of 1 (`keepdim=True`) so they broadcast against o.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import reduce
from typing import NamedTuple

import torch

__all__ = ["State", "empty_state", "block_state", "merge", "fold", "finalize", "log_sum_exp"]


class State(NamedTuple):
    """Partial online-softmax state of a batch of rows: m, l (..., 1) and o (..., dv)."""

    m: torch.Tensor
    l: torch.Tensor
    o: torch.Tensor


def empty_state(rows: tuple[int, ...], dv: int, dtype=torch.float64, device=None) -> State:
    """The identity of `merge`: no keys seen yet."""
    return State(m=torch.full((*rows, 1), -math.inf, dtype=dtype, device=device),
                 l=torch.zeros((*rows, 1), dtype=dtype, device=device),
                 o=torch.zeros((*rows, dv), dtype=dtype, device=device))


def _reference_max(m: torch.Tensor) -> torch.Tensor:
    """m, with -inf (a row that has seen no visible key) replaced by 0.

    Exponents are taken relative to this, so an all-masked row gives e^{-inf - 0} = 0 instead of
    e^{-inf - (-inf)} = e^{nan}.
    """
    return torch.where(m == -math.inf, torch.zeros_like(m), m)


def block_state(s: torch.Tensor, v: torch.Tensor) -> State:
    """State of one block of keys: s (..., n) scores (-inf = masked), v (..., n, dv) values."""
    m = s.amax(-1, keepdim=True)  # (..., 1) block-local max
    p = torch.exp(s - _reference_max(m))  # (..., n) in [0, 1]
    return State(m=m, l=p.sum(-1, keepdim=True), o=p @ v)  # o: (..., dv) = (..., n) @ (n, dv)


def merge(a: State, b: State) -> State:
    """Merge the states of two disjoint sets of keys (see the module docstring)."""
    m = torch.maximum(a.m, b.m)
    alpha = torch.exp(a.m - _reference_max(m))  # <= 1: rescales a to the common max
    beta = torch.exp(b.m - _reference_max(m))  # <= 1: rescales b to the common max
    return State(m=m, l=alpha * a.l + beta * b.l, o=alpha * a.o + beta * b.o)


def fold(states: Iterable[State]) -> State:
    """Merge a non-empty sequence of states, left to right."""
    return reduce(merge, states)


def log_sum_exp(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """log sum_j e^{x_j} = m + log l; -inf for a row that saw no visible key (l = 0)."""
    return torch.where(l > 0, m + torch.log(l), torch.full_like(l, -math.inf))


def finalize(state: State) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): out = o / l (..., dv) and lse (..., 1); a row with l = 0 gives out 0."""
    l_safe = torch.where(state.l > 0, state.l, torch.ones_like(state.l))
    return state.o / l_safe, log_sum_exp(state.m, state.l)
