"""A cycle model of one TPU core (the TPU post): matmuls on the MXU, everything else on the VPU.

The simulator *runs* attention (the numbers are real and checked against a reference) and
charges every operation to the unit that would execute it.

MXU model (the TPU post's, kept as it is so its numbers come out):
    a matmul (M, K) @ (K, N) costs ``M + K + N - 2`` cycles and does ``2 M K N`` flops.
    Utilisation = flops / (2 * mxu_dim^2 * MXU cycles): the fraction of the 128 x 128 cells
    doing a multiply-add each cycle. When every dimension is at most ``tick_limit`` (16, as in
    the post) the matmul runs through :class:`~flashkit.sim.systolic.WeightStationaryArray`,
    tick by tick, and the ticked count must equal the formula; larger ones use the formula.
    The model does not split a matmul bigger than the array into passes, as the post does not:
    it is a pipeline-fill model, and its lesson is the ratio of useful work to fill and drain.

VPU model (the TPU post prints its VPU totals but not its op list; this list is our reconstruction,
following the post's code, and the one we found that reproduces all three printed totals):
    the VPU is ``vpu_width`` = 128 lanes wide; an elementwise op or reduction over E elements
    costs ``ceil(E / 128) * c`` cycles with c = 2 for exp (a transcendental) and 1 for the rest.

    standard attention, per (n x n) score matrix, in the post's code order:
        scale, [build the causal mask (n x n, materialised), apply it], row max,
        subtract max, exp (2), row sum, divide by the sum          9 passes causal, 7 not
    flash attention, per call: four index vectors (query offsets, key offsets, query-block
    starts, the starts times block_m); per query block (bm rows, head dim d):
        row positions, row validity, init running max, init running sum   4 ops on bm
        final divide of the accumulator                                   1 op on bm x d
    and per visited (bm x bn) tile:
        scale, apply mask (causal or padding), row max, subtract max, exp (2),
        row sum                                                               7 on bm x bn
        new max, m_old - m_new, exp (2) of it, rescale sum, add tile sum      6 on bm
        rescale accumulator, add P V                                          2 on bm x d
    Causal flash skips tiles that lie wholly above the diagonal; standard attention pays for
    the masked half (exp(-inf) included). Guards that keep padded rows finite are not charged.

With these, n = 512, d = 64 gives the TPU post's table exactly: total / MXU / VPU cycles
24,556 / 13,680 / 10,876 (block 64), 16,936 / 6,360 / 10,576 (block 128), 20,604 / 2,172 /
18,432 (standard); MXU utilisation 8.4%, 20.1%, 94.3%.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flashkit.sim.systolic import WeightStationaryArray
from flashkit.sim.table import format_table, thousands

__all__ = ["TPUCycleSimulator", "standard_attention", "flash_attention", "AttentionCycles",
           "compare_attention", "format_comparison", "format_vpu_breakdown"]

EXP_CYCLES_PER_VECTOR = 2


class TPUCycleSimulator:
    """Counts MXU cycles, MXU flops and VPU cycles (by op name) as attention runs."""

    def __init__(self, mxu_dim: int = 128, vpu_width: int = 128, tick_limit: int = 16):
        if min(mxu_dim, vpu_width) < 1 or tick_limit < 0:
            raise ValueError(f"mxu_dim and vpu_width must be >= 1 and tick_limit >= 0, got "
                             f"{mxu_dim}, {vpu_width}, {tick_limit}")
        self.mxu_dim, self.vpu_width, self.tick_limit = mxu_dim, vpu_width, tick_limit
        self.mxu_cycles = self.mxu_flops = self.vpu_cycles = self.ticked_matmuls = 0
        self.vpu_ledger: dict[str, int] = defaultdict(int)

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """A @ B on the MXU: M + K + N - 2 cycles, ticked through the array when small."""
        (m, k), n = a.shape, b.shape[1]
        cycles = m + k + n - 2
        if max(m, k, n) <= self.tick_limit:
            result = WeightStationaryArray(b).matmul(a)
            if result.cycles != cycles:
                raise AssertionError(f"systolic array took {result.cycles} cycles for "
                                     f"({m}, {k}) @ ({k}, {n}), the formula says {cycles}")
            product = result.product
            self.ticked_matmuls += 1
        else:
            product = a @ b
        self.mxu_cycles += cycles
        self.mxu_flops += 2 * m * k * n
        return product

    def vpu(self, name: str, elements: int, cycles_per_vector: int = 1) -> None:
        """Charge an elementwise op or reduction over ``elements`` values to the VPU."""
        cycles = math.ceil(elements / self.vpu_width) * cycles_per_vector
        self.vpu_cycles += cycles
        self.vpu_ledger[name] += cycles

    @property
    def total_cycles(self) -> int:
        """MXU and VPU do not overlap in this model (the post adds them)."""
        return self.mxu_cycles + self.vpu_cycles

    @property
    def mxu_utilisation(self) -> float:
        return self.mxu_flops / (2 * self.mxu_dim**2 * self.mxu_cycles) if self.mxu_cycles \
            else 0.0


def _check(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, ...]:
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    if q.ndim != 2 or q.shape != k.shape or q.shape != v.shape or 0 in q.shape:
        raise ValueError(f"q, k, v must all be (n, d) and non-empty (the TPU post's setting), got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    return q, k, v


def standard_attention(sim: TPUCycleSimulator, q, k, v, causal: bool = True) -> np.ndarray:
    """softmax(q k^T / sqrt(d)) v with the whole (n, n) score matrix, charged to ``sim``."""
    q, k, v = _check(q, k, v)
    n, d = q.shape
    scores = sim.matmul(q, k.T)                                      # [n, n] = [n, d] @ [d, n]
    size = n * n
    sim.vpu("scale scores", size)
    scores = scores / math.sqrt(d)
    if causal:
        sim.vpu("build causal mask", size)
        above = np.triu(np.ones((n, n), dtype=bool), k=1)
        sim.vpu("apply mask", size)
        scores = np.where(above, -np.inf, scores)
    sim.vpu("row max", size)
    sim.vpu("subtract max", size)
    sim.vpu("exp", size, EXP_CYCLES_PER_VECTOR)
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    sim.vpu("row sum", size)
    sim.vpu("divide by sum", size)
    weights /= weights.sum(axis=1, keepdims=True)
    return sim.matmul(weights, v)                                    # [n, d] = [n, n] @ [n, d]


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    return np.vstack([x, np.zeros((rows - x.shape[0], x.shape[1]))])


def flash_attention(sim: TPUCycleSimulator, q, k, v, block_m: int = 128, block_n: int = 128,
                    causal: bool = True) -> np.ndarray:
    """Tiled online-softmax attention (the TPU post's flash_attention_tiled), charged to ``sim``.

    Inputs are padded to whole tiles, as in the post's JAX code, so every tile is full size;
    causal attention skips the tiles wholly above the diagonal.
    """
    q, k, v = _check(q, k, v)
    if block_m < 1 or block_n < 1:
        raise ValueError(f"block_m and block_n must be >= 1, got {block_m}, {block_n}")
    n, d = q.shape
    q_blocks, k_blocks = math.ceil(n / block_m), math.ceil(n / block_n)
    q_pad, k_pad, v_pad = _pad_rows(q, q_blocks * block_m), _pad_rows(k, k_blocks * block_n), \
        _pad_rows(v, k_blocks * block_n)
    scale = 1 / math.sqrt(d)
    for name, size in [("query offsets", block_m), ("key offsets", block_n),
                       ("query block starts", q_blocks), ("block starts x block_m", q_blocks)]:
        sim.vpu(name, size)
    out = np.empty((q_blocks * block_m, d))
    cols_in_tile = np.arange(block_n)
    for qb in range(q_blocks):
        rows = qb * block_m + np.arange(block_m)
        for name in ("row positions", "row validity", "init running max", "init running sum"):
            sim.vpu(name, block_m)
        m, l, acc = np.full(block_m, -np.inf), np.zeros(block_m), np.zeros((block_m, d))
        last_row = min(rows[-1], n - 1)
        for kb in range(k_blocks):
            if causal and kb * block_n > last_row:
                break  # every key in this tile is in the future of every row: skip it
            cols = kb * block_n + cols_in_tile
            tile = slice(kb * block_n, (kb + 1) * block_n)
            s = sim.matmul(q_pad[rows], k_pad[tile].T)  # [bm, bn] = [bm, d] @ [d, bn]
            sim.vpu("scale scores", s.size)
            visible = (rows[:, None] < n) & (cols[None, :] < n)
            if causal:
                visible &= rows[:, None] >= cols[None, :]
            if causal or not visible.all():
                sim.vpu("apply mask", s.size)
            s = np.where(visible, s * scale, -np.inf)
            sim.vpu("row max", s.size)
            sim.vpu("new running max", block_m)
            m_new = np.maximum(m, s.max(axis=1))
            # A padded row sees no key: keep its max finite so it stays exactly zero, not NaN.
            m_safe = np.where(np.isfinite(m_new), m_new, 0.0)
            sim.vpu("m_old - m_new", block_m)
            sim.vpu("exp rescale", block_m, EXP_CYCLES_PER_VECTOR)
            rescale = np.exp(m - m_safe)
            sim.vpu("subtract max", s.size)
            sim.vpu("exp", s.size, EXP_CYCLES_PER_VECTOR)
            p = np.exp(s - m_safe[:, None])
            sim.vpu("row sum", s.size)
            sim.vpu("rescale running sum", block_m)
            sim.vpu("add tile sum", block_m)
            l = l * rescale + p.sum(axis=1)
            sim.vpu("rescale accumulator", acc.size)
            pv = sim.matmul(p, v_pad[tile])             # [bm, d] = [bm, bn] @ [bn, d]
            sim.vpu("add P V", acc.size)
            acc = acc * rescale[:, None] + pv
            m = m_new
        sim.vpu("divide accumulator", acc.size)
        out[rows] = np.where(l[:, None] > 0, acc / np.where(l > 0, l, 1.0)[:, None], 0.0)
    return out[:n]


@dataclass
class AttentionCycles:
    """One column of the TPU post's table, plus the output and the VPU ledger behind it."""

    label: str
    mxu_cycles: int
    vpu_cycles: int
    mxu_utilisation: float
    output: np.ndarray
    vpu_ledger: dict[str, int]

    @property
    def total_cycles(self) -> int:
        return self.mxu_cycles + self.vpu_cycles


def _measure(label: str, attention, *args, **kwargs) -> AttentionCycles:
    sim = TPUCycleSimulator()
    out = attention(sim, *args, **kwargs)
    return AttentionCycles(label, sim.mxu_cycles, sim.vpu_cycles, sim.mxu_utilisation, out,
                           dict(sim.vpu_ledger))


def compare_attention(n: int = 512, d: int = 64, blocks: Sequence[int] = (64, 128),
                      causal: bool = True, seed: int = 0) -> list[AttentionCycles]:
    """Flash attention at each block size (square tiles), then standard attention."""
    if n < 1 or d < 1 or not blocks:
        raise ValueError(f"need n >= 1, d >= 1 and at least one block size, got n={n}, d={d}, "
                         f"blocks={list(blocks)}")
    q, k, v = np.random.default_rng(seed).normal(size=(3, n, d))
    runs = [_measure(f"block={b}", flash_attention, q, k, v, b, b, causal) for b in blocks]
    return runs + [_measure("standard", standard_attention, q, k, v, causal)]


def format_comparison(runs: Sequence[AttentionCycles], title: str = "") -> str:
    """The TPU post's table: configurations as columns, the standard (last) as the baseline."""
    baseline = runs[-1].total_cycles
    rows = [["Total cycles"] + [thousands(r.total_cycles) for r in runs],
            ["MXU cycles"] + [thousands(r.mxu_cycles) for r in runs],
            ["VPU cycles"] + [thousands(r.vpu_cycles) for r in runs],
            ["MXU utilization"] + [f"{100 * r.mxu_utilisation:.1f}%" for r in runs],
            ["vs standard"] + [f"{r.total_cycles / baseline:.2f}x" for r in runs]]
    return format_table([""] + [r.label for r in runs], rows, title=title)


def format_vpu_breakdown(runs: Sequence[AttentionCycles]) -> str:
    """VPU cycles per op, one column per configuration: where the VPU time goes."""
    names = list(dict.fromkeys(name for r in runs for name in r.vpu_ledger))
    rows = [[name] + [thousands(r.vpu_ledger.get(name, 0)) for r in runs] for name in names]
    rows.append(["total"] + [thousands(r.vpu_cycles) for r in runs])
    return format_table(["VPU op"] + [r.label for r in runs], rows)


VMEM_MIB = 128  # a TPU v5e's on-chip VMEM, about 128 MB


def vmem_table(ns: Sequence[int], d: int = 64, element_bytes: int = 4,
               vmem_mib: float = VMEM_MIB) -> list[tuple[int, float, float, bool]]:
    """(n, score matrix MiB, output MiB, fits) for one head: the (n, n) scores against the
    (n, d) output, and whether the scores fit in ``vmem_mib`` of on-chip memory."""
    rows = []
    for n in ns:
        if n < 1:
            raise ValueError(f"sequence lengths must be >= 1, got {n}")
        scores, output = n * n * element_bytes / 2**20, n * d * element_bytes / 2**20
        rows.append((n, scores, output, scores <= vmem_mib))
    return rows


def format_vmem_table(ns: Sequence[int] = tuple(512 * 2**i for i in range(7)), d: int = 64,
                      element_bytes: int = 4, vmem_mib: float = VMEM_MIB) -> str:
    """The JAX/TPU write-up's memory table, computed: where the score matrix stops fitting."""
    rows = vmem_table(ns, d, element_bytes, vmem_mib)
    body = [[n, f"{s:,.1f}", f"{o:,.2f}", f"{s / o:,.1f}x", "yes" if fits else "NO"]
            for n, s, o, fits in rows]
    table = format_table(["n", "scores (n^2) MiB", "output (n d) MiB", "ratio",
                          f"fits {vmem_mib:g} MiB?"], body,
                         title=f"One head, d = {d}, {element_bytes}-byte elements: the score "
                               "matrix against the output")
    fitting = [n for n, _, _, fits in rows if fits]
    over = [n for n, _, _, fits in rows if not fits]
    if fitting and over:
        verdict = (f"The score matrix fits up to n = {max(fitting)} and stops fitting at "
                   f"n = {min(over)} ({rows[[r[0] for r in rows].index(min(over))][1]:,.0f} MiB).")
    elif over:
        verdict = "The score matrix fits at none of these lengths."
    else:
        verdict = "The score matrix fits at every one of these lengths."
    return (table + "\n" + verdict + " The ratio is n / d: the output grows linearly, the "
            "scores quadratically. Several heads, or d = 128 in bf16 with many heads sharing "
            "the memory, move the limit down; a GPU SM's shared memory (228 KiB on Hopper) "
            f"holds the scores of one head only up to n = {_fits(228 / 1024, element_bytes)}.")


def _fits(mib: float, element_bytes: int) -> int:
    """The largest n whose (n, n) scores fit in mib MiB."""
    return int((mib * 2**20 / element_bytes) ** 0.5)
