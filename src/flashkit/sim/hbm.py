"""HBM traffic of attention: the FlashAttention paper's Theorem 2, executed and in closed form.

The FlashAttention paper (Dao et al. 2022), Theorem 2: with sequence length N, head dimension d
and an SRAM of M elements (d <= M <= N d),

    standard attention makes   Theta(N d + N^2)      HBM accesses,
    FlashAttention makes       Theta(N^2 d^2 / M)    HBM accesses.

Three schedules, each both *executed* (real outputs, every HBM transfer counted as it happens)
and in *closed form* (the same counts summed without the arithmetic, fast enough to sweep N into
the tens of thousands); the tests hold the two equal.

* Standard attention (the paper's Algorithm 0): S = Q K^T to HBM, P = softmax(S) to HBM,
  O = P V. Reads 3 N d + 2 N^2, writes 2 N^2 + N d.
* FlashAttention (Algorithm 1; FlashAttention-1's loop order, K and V outside): block sizes
  B_c = ceil(M / 4d), B_r = min(B_c, d) so the working set fits in SRAM. K and V are read
  once; each of the T_c = ceil(N / B_c) outer steps reads all of Q, O, l, m and writes O, l, m
  back: about T_c (3 N d) = 12 N^2 d^2 / M, the Theta(N^2 d^2 / M).
* A Triton FlashAttention-2 forward (queries outside, as the Triton tutorial): one
  program per (BLOCK_M query rows, batch, head) reads its Q block once, reads every K, V block it
  can see (causal: those at or left of the diagonal, bottom-right aligned as flashkit's contract
  says) and writes its O block and the log-sum-exp. Every program's loads are counted as HBM
  traffic: an upper bound, since programs running together can share K and V through L2.

Counts are in elements per tensor (``IOCount``); ``IOCount.bytes`` converts with the data type's
size, the softmax statistics (l, m, lse) being float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from flashkit.sim.loop_orders import check_qkv
from flashkit.sim.table import format_table

__all__ = [
    "IOCount", "flash_block_sizes", "standard_attention", "flash_attention_v1",
    "flash_attention_v2", "standard_attention_io", "flash_attention_io", "triton_forward_io",
    "triton_forward_bytes",
    "format_io_sweep", "format_sram_sweep", "format_triton_configs",
]

STATISTICS = ("l", "m", "lse")  # float32 whatever the data type
STATISTICS_BYTES = 4


@dataclass
class IOCount:
    """HBM reads and writes in elements, by tensor name (Q, K, V, O, S, P, l, m, lse)."""

    reads: dict[str, int] = field(default_factory=dict)
    writes: dict[str, int] = field(default_factory=dict)

    def read(self, tensor: str, elements: int) -> None:
        self.reads[tensor] = self.reads.get(tensor, 0) + elements

    def write(self, tensor: str, elements: int) -> None:
        self.writes[tensor] = self.writes.get(tensor, 0) + elements

    @property
    def elements(self) -> int:
        """Total HBM accesses, the quantity of Theorem 2."""
        return sum(self.reads.values()) + sum(self.writes.values())

    def bytes(self, element_bytes: int) -> int:
        """Bytes moved: data tensors at ``element_bytes`` each, statistics at 4."""
        if element_bytes < 1:
            raise ValueError(f"element_bytes must be >= 1, got {element_bytes}")
        return sum(count * (STATISTICS_BYTES if name in STATISTICS else element_bytes)
                   for counts in (self.reads, self.writes) for name, count in counts.items())

    def scaled(self, factor: int) -> IOCount:
        """The same traffic ``factor`` times (every batch element and head)."""
        return IOCount({k: v * factor for k, v in self.reads.items()},
                       {k: v * factor for k, v in self.writes.items()})


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def flash_block_sizes(d: int, sram: int) -> tuple[int, int]:
    """Algorithm 1's (B_r, B_c) for head dim d and an SRAM of ``sram`` elements."""
    _positive(d=d, sram=sram)
    if sram < d:
        raise ValueError(f"sram must hold at least one row of d = {d} values, got {sram}")
    block_c = math.ceil(sram / (4 * d))
    return min(block_c, d), block_c


