"""The attention backward's cost arguments, executed: every HBM transfer counted as it happens.

The backward of O = softmax(S) V, S = scale Q K^T, with the forward's log-sum-exp L kept:

    P = exp(S - L)          recomputed tile by tile, never stored
    dV = P^T dO             dP = dO V^T
    dS = P o (dP - D)       D_i = sum_j P_ij dP_ij = rowsum(dO o O)_i
    dQ = scale dS K         dK = scale dS^T Q

Two arguments of the FlashAttention backward, counted here on (B_r query rows) x (B_c keys) tiles:

* The D trick. D_i = sum_j P_ij dP_ij needs a whole row of P and dP, so computed that way it is a
  pass over every K, V tile before dS can be formed, and the main pass loads K and V again: K
  is loaded twice. rowsum(dO o O) is the same number (sum_j P_ij dP_ij = dO_i . sum_j P_ij V_j =
  dO_i . O_i) from two (N, d) tensors already in HBM: K and V are loaded once.
* Loop order. Queries outside (row-wise) finishes one row of dQ in fast memory (an inner product)
  but dK and dV get a rank-B_r update from every query tile (outer products: read and written
  back T_r times). Keys and values outside (column-wise, FlashAttention-2's backward) finishes dK
  and dV (two inner products) and leaves only dQ as an outer product.

Counts are in elements per tensor (`flashkit.sim.hbm.IOCount`); the statistics (lse, D) are
float32 in bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flashkit.sim.hbm import IOCount
from flashkit.sim.table import format_table

__all__ = ["Gradients", "attention_backward", "format_d_trick", "format_loop_orders",
           "format_arithmetic_intensity", "lesson"]

ORDERS = ("row", "column")  # queries outside / keys and values outside
HOPPER_BF16_FLOPS = 989e12  # dense bf16 Tensor Core peak of an H100/H200 SXM
HOPPER_HBM_BYTES_PER_S = {"H100 SXM": 3.35e12, "H200": 4.8e12}


@dataclass
class Gradients:
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    io: IOCount


def _forward(q, k, v, scale):
    """O and the log-sum-exp L: what the forward left in HBM."""
    s = scale * q @ k.T
    m = s.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(s - m).sum(axis=1, keepdims=True)))[:, 0]
    return np.exp(s - lse[:, None]) @ v, lse


def _tiles(n: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def attention_backward(q, k, v, do, block_r: int, block_c: int, order: str = "column",
                       d_trick: bool = True) -> Gradients:
    """dQ, dK, dV of softmax(scale q k^T) v for upstream dO, tile by tile, with the HBM traffic.

    q (N, d), k (Nk, d), v (Nk, dv), do (N, dv). order "row": query tiles outside, "column": key
    and value tiles outside. d_trick: D = rowsum(dO o O) up front; otherwise D = rowsum(P o dP),
    a pass over every K, V tile first. A gradient accumulated across the outer loop's steps lives
    in HBM and is read back and written each step (the first step only writes).
    """
    q, k, v, do = (np.asarray(t, dtype=np.float64) for t in (q, k, v, do))
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if block_r < 1 or block_c < 1:
        raise ValueError(f"block sizes must be >= 1, got block_r={block_r}, block_c={block_c}")
    (n, d), (nk, dv) = q.shape, v.shape
    scale = 1 / math.sqrt(d)
    o, lse = _forward(q, k, v, scale)
    io = IOCount()
    rows, cols = _tiles(n, block_r), _tiles(nk, block_c)

    def p_and_dp(i: slice, j: slice):
        p = np.exp(scale * q[i] @ k[j].T - lse[i, None])  # (B_r, B_c)
        return p, do[i] @ v[j].T  # dP (B_r, B_c) = (B_r, dv) @ (dv, B_c)

    dd = np.zeros(n)
    if d_trick:
        io.read("O", n * dv)
        io.read("dO", n * dv)
        dd = (do * o).sum(axis=1)
    else:
        for i in rows:
            io.read("Q", (i.stop - i.start) * d)
            io.read("dO", (i.stop - i.start) * dv)
            io.read("lse", i.stop - i.start)
            for j in cols:
                io.read("K", (j.stop - j.start) * d)
                io.read("V", (j.stop - j.start) * dv)
                p, dp = p_and_dp(i, j)
                dd[i] += (p * dp).sum(axis=1)
    io.write("D", n)

    dq, dk, dvv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    outer, inner = (rows, cols) if order == "row" else (cols, rows)
    for step, a in enumerate(outer):
        for b in inner:
            i, j = (a, b) if order == "row" else (b, a)
            _load_tile(io, order, i, j, d, dv, first_inner=b is inner[0])
            p, dp = p_and_dp(i, j)
            ds = p * (dp - dd[i, None])  # (B_r, B_c)
            dq[i] += scale * ds @ k[j]  # (B_r, d) = (B_r, B_c) @ (B_c, d)
            dk[j] += scale * ds.T @ q[i]  # (B_c, d) = (B_c, B_r) @ (B_r, d)
            dvv[j] += p.T @ do[i]  # (B_c, dv) = (B_c, B_r) @ (B_r, dv)
            # The gradients of the inner loop's tile are finished elsewhere: read-modify-write.
            for name, rows_, width in ((("dK", j, d), ("dV", j, dv)) if order == "row"
                                       else (("dQ", i, d),)):
                if step:
                    io.read(name, (rows_.stop - rows_.start) * width)
                io.write(name, (rows_.stop - rows_.start) * width)
        # The outer tile's own gradients are finished in fast memory: written once.
        for name, width in ((("dQ", d),) if order == "row" else (("dK", d), ("dV", dv))):
            io.write(name, (a.stop - a.start) * width)
    return Gradients(dq, dk, dvv, io)


def _load_tile(io: IOCount, order: str, i: slice, j: slice, d: int, dv: int,
               first_inner: bool) -> None:
    """What one (query tile i, key tile j) step reads: the inner loop's tensors every step, the
    outer loop's once per outer step (they stay in fast memory across the inner loop)."""
    query = (("Q", i, d), ("dO", i, dv), ("lse", i, 1), ("D", i, 1))
    key = (("K", j, d), ("V", j, dv))
    stay, stream = (query, key) if order == "row" else (key, query)
    for name, rows, width in stream + (stay if first_inner else ()):
        io.read(name, (rows.stop - rows.start) * width)


