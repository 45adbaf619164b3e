"""Softmax three ways, as scalar streaming loops (the derivation and the essay).

All three compute a_i = e^{x_i} / sum_k e^{x_k}; they differ in how many passes over x they make
and in whether they survive large inputs. Plain Python floats and `math.exp`, one element at a
time, so every line is one step of the recurrence on the page.

Native (2 passes; overflows: math.exp(710) is already out of float64's range):

    for i = 1..N:  d_i = d_{i-1} + e^{x_i}
    for i = 1..N:  a_i = e^{x_i} / d_N

Safe (3 passes; the exponents are <= 0, so nothing overflows):

    for i = 1..N:  m_i = max(m_{i-1}, x_i)
    for i = 1..N:  d_i = d_{i-1} + e^{x_i - m_N}
    for i = 1..N:  a_i = e^{x_i - m_N} / d_N

Online (2 passes, Milakov & Gimelshein 2018): the max and the denominator in one pass. d_i is the
sum so far measured against the running max m_i; when the max grows, the old sum is rescaled:

    d_i = sum_{j<=i} e^{x_j - m_i}
        = (sum_{j<i} e^{x_j - m_{i-1}}) e^{m_{i-1} - m_i} + e^{x_i - m_i}
        = d_{i-1} e^{m_{i-1} - m_i} + e^{x_i - m_i}

    for i = 1..N:  m_i = max(m_{i-1}, x_i);  d_i = d_{i-1} e^{m_{i-1} - m_i} + e^{x_i - m_i}
    for i = 1..N:  a_i = e^{x_i - m_N} / d_N

The rescale factor e^{m_{i-1} - m_i} has an exponent <= 0, so it is <= 1 and cannot overflow
(e^{m_{i-1}} / e^{m_i} is the same number on paper and overflows in practice). Starting from
m_0 = -inf, d_0 = 0 makes the first step give m_1 = x_1, d_1 = 1 with no special case.

The inputs here are finite numbers. Masked scores (-inf) are the business of the tensor state in
`merge.py`, which takes exponents relative to 0 for a row that has seen nothing but -inf.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

__all__ = ["native_softmax", "safe_softmax", "online_softmax", "online_steps",
           "online_normalizer"]


def native_softmax(x: Sequence[float]) -> list[float]:
    """Two passes, no max: raises OverflowError once some x_i > ~709.78 (float64)."""
    d = 0.0
    for x_i in x:  # pass 1: the denominator
        d = d + math.exp(x_i)
    return [math.exp(x_i) / d for x_i in x]  # pass 2: normalise


def safe_softmax(x: Sequence[float]) -> list[float]:
    """Three passes: the global max first, then the denominator, then normalise."""
    m = -math.inf
    for x_i in x:  # pass 1: m_N
        m = max(m, x_i)
    d = 0.0
    for x_i in x:  # pass 2: d_N against the final max
        d = d + math.exp(x_i - m)
    return [math.exp(x_i - m) / d for x_i in x]  # pass 3: normalise


def online_steps(x: Iterable[float]) -> Iterator[tuple[float, float]]:
    """Yield the running (m_i, d_i) after each element: the one-pass max-and-denominator loop.

    Takes any iterable, so it really is single-pass: a generator of scores works (the 2-pass
    attention in `online_attention` feeds it scores computed on the fly).
    """
    m, d = -math.inf, 0.0
    for x_i in x:
        m_new = max(m, x_i)
        d = d * math.exp(m - m_new) + math.exp(x_i - m_new)  # rescale the old sum, add the new
        m = m_new
        yield m, d


def online_normalizer(x: Iterable[float]) -> tuple[float, float]:
    """(m_N, d_N) in one pass: the max and sum_j e^{x_j - m_N}. Empty input gives (-inf, 0)."""
    last = deque(online_steps(x), maxlen=1)  # run the loop, keep only the final state
    return last[0] if last else (-math.inf, 0.0)


def online_softmax(x: Sequence[float]) -> list[float]:
    """Two passes: online (m, d), then normalise."""
    m, d = online_normalizer(x)  # pass 1
    return [math.exp(x_i - m) / d for x_i in x]  # pass 2