def _blocks(n: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def standard_attention(q, k, v) -> tuple[np.ndarray, IOCount]:
    """Algorithm 0: softmax(q k^T) v with S and P written to and read back from HBM.

    (The scale is left to the caller, as in the paper's statement of the algorithm.)
    """
    q, k, v = check_qkv(q, k, v)
    io = IOCount()
    io.read("Q", q.size)
    io.read("K", k.size)
    s = q @ k.T
    io.write("S", s.size)
    io.read("S", s.size)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    io.write("P", p.size)
    io.read("P", p.size)
    io.read("V", v.size)
    out = p @ v
    io.write("O", out.size)
    return out, io


def _algorithm1_blocks(d: int, sram: int | None, block_r: int | None,
                      block_c: int | None) -> tuple[int, int]:
    """Explicit block sizes, or Algorithm 1's choice for ``sram`` where one is left out."""
    if block_r is None or block_c is None:
        if sram is None:
            raise ValueError("give sram (SRAM size in elements) or both block_r and block_c")
        default_r, default_c = flash_block_sizes(d, sram)
        block_r, block_c = block_r or default_r, block_c or default_c
    _positive(block_r=block_r, block_c=block_c)
    return block_r, block_c


def flash_attention_v1(q, k, v, sram: int | None = None, block_r: int | None = None,
                       block_c: int | None = None) -> tuple[np.ndarray, IOCount]:
    """Algorithm 1 of the paper, step by step, with its HBM traffic.

    O, l, m live in HBM and are initialised there (0, 0, -inf); for each K_j, V_j block (outer
    loop) every Q_i, O_i, l_i, m_i block is read, updated and written back. Block sizes are
    Algorithm 1's choice for an SRAM of ``sram`` elements unless given.
    """
    q, k, v = check_qkv(q, k, v)
    block_r, block_c = _algorithm1_blocks(q.shape[1], sram, block_r, block_c)
    (nq, _), (nk, dv) = q.shape, v.shape
    io = IOCount()
    out, l, m = np.zeros((nq, dv)), np.zeros(nq), np.full(nq, -np.inf)  # in HBM
    for name, tensor in (("O", out), ("l", l), ("m", m)):
        io.write(name, tensor.size)
    for cols in _blocks(nk, block_c):
        k_j, v_j = k[cols], v[cols]
        io.read("K", k_j.size)
        io.read("V", v_j.size)
        for rows in _blocks(nq, block_r):
            q_i, o_i, l_i, m_i = q[rows], out[rows], l[rows], m[rows]
            for name, tensor in (("Q", q_i), ("O", o_i), ("l", l_i), ("m", m_i)):
                io.read(name, tensor.size)
            s = q_i @ k_j.T                                  # [B_r, B_c] = [B_r, d] @ [d, B_c]
            m_tile = s.max(axis=1)
            p = np.exp(s - m_tile[:, None])
            l_tile = p.sum(axis=1)
            m_new = np.maximum(m_i, m_tile)
            old, new = np.exp(m_i - m_new), np.exp(m_tile - m_new)  # exp(-inf) = 0 at first
            l_new = old * l_i + new * l_tile
            # O stays normalised in HBM: undo the old denominator, add the tile, divide anew.
            out[rows] = ((l_i * old)[:, None] * o_i + new[:, None] * (p @ v_j)) / l_new[:, None]
            l[rows], m[rows] = l_new, m_new
            for name, tensor in (("O", out[rows]), ("l", l_new), ("m", m_new)):
                io.write(name, tensor.size)
    return out, io


def _causal_key_limit(row_end: int, seqlen_q: int, seqlen_k: int) -> int:
    """Keys visible to a block whose last row is row_end - 1: j <= i + (seqlen_k - seqlen_q)."""
    return max(0, min(seqlen_k, row_end + seqlen_k - seqlen_q))


def flash_attention_v2(q, k, v, block_m: int, block_n: int,
                       causal: bool = False) -> tuple[np.ndarray, np.ndarray, IOCount]:
    """The Triton FlashAttention-2 forward's schedule, executed: one query block at a time, its
    state in fast memory, streaming the K, V blocks it can see. Scale 1/sqrt(d); a row that sees
    no key gives out 0 and lse -inf. Returns (out, lse, traffic)."""
    q, k, v = check_qkv(q, k, v)
    _positive(block_m=block_m, block_n=block_n)
    (nq, d), (nk, dv) = q.shape, v.shape
    io = IOCount()
    out, lse = np.zeros((nq, dv)), np.full(nq, -np.inf)
    for rows in _blocks(nq, block_m):
        q_i = q[rows]
        io.read("Q", q_i.size)
        m, l, acc = np.full(len(q_i), -np.inf), np.zeros(len(q_i)), np.zeros((len(q_i), dv))
        key_end = _causal_key_limit(rows.stop, nq, nk) if causal else nk
        for cols in _blocks(key_end, block_n):
            k_j, v_j = k[cols], v[cols]
            io.read("K", k_j.size)
            io.read("V", v_j.size)
            s = q_i @ k_j.T / math.sqrt(d)                    # [bm, bn] = [bm, d] @ [d, bn]
            if causal:
                i = np.arange(rows.start, rows.stop)[:, None] + (nk - nq)
                s = np.where(np.arange(cols.start, cols.stop)[None, :] <= i, s, -np.inf)
            m_new = np.maximum(m, s.max(axis=1))
            m_safe = np.where(np.isfinite(m_new), m_new, 0.0)  # rows that see nothing yet
            p = np.exp(s - m_safe[:, None])
            rescale = np.exp(m - m_safe)
            l = l * rescale + p.sum(axis=1)
            acc = acc * rescale[:, None] + p @ v_j            # [bm, dv] = [bm, bn] @ [bn, dv]
            m = m_new
        seen = l > 0
        out[rows] = np.where(seen[:, None], acc / np.where(seen, l, 1.0)[:, None], 0.0)
        lse[rows] = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)
        io.write("O", out[rows].size)
        io.write("lse", len(q_i))
    return out, lse, io