def _inputs(n: int, d: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(4, n, d))


def _kind(io: IOCount, name: str, elements: int) -> str:
    passes = io.writes[name] // elements
    if passes == 1:
        return "inner (written once)"
    return f"outer (written {passes}x, read {passes - 1}x)"


def format_d_trick(n: int, d: int, block: int, seed: int = 0) -> str:
    """K and V loads with D = rowsum(P o dP) against D = rowsum(dO o O), both loop orders."""
    q, k, v, do = _inputs(n, d, seed)
    rows = []
    for order in ORDERS:
        for trick in (False, True):
            g = attention_backward(q, k, v, do, block, block, order, trick)
            rows.append([f"{order}-wise", "rowsum(dO o O)" if trick else "rowsum(P o dP)",
                         g.io.reads["K"] // (n * d), g.io.reads["V"] // (n * d),
                         g.io.reads.get("O", 0) // (n * d), f"{g.io.elements:,}"])
    return format_table(["order", "D from", "K loads (x N d)", "V loads (x N d)",
                         "O loads (x N d)", "HBM accesses"], rows,
                        title=f"The D trick, N = {n}, d = {d}, {block} x {block} tiles "
                              f"(T = {math.ceil(n / block)} tiles a side)")


def format_loop_orders(n: int, d: int, block: int, seed: int = 0) -> str:
    """Row-wise vs column-wise: which gradients are inner products, which outer, with counts."""
    q, k, v, do = _inputs(n, d, seed)
    rows = []
    for order in ORDERS:
        g = attention_backward(q, k, v, do, block, block, order)
        kinds = [_kind(g.io, name, n * d) for name in ("dQ", "dK", "dV")]
        inner = sum(kind.startswith("inner") for kind in kinds)
        gradient_traffic = sum(g.io.reads.get(x, 0) + g.io.writes[x] for x in ("dQ", "dK", "dV"))
        rows.append([f"{order}-wise ({'queries' if order == 'row' else 'keys/values'} outside)",
                     *kinds, f"{inner} inner, {3 - inner} outer", f"{gradient_traffic:,}",
                     f"{g.io.elements:,}"])
    return format_table(["order", "dQ", "dK", "dV", "score", "dQ+dK+dV traffic",
                         "HBM accesses"], rows,
                        title=f"Backward loop order, N = {n}, d = {d}, {block} x {block} tiles")


def format_arithmetic_intensity(n: int = 4096, d: int = 128, element_bytes: int = 2,
                                block_m: int = 128, sram_kib: int = 228) -> str:
    """FLOPs per byte moved: the 2 x 2 matmul programs of the register machine, then attention's
    forward (standard, FlashAttention-1, FlashAttention-2) and backward (both loop orders)."""
    from flashkit.sim.hbm import flash_attention_io, standard_attention_io, triton_forward_io
    from flashkit.sim.machine import run
    from flashkit.sim.programs import example_program

    machine = []
    for name, label in (("matmul-inner", "inner product, 3 registers"),
                        ("matmul-outer", "outer product, 6 registers"),
                        ("matmul-inner-6", "inner product, 6 registers")):
        r = run(example_program(name, 2))
        moved = r.counts.dram_reads + r.counts.dram_writes
        machine.append([label, 2 * 8, moved, f"{2 * 8 / moved:.2f}"])
    tables = [format_table(["2 x 2 matmul", "FLOPs (2 per MAC)", "DRAM accesses",
                            "FLOPs / access"], machine,
                           title="Arithmetic intensity on the register machine")]
    fwd = 4 * n * n * d
    sram = sram_kib * 1024 // element_bytes
    rows = []
    for label, io, flops in (
            ("forward, standard (S, P to HBM)", standard_attention_io(n, d), fwd),
            (f"forward, FlashAttention-1 (SRAM {sram_kib} KiB)",
             flash_attention_io(n, d, sram), fwd),
            (f"forward, FlashAttention-2 ({block_m}-row query tiles)",
             triton_forward_io(n, n, d, block_m, 64), fwd),
            *((f"backward, {order}-wise, {block_m} x {block_m} tiles",
               _backward_io(n, d, block_m, order), 2.5 * fwd) for order in ORDERS)):
        moved = io.bytes(element_bytes)
        rows.append([label, f"{flops / 1e9:.2f}", f"{moved / 2**20:,.1f}",
                     f"{flops / moved:,.0f}"])
    tables.append(format_table(["attention, one head", "GFLOPs", "MiB moved", "FLOPs / byte"],
                               rows, title=f"Arithmetic intensity of attention, N = {n}, "
                                           f"d = {d}, {element_bytes}-byte elements"))
    ridges = ", ".join(f"{name} {HOPPER_BF16_FLOPS / bandwidth:.0f}"
                       for name, bandwidth in HOPPER_HBM_BYTES_PER_S.items())
    return "\n\n".join(tables) + (
        f"\n\nThe ridge point (dense bf16 FLOP/s over HBM bytes/s, FLOPs per byte): {ridges}. "
        "Below it a kernel waits on memory. These counts charge every tile's K, V loads to HBM; "
        "query tiles running at the same time share K and V through the L2 cache, so a real "
        "kernel moves less and sits higher than its row here.")


def _backward_io(n: int, d: int, block: int, order: str) -> IOCount:
    """The backward's traffic at size n in closed form, counted by the same loop structure as
    attention_backward (which executes it) without the arithmetic."""
    tiles = math.ceil(n / block)
    per_tile = n * d  # a whole tensor, summed over its tiles
    reads = {"O": per_tile, "dO": per_tile}  # the D trick
    writes = {"D": n}
    if order == "row":  # Q, dO, lse, D once; K, V every query tile; dK, dV read-modify-write
        reads.update({"Q": per_tile, "dO": 2 * per_tile, "lse": n, "D": n,
                      "K": tiles * per_tile, "V": tiles * per_tile,
                      "dK": (tiles - 1) * per_tile, "dV": (tiles - 1) * per_tile})
        writes.update({"dK": tiles * per_tile, "dV": tiles * per_tile, "dQ": per_tile})
    else:  # K, V once; Q, dO, lse, D every key tile; dQ read-modify-write
        reads.update({"K": per_tile, "V": per_tile, "Q": tiles * per_tile,
                      "dO": (tiles + 1) * per_tile, "lse": tiles * n, "D": tiles * n,
                      "dQ": (tiles - 1) * per_tile})
        writes.update({"dQ": tiles * per_tile, "dK": per_tile, "dV": per_tile})
    return IOCount(reads, writes)


def lesson(n: int = 8, d: int = 4, block: int = 2) -> None:
    """Print the backward's cost arguments, each counted by running the tiled backward."""
    print("The attention backward, tile by tile (the FlashAttention backward's two cost "
          "arguments)\n")
    print(format_d_trick(n, d, block))
    print("\nD_i = sum_j P_ij dP_ij needs the whole row, so without the trick a first pass "
          "over every K, V tile comes before dS can be formed. Row-wise (the order the "
          "argument is made in) that loads K and V twice instead of once per query tile; "
          "column-wise the first pass alone loads them once per query tile, against once in "
          "all with the trick. rowsum(dO o O) gives the same D from O and dO, already in HBM, "
          "for one extra read of O.\n")
    print(format_loop_orders(n, d, block))
    print("\nRow-wise finishes dQ in fast memory (1 inner product) and sends dK, dV back to "
          "HBM after every query tile (2 outer products); column-wise finishes dK and dV "
          "(2 inner) and leaves only dQ (1 outer): better balanced, and what FlashAttention-2's "
          "backward does (dQ accumulated with atomic adds or a separate pass).\n")
    print(format_arithmetic_intensity())
