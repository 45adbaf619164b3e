"""The register machine's printed output: register tables, counts and the essay's cost tables.

Every number here comes from *running* a program; nothing is a formula typed in twice. A count
that is a multiple of n is also shown the way the essay writes it (``12 (3n)``).
"""

from __future__ import annotations

import numpy as np

from flashkit.sim.machine import Run, Value, run
from flashkit.sim.programs import example_program, online_attention
from flashkit.sim.table import format_table

__all__ = ["format_trace", "format_counts", "matmul_comparison", "softmax_comparison",
           "cost_tables"]


def _cell(value: Value | None, values: bool) -> str:
    if value is None:
        return ""
    return f"{value.number:.4g}" if values else value.label


def format_trace(result: Run, values: bool = False) -> str:
    """The register table after every step, one table per section (the essay's passes).

    Cells show the essay's symbolic names, or the numbers with ``values=True``; a register nothing
    has written yet is blank.
    """
    headers = ["Step", "Instruction"] + [f"R{r}" for r in range(result.program.num_registers)]
    tables = []
    for section in result.section_counts:
        rows = [[s.number, str(s.instruction)] + [_cell(v, values) for v in s.registers]
                for s in result.steps if s.section == section]
        tables.append(format_table(headers, rows, title=f"[{section}]"))
    return "\n\n".join(tables)


def _per_n(count: int, n: int) -> str:
    """12 -> '12 (3n)' when n > 1 divides the count; the essay states costs per n."""
    if n > 1 and count and count % n == 0:
        coefficient = count // n
        return f"{count} ({'' if coefficient == 1 else coefficient}n)"
    return str(count)


def format_counts(result: Run) -> str:
    """Cycles, DRAM reads and writes per section and in total."""
    rows = [[name, c.cycles, c.dram_reads, c.dram_writes]
            for name, c in result.section_counts.items()]
    total = result.counts
    rows.append(["total", total.cycles, total.dram_reads, total.dram_writes])
    return format_table(["Section", "Cycles", "DRAM reads", "DRAM writes"], rows)


def matmul_comparison(n: int = 2) -> str:
    """The essay's 'Inner product vs Outer product' table for an n x n matmul."""
    names = ["matmul-inner", "matmul-outer"] + (["matmul-inner-6"] if n == 2 else [])
    runs = [run(example_program(name, n)) for name in names]
    rows = [["Registers", *(r.program.num_registers for r in runs)],
            ["Cycles (full matmul)", *(r.counts.cycles for r in runs)],
            ["LOADs", *(r.counts.dram_reads for r in runs)],
            ["STOREs", *(r.counts.dram_writes for r in runs)]]
    header = ["", "Inner product", "Outer product"] + (
        ["Inner product, 6 registers (the quiz)"] if n == 2 else [])
    return format_table(header, rows, title=f"{n} x {n} matmul: inner product vs outer product")


def _passes_table(result: Run, n: int, title: str) -> str:
    rows = [[f"{i}. {name}", _per_n(c.dram_reads, n), _per_n(c.dram_writes, n)]
            for i, (name, c) in enumerate(result.section_counts.items(), start=1)]
    rows.append(["Total", _per_n(result.counts.dram_reads, n),
                 _per_n(result.counts.dram_writes, n)])
    return format_table(["Pass", "DRAM reads", "DRAM writes"], rows, title=title)


def _passes(result: Run, first: str) -> int:
    """How many times the program streams its input: the number of LOADs of its first element."""
    return sum(s.instruction.opcode == "LOAD" and s.instruction.operands[0] == first
               for s in result.steps)


def softmax_comparison(n: int = 8) -> str:
    """The essay's softmax cost tables: passes of each variant, then 3 vs 4 registers, then what
    fusing with V buys (attention needs no normalise pass)."""
    safe, online = (run(example_program(name, n)) for name in ("safe-softmax", "online-softmax"))
    q, k, v = np.random.default_rng(0).normal(size=(3, n, 1))
    attention = run(online_attention(q[:1], k, v))
    compare = [
        ["Passes", _passes(safe, "x[0]"), _passes(online, "x[0]")],
        ["DRAM reads", _per_n(safe.counts.dram_reads, n), _per_n(online.counts.dram_reads, n)],
        ["DRAM writes", _per_n(safe.counts.dram_writes, n), _per_n(online.counts.dram_writes, n)],
        ["Cycles", safe.counts.cycles, online.counts.cycles],
    ]
    fused = [["Softmax alone (4 registers)", _passes(online, "x[0]"),
              "must output each e^(x_i - m)/S: a second pass reads x again"],
             [f"Attention, one query ({attention.program.num_registers} registers, d = 1)",
              _passes(attention, "k[0][0]"), "only the weighted sum: one division at the end"]]
    return "\n\n".join([
        _passes_table(safe, n, f"Safe softmax, 3 registers, n = {n}"),
        _passes_table(online, n, f"Online softmax, 4 registers, n = {n}"),
        format_table(["Property", "3 registers", "4 registers"], compare,
                     title="3 registers vs 4 registers"),
        format_table(["", "Passes", "Why"], fused, title="From two passes to one"),
    ])


def cost_tables(n: int = 2, softmax_n: int = 8) -> str:
    """All of the essay's cost comparisons, measured by running the programs."""
    return matmul_comparison(n) + "\n\n" + softmax_comparison(softmax_n)