def standard_attention_io(n: int, d: int) -> IOCount:
    """Algorithm 0's traffic for N = n, head dim d: 4 N d + 4 N^2 elements."""
    _positive(n=n, d=d)
    return IOCount(reads={"Q": n * d, "K": n * d, "S": n * n, "P": n * n, "V": n * d},
                   writes={"S": n * n, "P": n * n, "O": n * d})


def flash_attention_io(n: int, d: int, sram: int | None = None,
                       block_c: int | None = None) -> IOCount:
    """Algorithm 1's traffic in closed form: K, V once; Q, O, l, m once per outer step (T_c of
    them), O, l, m written T_c + 1 times (the +1 is the initialisation). B_r does not appear:
    however Q is cut into row blocks, all of it passes through SRAM once per K, V block."""
    _positive(n=n, d=d)
    _, block_c = _algorithm1_blocks(d, sram, 1, block_c)
    outer = math.ceil(n / block_c)
    return IOCount(reads={"K": n * d, "V": n * d, "Q": outer * n * d, "O": outer * n * d,
                          "l": outer * n, "m": outer * n},
                   writes={"O": (outer + 1) * n * d, "l": (outer + 1) * n,
                           "m": (outer + 1) * n})


def triton_forward_io(seqlen_q: int, seqlen_k: int, head_dim: int, block_m: int, block_n: int,
                      causal: bool = False, head_dim_v: int | None = None, batch: int = 1,
                      nheads: int = 1) -> IOCount:
    """Predicted HBM traffic of a FlashAttention-2 Triton forward with tiles BLOCK_M x BLOCK_N.

    Per (batch, head) and query block: Q block once, each visible K, V block once, O block and
    lse written once; summed over blocks and multiplied by batch * nheads. With ``bytes``
    of the data type this is the number to compare with a kernel's measured DRAM traffic.
    """
    head_dim_v = head_dim_v or head_dim
    _positive(seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim, head_dim_v=head_dim_v,
              block_m=block_m, block_n=block_n, batch=batch, nheads=nheads)
    keys_read = sum(_causal_key_limit(rows.stop, seqlen_q, seqlen_k) if causal else seqlen_k
                    for rows in _blocks(seqlen_q, block_m))
    # block_n does not change the rows read (a partial last block reads only its rows); it
    # matters to on-chip work and occupancy, not to this count.
    one_head = IOCount(reads={"Q": seqlen_q * head_dim, "K": keys_read * head_dim,
                              "V": keys_read * head_dim_v},
                       writes={"O": seqlen_q * head_dim_v, "lse": seqlen_q})
    return one_head.scaled(batch * nheads)


