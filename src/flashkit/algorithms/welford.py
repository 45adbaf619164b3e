"""Welford's online mean and variance (the essay's quiz), and Chan et al.'s merge of two states.

The variance needs the global mean, just as softmax needs the global max. The same cure works:
keep a running state measured against the running reference point, and correct it when the
reference moves. The state after n values is

    n,   mean_n = (1/n) sum_{i<=n} x_i,   M2_n = sum_{i<=n} (x_i - mean_n)^2

and a new value x updates it (Welford 1962):

    mean_n = mean_{n-1} + (x - mean_{n-1}) / n
    M2_n   = M2_{n-1} + (x - mean_{n-1}) (x - mean_n)

(the essay derives the second line as (N-1) S_N^2 = (N-2) S_{N-1}^2 + (x_N - mean_N)(x_N -
mean_{N-1}), with S^2 = M2 / (N - 1) the sample variance). Two states of disjoint data merge as
(Chan, Golub & LeVeque 1979), with delta = mean_b - mean_a and n = n_a + n_b:

    mean = mean_a + delta n_b / n
    M2   = M2_a + M2_b + delta^2 n_a n_b / n

the analogue of the (m, l, o) merge of attention. Why bother: the one-pass textbook formula
(sum x^2 - (sum x)^2 / n) / (n - 1) subtracts two huge, nearly equal numbers when the mean is
large next to the spread, and loses every digit; Welford only ever squares deviations.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import reduce
from typing import NamedTuple

__all__ = ["Moments", "welford_update", "welford", "merge_moments", "variance",
           "textbook_variance"]


class Moments(NamedTuple):
    """Running state: count, mean and M2 = sum of squared deviations from the mean."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0


def welford_update(state: Moments, x: float) -> Moments:
    """Fold one value into the state."""
    n = state.n + 1
    delta = x - state.mean  # deviation from the old mean
    mean = state.mean + delta / n
    return Moments(n, mean, state.m2 + delta * (x - mean))  # old deviation times new


def welford(xs: Iterable[float]) -> Moments:
    """The state of a whole stream, one value at a time."""
    return reduce(welford_update, xs, Moments())


def merge_moments(a: Moments, b: Moments) -> Moments:
    """Chan et al.'s merge of the states of two disjoint chunks; Moments() is its identity."""
    n = a.n + b.n
    if n == 0:
        return Moments()
    delta = b.mean - a.mean
    return Moments(n, a.mean + delta * b.n / n, a.m2 + b.m2 + delta * delta * a.n * b.n / n)


def variance(state: Moments, ddof: int = 1) -> float:
    """M2 / (n - ddof): ddof=1 the sample variance S^2, ddof=0 the population variance."""
    if state.n <= ddof:
        raise ValueError(f"variance with ddof={ddof} needs more than {ddof} values, "
                         f"got n={state.n}")
    return state.m2 / (state.n - ddof)


def textbook_variance(xs: Sequence[float], ddof: int = 1) -> float:
    """The cancellation-prone one-pass formula, kept to show what Welford avoids."""
    n = len(xs)
    total, total_sq = sum(xs), sum(x * x for x in xs)
    return (total_sq - total * total / n) / (n - ddof)
