"""Programs for the toy register machine: the problems of the essay, generalised to size n.

Every builder returns a :class:`~flashkit.sim.machine.Program` whose instructions are the essay's
trace where the essay prints one (c00, the 2 x 2 outer product, the online-softmax steady state)
and follow the essay's steps elsewhere. Running it gives the numbers and the counts; the closed
forms below are what the tests check the runs against.

    program                    registers    cycles            DRAM reads           writes
    c00 (one dot product)      3            3n + 1            2n                   1
    matmul, inner product      3            3n^3 + 1          2n^3 - n^2 + 1       n^2
    matmul, outer product      n^2 + 2      2n^3 + n^2 + n    n^3 + n              n^2
    matmul, inner, 6 regs      6 (n = 2)    20                8                    4
    safe softmax (3 passes)    3            11n - 1           3n                   n
    online softmax (2 passes)  4            14n - 4           2n                   n
    online attention (1 pass)  d + dv + 5   see its builder   nq d + nq nk (d+dv)  nq dv

For n = 2 the matmul rows are the essay's table: 25 cycles / 13 LOADs with 3 registers (inner
product), 22 cycles / 10 LOADs with 6 registers (outer product).

Operand reuse ("locality" in the essay) is not hand-written into each builder: the emitter below
remembers which DRAM value each register holds and skips a LOAD whose value is already there. The
builders only choose an *order* that makes reuse possible (a snake through the outputs, the inner
sum run backwards every other output).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from flashkit.sim.machine import Address, Instruction, Program, op

__all__ = [
    "dot_product_c00", "matmul_inner_product", "matmul_outer_product", "matmul_inner_product_6",
    "safe_softmax",
    "online_softmax", "online_attention", "PROGRAM_NAMES", "example_program",
]


class _Emitter:
    """Collects instructions into named sections and skips LOADs of values already in place."""

    def __init__(self) -> None:
        self.sections: list[tuple[str, list[Instruction]]] = []
        self._holds: dict[str, str] = {}  # register -> the DRAM address whose value it holds

    def section(self, name: str) -> None:
        self.sections.append((name, []))

    def emit(self, opcode: str, *operands: str, note: str | None = None) -> None:
        self.sections[-1][1].append(op(opcode, *operands, note=note))
        if opcode != "STORE":
            self._holds.pop(operands[-1], None)  # the destination no longer holds a DRAM value

    def load(self, address: str, register: str, note: str | None = None) -> None:
        """LOAD ``address`` into ``register`` unless it is already there (reuse: no DRAM read)."""
        if self._holds.get(register) == address:
            return
        self.emit("LOAD", address, register, note=note)
        self._holds[register] = address


def _square_pair(a: np.ndarray, b: np.ndarray) -> int:
    a, b = np.asarray(a), np.asarray(b)
    if a.ndim != 2 or a.shape[0] != a.shape[1] or b.shape != a.shape:
        raise ValueError(f"a and b must be square matrices of one size, got a {a.shape}, "
                         f"b {b.shape}")
    return a.shape[0]


def _registers(minimum: int, registers: int | None) -> int:
    if registers is None:
        return minimum
    if registers < minimum:
        raise ValueError(f"registers={registers} is too few: this program needs {minimum}")
    return registers


def _snake(n: int) -> Iterator[tuple[int, int]]:
    """Outputs (i, j) row by row, every other row right to left: neighbours share a row of A
    or a column of B, so one operand can stay in its register."""
    for i in range(n):
        for j in (range(n) if i % 2 == 0 else reversed(range(n))):
            yield i, j


def _accumulate(e: _Emitter, i: int, j: int, term: int, n: int, acc: str) -> None:
    """Add a(R0)·b(R1) into ``acc`` as term ``term`` of n: MAC_Z for the first (no partial sum
    yet), MAC after; the last term names the finished element c_ij as the essay does."""
    name = Address("c", (i, j)).label
    note = name if term == n - 1 else (f"{name} ({term + 1}/{n} terms)" if term else None)
    if term == 0:
        e.emit("MAC_Z", "R0", "R1", acc, note=note)
    else:
        e.emit("MAC", "R0", "R1", acc, acc, note=note)


def dot_product_c00(a: np.ndarray, b: np.ndarray, registers: int | None = None) -> Program:
    """The essay Problem 1: c00 = sum_k a0k bk0 with 3 registers (R0, R1 operands, R2 the sum).

    For 2 x 2 inputs this is the essay's 7-step trace: 4 LOADs + 2 MACs + 1 STORE = 7 cycles.
    """
    n = _square_pair(a, b)
    e = _Emitter()
    e.section("c00")
    for k in range(n):
        e.load(f"a[0][{k}]", "R0")
        e.load(f"b[{k}][0]", "R1")
        _accumulate(e, 0, 0, k, n, "R2")
    e.emit("STORE", "R2", "c[0][0]")
    return Program("c00", _registers(3, registers), {"a": a, "b": b}, {"c": (1, 1)}, e.sections,
                   "one dot product: the smallest matmul machine")


def matmul_inner_product(a: np.ndarray, b: np.ndarray, registers: int | None = None) -> Program:
    """C = A B one output at a time with 3 registers (the essay Problem 2).

    Outputs go in snake order and each one runs its sum in the opposite direction to the one
    before, so its first operand pair shares a value with the previous pair: one LOAD saved per
    output after the first. LOADs 2n^3 - (n^2 - 1), MACs n^3, STOREs n^2, cycles 3n^3 + 1;
    n = 2: 13 LOADs, 25 cycles (the essay's table).
    """
    n = _square_pair(a, b)
    e = _Emitter()
    e.section("inner products")
    for t, (i, j) in enumerate(_snake(n)):
        ks = range(n) if t % 2 == 0 else reversed(range(n))
        for term, k in enumerate(ks):
            e.load(f"a[{i}][{k}]", "R0")
            e.load(f"b[{k}][{j}]", "R1")
            _accumulate(e, i, j, term, n, "R2")
        e.emit("STORE", "R2", f"c[{i}][{j}]")
    return Program("matmul-inner", _registers(3, registers), {"a": a, "b": b}, {"c": (n, n)},
                   e.sections, "C = A B, inner product: one output element at a time")


def matmul_outer_product(a: np.ndarray, b: np.ndarray, registers: int | None = None) -> Program:
    """C = sum_k A[:, k] B[k, :], rank-1 updates, every c_ij in its own register (Problem 3).

    R0 holds a_ik, R1 holds b_kj, R2.. hold the n^2 accumulators (c_ij in R(2 + i n + j)); within
    one k the outputs go in snake order so a_ik or b_kj stays put. LOADs n (n^2 + 1), MACs n^3,
    STOREs n^2, cycles 2n^3 + n^2 + n; n = 2: 6 registers, 10 LOADs, 22 cycles (the essay's trace).
    """
    n = _square_pair(a, b)
    e = _Emitter()
    for k in range(n):
        e.section(f"outer product k={k}")
        for i, j in _snake(n):
            e.load(f"a[{i}][{k}]", "R0")
            e.load(f"b[{k}][{j}]", "R1")
            _accumulate(e, i, j, k, n, f"R{2 + i * n + j}")
    e.section("store")
    for i in range(n):
        for j in range(n):
            e.emit("STORE", f"R{2 + i * n + j}", f"c[{i}][{j}]")
    return Program("matmul-outer", _registers(n * n + 2, registers), {"a": a, "b": b},
                   {"c": (n, n)}, e.sections, "C = A B, outer product: all outputs in registers")


def matmul_inner_product_6(a: np.ndarray, b: np.ndarray,
                           registers: int | None = None) -> Program:
    """The quiz after Problem 3: the best inner-product schedule for a 2 x 2 C = A B with 6
    registers. One output at a time, in the order c00, c01, c10, c11, and a register is reused
    the moment the value in it is dead (a00 after its last MAC, b00 after c10's first): every
    value is loaded exactly once. 8 LOADs + 8 MACs + 4 STOREs = 20 cycles, the fewest any
    schedule can take (8 values must come in, 8 MACs and 4 STOREs must run), against 25 with 3
    registers and 22 for the outer product. The saving is all in LOADs: 13 -> 8.
    """
    if _square_pair(a, b) != 2:
        raise ValueError(f"this schedule is for 2 x 2 matrices, got {np.asarray(a).shape}")
    e = _Emitter()
    e.section("c00")  # R0 a00, R1 a01, R2 b00, R3 b10; R4 the running sum
    for address, register in (("a[0][0]", "R0"), ("a[0][1]", "R1"), ("b[0][0]", "R2"),
                              ("b[1][0]", "R3")):
        e.load(address, register)
    e.emit("MAC_Z", "R0", "R2", "R4")
    e.emit("MAC", "R1", "R3", "R4", "R4", note="c00")
    e.emit("STORE", "R4", "c[0][0]")
    e.section("c01")  # a00 dies after its MAC: b11 takes R0
    e.load("b[0][1]", "R5")
    e.emit("MAC_Z", "R0", "R5", "R4")
    e.load("b[1][1]", "R0")
    e.emit("MAC", "R1", "R0", "R4", "R4", note="c01")
    e.emit("STORE", "R4", "c[0][1]")
    e.section("c10")  # a01 is dead: a10 takes R1; b00 dies after its MAC: a11 takes R2
    e.load("a[1][0]", "R1")
    e.emit("MAC_Z", "R1", "R2", "R4")
    e.load("a[1][1]", "R2")
    e.emit("MAC", "R2", "R3", "R4", "R4", note="c10")
    e.emit("STORE", "R4", "c[1][0]")
    e.section("c11")  # a10, a11, b01, b11 are all still in registers: no LOAD
    e.emit("MAC_Z", "R1", "R5", "R4")
    e.emit("MAC", "R2", "R0", "R4", "R4", note="c11")
    e.emit("STORE", "R4", "c[1][1]")
    return Program("matmul-inner-6", _registers(6, registers), {"a": a, "b": b}, {"c": (2, 2)},
                   e.sections, "C = A B, inner product with 6 registers: every value loaded once")


def _vector(x: np.ndarray) -> int:
    x = np.asarray(x)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"x must be a non-empty vector, got shape {x.shape}")
    return x.size


def _running(symbol: str, k: int, n: int) -> str:
    """A running quantity's name after k of n elements: m3, s3, ... and plain m, S at the end."""
    return {"m": "m", "s": "S"}[symbol] if k == n else f"{symbol}{k}"


def _normalise(e: _Emitter, n: int) -> None:
    """out_i = e^(x_i - m) / S with R1 = m, R2 = S: recompute each exponential, never stored."""
    e.section("normalise")
    for i in range(n):
        e.load(f"x[{i}]", "R0")
        e.emit("SUB", "R0", "R1", "R0")
        e.emit("EXP", "R0", "R0")
        e.emit("DIV", "R0", "R2", "R0")
        e.emit("STORE", "R0", f"out[{i}]")


def safe_softmax(x: np.ndarray, registers: int | None = None) -> Program:
    """The essay Problem 4: safe softmax with 3 registers in three passes over x.

    R0 streams x_i, R1 = m (pass 1), R2 = S (pass 2), pass 3 normalises. Reads 3n, writes n,
    cycles (2n - 1) + 4n + 5n = 11n - 1. s_k names the sum of the first k exponentials.
    """
    n = _vector(x)
    e = _Emitter()
    e.section("get max")
    e.load("x[0]", "R1", note=_running("m", 1, n) if n == 1 else None)
    for i in range(1, n):
        e.load(f"x[{i}]", "R0")
        e.emit("MAX", "R0", "R1", "R1", note=_running("m", n, n) if i == n - 1
               else f"max(x0..x{i})")
    e.section("sum of exponentials")
    for i in range(n):
        e.load(f"x[{i}]", "R0")
        e.emit("SUB", "R0", "R1", "R0")
        e.emit("EXP", "R0", "R0")
        if i == 0:
            e.emit("MOV", "R0", "R2", note=_running("s", 1, n))
        else:
            e.emit("ADD", "R2", "R0", "R2", note=_running("s", i + 1, n))
    _normalise(e, n)
    return Program("safe-softmax", _registers(3, registers), {"x": x}, {"out": (n,)},
                   e.sections, "safe softmax, 3 registers: max, sum, normalise")


def online_softmax(x: np.ndarray, registers: int | None = None) -> Program:
    """The essay Problem 5: online softmax with 4 registers in two passes.

    Pass 1 keeps the running max m_k (R1) and the running sum s_k (R2) of the first k elements,
    rescaling s by e^(m_k - m_k+1) when the max moves; R3 saves the old max first (step 2 of the
    essay's steady state). Reads 2n, writes n, cycles 5 + 9(n - 1) + 5n = 14n - 4.
    """
    n = _vector(x)
    e = _Emitter()
    e.section("online max and sum")
    e.load("x[0]", "R0")
    e.emit("MOV", "R0", "R1", note=_running("m", 1, n))
    e.emit("SUB", "R0", "R1", "R0")
    e.emit("EXP", "R0", "R0")
    e.emit("MOV", "R0", "R2", note=_running("s", 1, n))
    for i in range(1, n):
        e.load(f"x[{i}]", "R0")
        e.emit("MOV", "R1", "R3")                                # save the old max
        e.emit("MAX", "R1", "R0", "R1", note=_running("m", i + 1, n))
        e.emit("SUB", "R3", "R1", "R3")                          # m_old - m_new <= 0: safe
        e.emit("SUB", "R0", "R1", "R0")
        e.emit("EXP", "R3", "R3")                                # the rescale factor
        e.emit("EXP", "R0", "R0")
        e.emit("MUL", "R2", "R3", "R2")
        e.emit("ADD", "R2", "R0", "R2", note=_running("s", i + 1, n))
    _normalise(e, n)
    return Program("online-softmax", _registers(4, registers), {"x": x}, {"out": (n,)},
                   e.sections, "online softmax, 4 registers: (max, sum) together, then normalise")


def online_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                     registers: int | None = None) -> Program:
    """The essay Problem 7: o_i = numerator / denominator in one pass over the keys.

    The scale 1/sqrt(d) is folded into q beforehand, as the essay does, so o = softmax(q k^T) v.
    Registers (d = head dim of q, k; dv = of v): R0..R(d-1) hold q_i (loaded once per query),
    R(d) the streamed k or v element, then x (the score), t (scratch and rescale factor), m, den,
    and R(d+5).. the numerator vector. Per query: d + 2 nk d (scores) + 4 + dv (first key)
    + (nk - 1)(8 + 4 dv) (later keys) + 2 dv (divide, store) cycles; for d = dv = 1 that is
    14 nk - 4, the online softmax's count, with no second pass.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    if q.ndim != 2 or k.ndim != 2 or v.ndim != 2 or q.shape[1] != k.shape[1] \
            or k.shape[0] != v.shape[0] or 0 in q.shape + k.shape + v.shape:
        raise ValueError(f"need q (nq, d), k (nk, d), v (nk, dv), non-empty; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    (nq, d), (nk, dv) = q.shape, v.shape
    operand, x, t, m, den = (f"R{d + r}" for r in range(5))
    num = [f"R{d + 5 + c}" for c in range(dv)]
    e = _Emitter()
    for i in range(nq):
        e.section(f"query {i}")
        for c in range(d):
            e.load(f"q[{i}][{c}]", f"R{c}")
        for j in range(nk):
            for c in range(d):  # x_j = q_i . k_j, the essay's score
                e.load(f"k[{j}][{c}]", operand)
                last = f"x{j}" if c == d - 1 else None
                if c == 0:
                    e.emit("MAC_Z", f"R{c}", operand, x, note=last)
                else:
                    e.emit("MAC", f"R{c}", operand, x, x, note=last)
            if j == 0:  # m_1 = x_0, den_1 = e^0 = 1, num_1 = v_0 (weight 1, no multiply)
                e.emit("MOV", x, m, note="m1")
                e.emit("SUB", x, m, x)
                e.emit("EXP", x, x)
                e.emit("MOV", x, den, note="den1")
                for c in range(dv):
                    e.load(f"v[0][{c}]", num[c])
                continue
            e.emit("MOV", m, t)
            e.emit("MAX", m, x, m, note=f"m{j + 1}")
            e.emit("SUB", t, m, t)
            e.emit("SUB", x, m, x)
            e.emit("EXP", t, t)  # rescale factor e^(m_old - m_new): one scalar for all of num
            e.emit("EXP", x, x)  # the weight of v_j
            e.emit("MUL", den, t, den)
            e.emit("ADD", den, x, den, note=f"den{j + 1}")
            for c in range(dv):
                e.load(f"v[{j}][{c}]", operand)
                e.emit("MUL", num[c], t, num[c])
                e.emit("MUL", operand, x, operand)
                e.emit("ADD", num[c], operand, num[c], note=f"num{j + 1}[{c}]")
        for c in range(dv):
            e.emit("DIV", num[c], den, num[c], note=Address("o", (i, c)).label)
            e.emit("STORE", num[c], f"o[{i}][{c}]")
    return Program("online-attention", _registers(d + dv + 5, registers),
                   {"q": q, "k": k, "v": v}, {"o": (nq, dv)}, e.sections,
                   "online attention: running max, denominator and numerator, one pass")


PROGRAM_NAMES = ("c00", "matmul-inner", "matmul-outer", "matmul-inner-6", "safe-softmax",
                 "online-softmax", "online-attention")


def example_program(name: str, n: int = 2, d: int = 1, seed: int = 0,
                    registers: int | None = None) -> Program:
    """Program ``name`` on random inputs of size n (head dim d for attention): small integers
    for the matmuls so the table is readable, one-decimal floats for softmax and attention.
    ``registers`` runs it on a larger machine than it needs."""
    if name not in PROGRAM_NAMES:
        raise ValueError(f"program must be one of {PROGRAM_NAMES}, got {name!r}")
    if n < 1 or d < 1:
        raise ValueError(f"n and d must be >= 1, got n={n}, d={d}")
    rng = np.random.default_rng(seed)
    if name in ("c00", "matmul-inner", "matmul-outer", "matmul-inner-6"):
        a, b = rng.integers(1, 10, (2, n, n)).astype(np.float64)
        builder = {"c00": dot_product_c00, "matmul-inner": matmul_inner_product,
                   "matmul-outer": matmul_outer_product,
                   "matmul-inner-6": matmul_inner_product_6}[name]
        return builder(a, b, registers)
    if name in ("safe-softmax", "online-softmax"):
        x = np.round(rng.normal(size=n) * 2, 1)
        return (safe_softmax if name == "safe-softmax" else online_softmax)(x, registers)
    q, k, v = np.round(rng.normal(size=(3, n, d)), 1)
    return online_attention(q / np.sqrt(d), k, v, registers)