def triton_forward_bytes(seqlen_q: int, seqlen_k: int, head_dim: int, block_m: int,
                         block_n: int, causal: bool, dtype_bytes: int,
                         head_dim_v: int | None = None, batch: int = 1, nheads: int = 1) -> int:
    """:func:`triton_forward_io` in bytes: Q, K, V, O at ``dtype_bytes``, lse at 4 (float32).

    The one number to set beside a kernel config and its measured DRAM traffic.
    """
    return triton_forward_io(seqlen_q, seqlen_k, head_dim, block_m, block_n, causal, head_dim_v,
                             batch, nheads).bytes(dtype_bytes)


def _megabytes(count: int) -> str:
    return f"{count / 2**20:,.2f}"


def format_io_sweep(ns: Sequence[int], d: int, sram: int, element_bytes: int = 2,
                    block_m: int = 128, block_n: int = 64) -> str:
    """Theorem 2 as a table: standard vs FlashAttention traffic as N grows, and each divided by
    its Theta term, which settles to a constant while N grows (the scaling, seen)."""
    block_r, block_c = flash_block_sizes(d, sram)
    rows = []
    for n in ns:
        standard = standard_attention_io(n, d)
        flash = flash_attention_io(n, d, sram)
        triton = triton_forward_io(n, n, d, block_m, block_n)
        rows.append([n, _megabytes(standard.bytes(element_bytes)),
                     _megabytes(flash.bytes(element_bytes)),
                     _megabytes(triton.bytes(element_bytes)),
                     f"{standard.elements / flash.elements:.1f}x",
                     f"{standard.elements / (n * d + n * n):.2f}",
                     f"{flash.elements / (n * n * d * d / sram):.2f}"])
    headers = ["N", "standard MiB", "FA1 (Alg. 1) MiB", f"FA2 {block_m}x{block_n} MiB",
               "standard / FA1", "standard / (Nd+N^2)", "FA1 / (N^2 d^2/M)"]
    title = (f"HBM traffic, d = {d}, SRAM M = {sram:,} elements (B_r = {block_r}, "
             f"B_c = {block_c}), {element_bytes}-byte elements, non-causal")
    return format_table(headers, rows, title=title)


def format_sram_sweep(n: int, d: int, srams: Sequence[int], element_bytes: int = 2) -> str:
    """FlashAttention's traffic against SRAM size at fixed N: it falls as 1/M."""
    rows = []
    for sram in srams:
        block_r, block_c = flash_block_sizes(d, sram)
        flash = flash_attention_io(n, d, sram)
        rows.append([f"{sram:,}", block_r, block_c, _megabytes(flash.bytes(element_bytes)),
                     f"{flash.elements * sram / (n * n * d * d):.2f}"])
    return format_table(["SRAM M (elements)", "B_r", "B_c", "FA1 MiB", "FA1 x M / (N^2 d^2)"],
                        rows, title=f"FlashAttention traffic against SRAM size, N = {n}, d = {d}")


def format_triton_configs(seqlen: int, head_dim: int, configs: Sequence[tuple[int, int]],
                          causal: bool, element_bytes: int = 2, batch: int = 1,
                          nheads: int = 1) -> str:
    """Predicted forward traffic of each (BLOCK_M, BLOCK_N) config, against the compulsory
    traffic (every tensor read or written exactly once)."""
    compulsory = IOCount(reads={"Q": seqlen * head_dim, "K": seqlen * head_dim,
                                "V": seqlen * head_dim},
                         writes={"O": seqlen * head_dim, "lse": seqlen}).scaled(batch * nheads)
    rows = []
    for block_m, block_n in configs:
        io = triton_forward_io(seqlen, seqlen, head_dim, block_m, block_n, causal,
                               batch=batch, nheads=nheads)
        kv_passes = io.reads["K"] / compulsory.reads["K"]
        rows.append([block_m, block_n, _megabytes(io.bytes(element_bytes)), f"{kv_passes:.1f}",
                     f"{io.bytes(element_bytes) / compulsory.bytes(element_bytes):.2f}x"])
    kind = "causal" if causal else "non-causal"
    return format_table(["BLOCK_M", "BLOCK_N", "predicted MiB", "K,V passes", "vs compulsory"],
                        rows, title=f"Triton forward, {kind}, seqlen {seqlen}, head dim "
                                    f"{head_dim}, batch {batch} x {nheads} heads, "
                                    f"{element_bytes}-byte elements")
