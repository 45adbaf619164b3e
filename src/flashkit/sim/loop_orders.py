"""Attention's two loop orders, executed against a counting two-level memory (the essay).

``O = softmax(Q K^T) V`` can put either loop outside:

* **inner product** (FlashAttention-2): queries outside, keys and values inside. A query's
  running state (max m, denominator, numerator vector) stays in fast memory until its output is
  finished, so Q is loaded and O stored once per query, but every query (block) streams all of
  K and V again.
* **outer product** (FlashAttention-1): keys and values outside, queries inside. Each (k_j, v_j)
  is loaded once, but every query's state goes back to HBM after each key and comes back for the
  next: Q loads, O loads and O stores are n per query.

The essay's cost comparison, for n queries and n keys, one output in fast memory::

                 inner product    outer product
    Q loads      n                n^2
    KV loads     n^2              n
    O loads      n                n^2
    O stores     n                n^2

Between the two ends lies a spectrum set by how many outputs stay in fast memory. For the inner
product that is ``query_block`` (r queries share each pass over K, V: KV loads n * ceil(n / r));
for the outer product it is ``resident`` (R outputs, with their queries, stay in fast memory
beside the one streaming slot; each saves n - 1 loads and stores, the essay's words, so
Q loads = O loads = O stores = n^2 - R (n - 1), and R = n stores each output once).

Counts are in rows: one query vector, one (k_j, v_j) pair, one output row with its state. With
"element is tile" the same counts hold per tile, n being the number of tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flashkit.sim.table import format_table

__all__ = ["HBMTraffic", "inner_product_attention", "outer_product_attention",
           "format_loop_orders"]


@dataclass
class HBMTraffic:
    """Rows moved between HBM and fast memory, by tensor (the essay's four rows)."""

    q_loads: int = 0
    kv_loads: int = 0
    o_loads: int = 0
    o_stores: int = 0


class _RowState:
    """One query's online-softmax state: running max m, denominator, numerator (the essay)."""

    def __init__(self, dv: int):
        self.m, self.den, self.num = -math.inf, 0.0, np.zeros(dv)

    def update(self, score: float, value: np.ndarray) -> None:
        m_new = max(self.m, score)
        rescale = math.exp(self.m - m_new)  # <= 1, and 0 for the first key (m = -inf)
        weight = math.exp(score - m_new)
        self.den = self.den * rescale + weight
        self.num = self.num * rescale + weight * value
        self.m = m_new

    def output(self) -> np.ndarray:
        return self.num / self.den


def check_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, ...]:
    """q (nq, d), k (nk, d), v (nk, dv) as float64 arrays, or a ValueError naming the shapes."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    if q.ndim != 2 or k.ndim != 2 or v.ndim != 2 or q.shape[1] != k.shape[1] \
            or k.shape[0] != v.shape[0] or 0 in q.shape + k.shape + v.shape:
        raise ValueError(f"need q (nq, d), k (nk, d), v (nk, dv), non-empty; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    return q, k, v


def inner_product_attention(q, k, v, query_block: int = 1) -> tuple[np.ndarray, HBMTraffic]:
    """Queries outside (FlashAttention-2): returns (softmax(q k^T) v, traffic).

    ``query_block`` queries are in fast memory together and share each pass over K and V.
    Traffic: Q loads nq, O loads nq (initialising the state), O stores nq,
    KV loads nk * ceil(nq / query_block).
    """
    q, k, v = check_qkv(q, k, v)
    if query_block < 1:
        raise ValueError(f"query_block must be >= 1, got {query_block}")
    traffic = HBMTraffic()
    out = np.empty((q.shape[0], v.shape[1]))
    for start in range(0, q.shape[0], query_block):
        rows = range(start, min(start + query_block, q.shape[0]))
        traffic.q_loads += len(rows)
        traffic.o_loads += len(rows)  # the state is initialised once per query
        states = {i: _RowState(v.shape[1]) for i in rows}
        for j in range(k.shape[0]):
            traffic.kv_loads += 1  # one (k_j, v_j) for every query in the block
            for i in rows:
                states[i].update(float(q[i] @ k[j]), v[j])
        for i in rows:
            out[i] = states[i].output()
            traffic.o_stores += 1
    return out, traffic


def outer_product_attention(q, k, v, resident: int = 0) -> tuple[np.ndarray, HBMTraffic]:
    """Keys and values outside (FlashAttention-1): returns (softmax(q k^T) v, traffic).

    The first ``resident`` queries keep their state in fast memory for the whole loop; every
    other query streams through one slot: its q and state are loaded for each key and its state
    stored after it (the first load initialises it, as the essay counts). Traffic: KV loads nk;
    Q loads = O loads = O stores = resident + (nq - resident) * nk.
    """
    q, k, v = check_qkv(q, k, v)
    if not 0 <= resident <= q.shape[0]:
        raise ValueError(f"resident must be in [0, {q.shape[0]}] (the number of queries), "
                         f"got {resident}")
    traffic = HBMTraffic(q_loads=resident, o_loads=resident)
    states = [_RowState(v.shape[1]) for _ in range(q.shape[0])]  # HBM or fast memory
    for j in range(k.shape[0]):
        traffic.kv_loads += 1
        for i, state in enumerate(states):
            streamed = i >= resident
            if streamed:
                traffic.q_loads += 1
                traffic.o_loads += 1
            state.update(float(q[i] @ k[j]), v[j])
            if streamed:
                traffic.o_stores += 1
    traffic.o_stores += resident  # resident outputs are written once, at the end
    return np.stack([s.output() for s in states]), traffic


def _in_n(count: int, n: int) -> str:
    """64 -> '64 (n^2)' for n = 8: the essay states these counts as powers of n."""
    names = {n: "n", n * n: "n^2"} if n > 1 else {}
    return f"{count} ({names[count]})" if count in names else str(count)


def format_loop_orders(n: int = 8, d: int = 4, seed: int = 0) -> str:
    """The essay's cost comparison for n queries and keys, measured by running both schedules,
    then the spectrum between them as more outputs stay in fast memory."""
    rng = np.random.default_rng(seed)
    q, k, v = rng.normal(size=(3, n, d))
    (_, inner), (_, outer) = inner_product_attention(q, k, v), outer_product_attention(q, k, v)
    fields = [("Q loads", "q_loads"), ("KV loads", "kv_loads"), ("O loads", "o_loads"),
              ("O stores", "o_stores")]
    seed_table = [["Outer loop", "over queries", "over KV"],
                  ["Inner loop", "over KV", "over queries"]]
    seed_table += [[name, _in_n(getattr(inner, f), n), _in_n(getattr(outer, f), n)]
                   for name, f in fields]
    sizes = sorted({1, 2, n // 2, n} - {0})
    blocked = [[r, inner_product_attention(q, k, v, query_block=r)[1].kv_loads] for r in sizes]
    kept = [[r, t.q_loads, t.o_loads, t.o_stores, t.kv_loads]
            for r in [0, *sizes] for t in [outer_product_attention(q, k, v, resident=r)[1]]]
    return "\n\n".join([
        format_table(["", "Inner product (FA2)", "Outer product (FA1)"], seed_table,
                     title=f"HBM traffic in rows, n = {n} queries and keys, one output in fast "
                           f"memory"),
        format_table(["query block r", "KV loads"], blocked,
                     title="Inner product: r outputs in fast memory share each pass over K, V"),
        format_table(["resident R", "Q loads", "O loads", "O stores", "KV loads"], kept,
                     title="Outer product: R outputs stay in fast memory across the KV loop "
                           "(each saves n - 1)"),
    ])
