"""Tiled attention forward in the two loop orders: FlashAttention-1 and FlashAttention-2.

Both compute out = softmax(scale * Q K^T + mask) V exactly, one (Br x Bc) tile of scores at a
time, and both reduce a row's tiles with the same `merge` (see `merge.py`). What differs is which
loop is outside, and so which data makes round trips between HBM (slow, large) and SRAM (fast,
small). Each function works on an explicit `HBM` object that counts every element moved.

Notation (FA papers): Q (Nq, d), K (Nk, d), V (Nk, dv) in HBM; Tr = ceil(Nq / Br) query tiles
Q_i, Tc = ceil(Nk / Bc) key/value tiles K_j, V_j; S_ij = scale * Q_i K_j^T (Br, Bc).

FA1 (Dao et al. 2022, Algorithm 1): KV tiles outer, Q tiles inner (the "outer product" order of
the essay). O, l, m live in HBM and make a round trip for every (i, j):

    O = 0, l = 0, m = -inf                                           (written to HBM)
    for j = 1..Tc:   load K_j, V_j
      for i = 1..Tr: load Q_i, O_i, l_i, m_i
        m~ = rowmax(S_ij);  P~ = exp(S_ij - m~);  l~ = rowsum(P~)
        m_new = max(m_i, m~);  l_new = e^{m_i - m_new} l_i + e^{m~ - m_new} l~
        O_i = (l_i e^{m_i - m_new} O_i + e^{m~ - m_new} P~ V_j) / l_new   (normalised in HBM)
        store O_i, l_i = l_new, m_i = m_new

The O_i line is `merge` of (m_i, l_i, l_i O_i) with the tile's (m~, l~, P~ V_j), then o / l.

FA2 (Dao 2023, Algorithm 1): Q tiles outer, KV tiles inner (the "inner product" order). The
running (m, l, o) of a query tile stays in registers across all KV tiles; O is divided by l once,
and written once, together with L = m + log l:

    for i = 1..Tr:   load Q_i;  (m, l, o) = (-inf, 0, 0)               (registers)
      for j = 1..Tc: load K_j, V_j;  (m, l, o) = merge((m, l, o), state of S_ij)
      store O_i = o / l,  L_i = m + log l

Traffic, in elements (non-causal): FA1 reads K and V once but Q, O, l, m Tc times, and writes
O, l, m Tc + 1 times; FA2 reads Q once but K and V Tr times, and writes O and L once. With
`causal`, both skip the tiles that lie wholly above the diagonal (no visible key), so they move
less. Causal is bottom-right aligned (key j visible from query i iff j <= i + Nk - Nq), and a
row that sees no key gets out 0, lse -inf, as in `flashkit.reference`.

Shapes: q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv); leading dims (batch, heads) ride along.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import torch

from flashkit.algorithms.merge import State, block_state, empty_state, finalize, log_sum_exp, merge

__all__ = ["Forward", "HBM", "flash1_forward", "flash2_forward"]


class Forward(NamedTuple):
    out: torch.Tensor  # (..., Nq, dv)
    lse: torch.Tensor  # (..., Nq)
    reads: dict[str, int]  # elements loaded from HBM, per tensor name
    writes: dict[str, int]  # elements stored to HBM, per tensor name


class HBM:
    """Slow memory: named tensors of shape (..., rows, width) and a count of every element moved.

    A loaded tile stands for a copy in SRAM; computing on it costs nothing here, moving it does.
    """

    def __init__(self, **tensors: torch.Tensor):
        self.tensors = dict(tensors)
        self.reads: Counter[str] = Counter()
        self.writes: Counter[str] = Counter()

    def allocate(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> None:
        """Reserve an output, NaN-filled so that a row never stored shows up (not traffic)."""
        self.tensors[name] = torch.full(shape, math.nan, dtype=like.dtype, device=like.device)

    def load(self, name: str, rows: slice) -> torch.Tensor:
        tile = self.tensors[name][..., rows, :]
        self.reads[name] += tile.numel()
        return tile

    def store(self, name: str, rows: slice, tile: torch.Tensor) -> None:
        self.tensors[name][..., rows, :] = tile
        self.writes[name] += tile.numel()


def _tiles(n: int, size: int) -> list[slice]:
    """[0, n) cut into slices of `size`; the last one is ragged when size does not divide n."""
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def _visible(i, j, shift: int):
    """Causal predicate (ints or tensors): key j is visible from query i iff j <= i + shift."""
    return j <= i + shift


def _tile_has_visible_key(rows: slice, cols: slice, causal: bool, shift: int) -> bool:
    # The tile's most visible pair is (last row, first column).
    return not causal or _visible(rows.stop - 1, cols.start, shift)


def _scores(q_i: torch.Tensor, k_j: torch.Tensor, rows: slice, cols: slice, scale: float,
            causal: bool, shift: int) -> torch.Tensor:
    """S_ij = scale * Q_i K_j^T with masked pairs set to -inf."""
    s = scale * (q_i @ k_j.transpose(-1, -2))  # (..., Br, Bc) = (..., Br, d) @ (..., d, Bc)
    if causal:
        i = torch.arange(rows.start, rows.stop, device=s.device)[:, None]  # global row index
        j = torch.arange(cols.start, cols.stop, device=s.device)[None, :]  # global column index
        s = s.masked_fill(~_visible(i, j, shift), -math.inf)
    return s


def _setup(q, k, v, scale):
    *batch, seqlen_q, d = q.shape
    seqlen_k, dv = v.shape[-2:]
    return tuple(batch), seqlen_q, seqlen_k, dv, d ** -0.5 if scale is None else scale


def flash1_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   scale: float | None = None, block_q: int = 16, block_k: int = 16) -> Forward:
    """FA1 loop order: KV tiles outer; O, l, m written back to HBM at every step."""
    batch, seqlen_q, seqlen_k, dv, scale = _setup(q, k, v, scale)
    shift = seqlen_k - seqlen_q
    hbm = HBM(Q=q, K=k, V=v)
    init = empty_state((*batch, seqlen_q), dv, q.dtype, q.device)  # O = 0, l = 0, m = -inf
    for name, t in (("O", init.o), ("l", init.l), ("m", init.m)):
        hbm.allocate(name, t.shape, q)
        hbm.store(name, slice(None), t)

    for cols in _tiles(seqlen_k, block_k):  # outer: each KV tile is loaded once
        k_j, v_j = hbm.load("K", cols), hbm.load("V", cols)
        for rows in _tiles(seqlen_q, block_q):  # inner: Q_i, O_i, l_i, m_i make a round trip
            if not _tile_has_visible_key(rows, cols, causal, shift):
                continue
            q_i = hbm.load("Q", rows)
            o_i, l_i, m_i = hbm.load("O", rows), hbm.load("l", rows), hbm.load("m", rows)
            s = _scores(q_i, k_j, rows, cols, scale, causal, shift)
            new = merge(State(m_i, l_i, l_i * o_i), block_state(s, v_j))  # un-normalise O_i
            o_new, _ = finalize(new)  # FA1 keeps O normalised in HBM
            hbm.store("O", rows, o_new)
            hbm.store("l", rows, new.l)
            hbm.store("m", rows, new.m)

    # FA1 returns O, l, m; lse = m + log l is derived from them for comparison with FA2.
    lse = log_sum_exp(hbm.tensors["m"], hbm.tensors["l"])
    return Forward(hbm.tensors["O"], lse.squeeze(-1), dict(hbm.reads), dict(hbm.writes))


def flash2_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   scale: float | None = None, block_q: int = 16, block_k: int = 16) -> Forward:
    """FA2 loop order: Q tiles outer; the running state stays on chip; O and L written once."""
    batch, seqlen_q, seqlen_k, dv, scale = _setup(q, k, v, scale)
    shift = seqlen_k - seqlen_q
    hbm = HBM(Q=q, K=k, V=v)
    hbm.allocate("O", (*batch, seqlen_q, dv), q)
    hbm.allocate("L", (*batch, seqlen_q, 1), q)

    for rows in _tiles(seqlen_q, block_q):  # outer: each Q tile is loaded once
        q_i = hbm.load("Q", rows)
        acc = empty_state((*batch, rows.stop - rows.start), dv, q.dtype, q.device)  # registers
        for cols in _tiles(seqlen_k, block_k):  # inner: every KV tile, again for each Q tile
            if not _tile_has_visible_key(rows, cols, causal, shift):
                continue
            k_j, v_j = hbm.load("K", cols), hbm.load("V", cols)
            acc = merge(acc, block_state(_scores(q_i, k_j, rows, cols, scale, causal, shift), v_j))
        o_i, lse_i = finalize(acc)  # the one division by l
        hbm.store("O", rows, o_i)
        hbm.store("L", rows, lse_i)

    return Forward(hbm.tensors["O"], hbm.tensors["L"].squeeze(-1), dict(hbm.reads),
                   dict(hbm.writes))
