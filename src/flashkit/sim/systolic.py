"""Systolic arrays that tick cycle by cycle (the TPU post): the TPU's weight-stationary MXU and the
output-stationary design often drawn beside it.

Both compute C = A @ B with A (M, K) and B (K, N) on a grid of multiply-accumulate cells that
only talk to their neighbours; nothing is read from memory mid-flight. Both take
``M + K + N - 2`` cycles, and the reason is the *stagger*: a value meant for row (or column) r
enters r cycles late, so that it meets the partial sum (or the other operand) that needs it.

Weight-stationary (TPU MXU), a K x N grid:
    cell (k, n) holds B[k, n] for the whole matmul. A[m, k] enters row k from the left at cycle
    m + k and moves one cell right per cycle; partial sums move one cell down per cycle, each
    cell adding activation x weight. C[m, n] leaves the bottom of column n at cycle
    m + (K - 1) + n, so the last result leaves at cycle M + K + N - 3: M + K + N - 2 cycles,
    counting from 0. (The TPU post's emulator prints 6 for a (2, 3) @ (3, 2) matmul,
    "M+K+N-2+1": its loop ticks once more after the last result has left; here the count stops
    with that result.)

Output-stationary, an M x N grid:
    cell (i, j) accumulates C[i, j] in place. A[i, k] enters row i from the left at cycle k + i
    and moves right; B[k, j] enters column j from the top at cycle k + j and moves down; both
    reach cell (i, j) at cycle i + j + k. The last multiply is at cycle M + N + K - 3, again
    M + K + N - 2 cycles; reading the results out of the cells is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashkit.sim.table import format_table

__all__ = ["SystolicRun", "WeightStationaryArray", "OutputStationaryArray", "systolic_matmul",
           "format_stagger"]

_IDLE = -1  # index marking a cell (or an input slot) with nothing in it this cycle


@dataclass
class SystolicRun:
    """A finished matmul: the product, the cycles it took, and what moved when.

    ``entering[c]`` lists, for cycle c and each row of the grid, the (m, k) of the A element
    entering that row from the left, None where nothing enters. ``leaving[c]`` lists the (m, n)
    of the results leaving the bottom that cycle (weight-stationary; output-stationary results
    stay in their cells).
    """

    product: np.ndarray
    cycles: int
    entering: list[list[tuple[int, int] | None]]
    leaving: list[list[tuple[int, int]]]


def _check_operands(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or 0 in a.shape + b.shape:
        raise ValueError(f"need A (M, K) and B (K, N), non-empty; got A {a.shape}, B {b.shape}")
    return a, b


class WeightStationaryArray:
    """A K x N grid holding B; A streams in from the left, partial sums flow down."""

    def __init__(self, weights: np.ndarray):
        self.weights = np.asarray(weights, dtype=np.float64)
        if self.weights.ndim != 2 or 0 in self.weights.shape:
            raise ValueError(f"weights must be a non-empty matrix, got {self.weights.shape}")

    def matmul(self, a: np.ndarray) -> SystolicRun:
        a, w = _check_operands(a, self.weights)
        (m_total, k_total), n_total = a.shape, w.shape[1]
        rows = np.arange(k_total)
        act = np.zeros((k_total, n_total))               # activation held in each cell
        act_m = np.full((k_total, n_total), _IDLE)       # which row m of A it belongs to
        psum = np.zeros((k_total, n_total))              # partial sum leaving each cell downward
        product = np.full((m_total, n_total), np.nan)
        entering, leaving = [], []
        cycle = 0
        while np.isnan(product).any():
            # Activations move one cell right; A[m, k] enters row k at cycle m + k.
            act = np.roll(act, 1, axis=1)
            act_m = np.roll(act_m, 1, axis=1)
            m_in = cycle - rows
            valid = (m_in >= 0) & (m_in < m_total)
            act_m[:, 0] = np.where(valid, m_in, _IDLE)
            act[:, 0] = np.where(valid, a[np.clip(m_in, 0, m_total - 1), rows], 0.0)
            # Partial sums move one cell down; row 0 starts each column at zero.
            incoming = np.vstack([np.zeros((1, n_total)), psum[:-1]])
            psum = incoming + np.where(act_m != _IDLE, act * w, 0.0)
            # The bottom row's sums are finished results: C[m, n] for the m passing through.
            done = np.flatnonzero(act_m[-1] != _IDLE)
            product[act_m[-1, done], done] = psum[-1, done]
            entering.append([(int(m), int(k)) if ok else None
                             for k, (m, ok) in enumerate(zip(m_in, valid, strict=True))])
            leaving.append([(int(act_m[-1, n]), int(n)) for n in done])
            cycle += 1
        return SystolicRun(product, cycle, entering, leaving)


class OutputStationaryArray:
    """An M x N grid, one accumulator per output; A streams from the left, B from the top."""

    def matmul(self, a: np.ndarray, b: np.ndarray) -> SystolicRun:
        a, b = _check_operands(a, b)
        (m_total, k_total), n_total = a.shape, b.shape[1]
        rows, cols = np.arange(m_total), np.arange(n_total)
        a_val, a_k = np.zeros((m_total, n_total)), np.full((m_total, n_total), _IDLE)
        b_val, b_k = np.zeros((m_total, n_total)), np.full((m_total, n_total), _IDLE)
        acc = np.zeros((m_total, n_total))
        entering, leaving = [], []
        last_cycle = m_total + n_total + k_total - 3
        for cycle in range(last_cycle + 1):
            # A moves right (A[i, k] enters row i at cycle k + i), B moves down (B[k, j] enters
            # column j at cycle k + j).
            a_val, a_k = np.roll(a_val, 1, axis=1), np.roll(a_k, 1, axis=1)
            b_val, b_k = np.roll(b_val, 1, axis=0), np.roll(b_k, 1, axis=0)
            k_a, k_b = cycle - rows, cycle - cols
            ok_a, ok_b = (k_a >= 0) & (k_a < k_total), (k_b >= 0) & (k_b < k_total)
            a_k[:, 0] = np.where(ok_a, k_a, _IDLE)
            a_val[:, 0] = np.where(ok_a, a[rows, np.clip(k_a, 0, k_total - 1)], 0.0)
            b_k[0, :] = np.where(ok_b, k_b, _IDLE)
            b_val[0, :] = np.where(ok_b, b[np.clip(k_b, 0, k_total - 1), cols], 0.0)
            meet = (a_k != _IDLE) & (b_k != _IDLE)
            if (a_k[meet] != b_k[meet]).any():
                raise AssertionError(f"cycle {cycle}: operands of different k met in a cell")
            acc += np.where(meet, a_val * b_val, 0.0)
            entering.append([(int(i), int(k)) if ok else None
                             for i, (k, ok) in enumerate(zip(k_a, ok_a, strict=True))])
            leaving.append([])  # results stay in their cells
        return SystolicRun(acc, last_cycle + 1, entering, leaving)


def systolic_matmul(a: np.ndarray, b: np.ndarray, design: str = "weight") -> SystolicRun:
    """C = A @ B on a ``design`` = "weight" (TPU MXU) or "output" stationary array."""
    if design == "weight":
        return WeightStationaryArray(b).matmul(a)
    if design == "output":
        return OutputStationaryArray().matmul(a, b)
    raise ValueError(f"design must be 'weight' or 'output', got {design!r}")


def format_stagger(result: SystolicRun, design: str = "weight") -> str:
    """The post's stagger diagram: which A element enters each row at each cycle, and (weight-
    stationary) which result leaves the bottom."""
    cycles = range(result.cycles)
    rows = [[f"row {r}"] + [f"A[{e[r][0]},{e[r][1]}]" if e[r] else "." for e in result.entering]
            for r in range(len(result.entering[0]))]
    if design == "weight":
        rows.append(["leaves"] + [" ".join(f"C[{m},{n}]" for m, n in out) or "."
                                  for out in result.leaving])
    return format_table(["cycle"] + [str(c) for c in cycles], rows)
