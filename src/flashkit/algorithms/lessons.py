"""Worked examples of the algorithms behind FlashAttention (`flashkit learn <topic>`)."""

from __future__ import annotations

import math

import torch

from flashkit import reference
from flashkit.algorithms.merge import State, block_state, empty_state, finalize, fold, merge
from flashkit.algorithms.online_attention import one_pass_attention, two_pass_attention
from flashkit.algorithms.softmax import native_softmax, online_softmax, online_steps, safe_softmax
from flashkit.algorithms.tiled import flash1_forward, flash2_forward
from flashkit.algorithms.welford import (
    merge_moments,
    textbook_variance,
    variance,
    welford,
    welford_update,
)

__all__ = ["softmax", "merge_states", "loop_orders", "welford_variance"]

# The derivation's example: scores x = [1..6] and scalar values v = [1..6].
SEED_X = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def _vec(xs) -> str:
    return "[" + ", ".join(f"{x:.4f}" for x in xs) + "]"


def softmax() -> None:
    """The derivation's softmax of [1..6] and o = a @ v through every variant."""
    x = torch.tensor(SEED_X, dtype=torch.float64)
    v = x.clone()
    print("Softmax of x = [1, 2, 3, 4, 5, 6], then o = a @ v with v = [1, 2, 3, 4, 5, 6]"
          " (the derivation)\n")
    print(f"  {'variant':<32}{'a':<52}o")
    rows = [("torch.softmax (the answer)", torch.softmax(x, -1).tolist()),
            ("native softmax (2 passes)", native_softmax(SEED_X)),
            ("safe softmax (3 passes)", safe_softmax(SEED_X)),
            ("online softmax (2 passes)", online_softmax(SEED_X))]
    for name, a in rows:
        o = sum(a_i * v_i for a_i, v_i in zip(a, SEED_X, strict=True))
        print(f"  {name:<32}{_vec(a):<52}{o:.4f}")
    # As attention: one query q = [1] against keys K[i] = [x_i] (scale 1) gives scores x_i.
    q, k, vv = torch.ones(1, dtype=torch.float64), x[:, None], v[:, None]
    for name, attend in (("2-pass online attention", two_pass_attention),
                         ("1-pass online attention", one_pass_attention)):
        print(f"  {name:<32}{'(never formed)':<52}{attend(q, k, vv, scale=1.0).item():.4f}")

    print("\nThe online pass, step by step: d_i = d_{i-1} e^{m_{i-1} - m_i} + e^{x_i - m_i}\n")
    print(f"  {'i':>2} {'x_i':>5} {'m_i':>5} {'e^(m_{i-1}-m_i)':>16} {'d_i':>8}")
    m_prev = float("-inf")
    for i, (x_i, (m, d)) in enumerate(zip(SEED_X, online_steps(SEED_X), strict=True), start=1):
        rescale = math.exp(m_prev - m)
        print(f"  {i:>2} {x_i:>5.1f} {m:>5.1f} {rescale:>16.4f} {d:>8.4f}")
        m_prev = m

    big = [1000.0, 1001.0, 1002.0]
    print(f"\nWhy the max matters: x = {big}")
    try:
        native_softmax(big)
    except OverflowError as err:
        print(f"  native: OverflowError ({err}): e^1000 is beyond float64")
    print(f"  safe:   {_vec(safe_softmax(big))}")
    print(f"  online: {_vec(online_softmax(big))}")


def merge_states() -> None:
    """Cut the derivation's row into chunks, reduce each, merge the states in different orders."""
    x = torch.tensor(SEED_X, dtype=torch.float64)
    v = x[:, None]  # (6, 1): scalar values as vectors of width 1
    chunks = {"A": slice(0, 2), "B": slice(2, 5), "C": slice(5, 6)}
    states = {name: block_state(x[c], v[c]) for name, c in chunks.items()}

    def show(label: str, s: State) -> None:
        out, lse = finalize(s)
        print(f"  {label:<22} m = {s.m.item():4.1f}   l = {s.l.item():7.4f}   "
              f"o = {s.o.item():8.4f}   o / l = {out.item():.4f}   lse = {lse.item():.4f}")

    print("State (m, l, o) of x = [1..6], v = [1..6] cut into A = [1, 2], B = [3, 4, 5], C = [6]")
    print("merge: m = max(m_a, m_b), l = l_a e^{m_a - m} + l_b e^{m_b - m}, "
          "o = o_a e^{m_a - m} + o_b e^{m_b - m}\n")
    for name, s in states.items():
        show(f"{name} = {x[chunks[name]].tolist()}", s)
    a, b, c = states["A"], states["B"], states["C"]
    print()
    show("(A + B) + C", merge(merge(a, b), c))
    show("A + (B + C)", merge(a, merge(b, c)))
    show("(C + A) + B", merge(merge(c, a), b))
    show("empty + A + B + C", fold([empty_state((), 1), a, b, c]))
    show("one element at a time", fold([block_state(x[i:i + 1], v[i:i + 1]) for i in range(6)]))
    print("\nEvery grouping gives o / l = softmax(x) @ v = 5.4329; lse = log sum e^x = 6.4562.")


def loop_orders(seqlen: int = 256, headdim: int = 64, block: int = 64) -> None:
    """HBM traffic of the FA1 and FA2 loop orders on one head, and their error."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(seqlen, headdim, generator=gen, dtype=torch.float64)
               for _ in range(3))
    tiles = -(-seqlen // block)
    print(f"One head, Nq = Nk = {seqlen}, d = dv = {headdim}, Br = Bc = {block} "
          f"(Tr = Tc = {tiles}); elements moved between HBM and SRAM\n")
    for causal in (False, True):
        expected, _ = reference.attention(q[None, :, None], k[None, :, None], v[None, :, None],
                                          causal=causal)
        runs = {name: forward(q, k, v, causal=causal, block_q=block, block_k=block)
                for name, forward in (("FA1 (KV outer)", flash1_forward),
                                      ("FA2 (Q outer)", flash2_forward))}
        print(f"causal = {causal}")
        print(f"  {'':<8}" + "".join(f"{name + ' reads':>22}{'writes':>10}" for name in runs))
        names = [n for n in "QKVOlmL" if any(n in r.reads or n in r.writes for r in runs.values())]
        for n in names + ["total"]:
            cells = []
            for r in runs.values():
                reads = sum(r.reads.values()) if n == "total" else r.reads.get(n, 0)
                writes = sum(r.writes.values()) if n == "total" else r.writes.get(n, 0)
                cells.append(f"{reads:>22,}{writes:>10,}")
            print(f"  {n:<8}" + "".join(cells))
        errors = "".join(f"{(r.out - expected[0, :, 0]).abs().max().item():>32.1e}"
                         for r in runs.values())
        print(f"  {'max |out - reference|':<22}{errors}\n")
    print("FA1 loads each K, V tile once but moves Q, O, l, m once per KV tile (Tc times);")
    print("FA2 loads each Q tile once and writes O once but reads K, V once per Q tile (Tr times).")


def welford_variance() -> None:
    """The essay's quiz: Welford's running (n, mean, M2), Chan's merge, and why it matters."""
    xs = [2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]
    print(f"Welford on x = {xs}: mean += (x - mean) / n, M2 += (x - mean_old)(x - mean_new)\n")
    print(f"  {'n':>2} {'x':>5} {'mean':>8} {'M2':>8}")
    state = welford([])
    for x in xs:
        state = welford_update(state, x)
        print(f"  {state.n:>2} {x:>5.1f} {state.mean:>8.4f} {state.m2:>8.4f}")
    print(f"  sample variance M2 / (n - 1) = {variance(state):.4f}, "
          f"population M2 / n = {variance(state, ddof=0):.4f}")

    left, right = welford(xs[:3]), welford(xs[3:])
    merged = merge_moments(left, right)
    print(f"\nChan's merge of the states of {xs[:3]} and {xs[3:]}:")
    for name, s in (("left", left), ("right", right)):
        print(f"  {name:<6} n = {s.n}, mean = {s.mean:.4f}, M2 = {s.m2:.4f}")
    print(f"  merged n = {merged.n}, mean = {merged.mean:.4f}, M2 = {merged.m2:.4f}"
          "  (the same as streaming all eight)")

    shifted = [1e9 + x for x in (4.0, 7.0, 13.0, 16.0)]
    print("\nLarge mean, small spread: x = 1e9 + [4, 7, 13, 16] (true sample variance 30)")
    print(f"  textbook (sum x^2 - (sum x)^2 / n) / (n - 1) = {textbook_variance(shifted)}")
    print(f"  Welford                                      = {variance(welford(shifted))}")
