"""The toy register machine of the essay: semantics, counts, register tables and errors."""

import numpy as np
import pytest

from flashkit.sim.machine import Instruction, MachineError, RegisterMachine, assemble, op, run
from flashkit.sim.programs import dot_product_c00, matmul_outer_product

# The essay, "Full trace for c00", verbatim.
SEED_C00_TRACE = """
LOAD a[0][0], R0
LOAD b[0][0], R1
MAC_Z R0, R1, R2
LOAD a[0][1], R0
LOAD b[1][0], R1
MAC R0, R1, R2, R2
STORE R2, c[0][0]
"""

# The essay, "Full trace: outer product matmul", steps 1-22 verbatim.
SEED_OUTER_TRACE = """
LOAD a[0][0], R0
LOAD b[0][0], R1
MAC_Z R0, R1, R2
LOAD b[0][1], R1
MAC_Z R0, R1, R3
LOAD a[1][0], R0
MAC_Z R0, R1, R5
LOAD b[0][0], R1
MAC_Z R0, R1, R4
LOAD a[0][1], R0
LOAD b[1][0], R1
MAC R0, R1, R2, R2
LOAD b[1][1], R1
MAC R0, R1, R3, R3
LOAD a[1][1], R0
MAC R0, R1, R5, R5
LOAD b[1][0], R1
MAC R0, R1, R4, R4
STORE R2, c[0][0]
STORE R3, c[0][1]
STORE R4, c[1][0]
STORE R5, c[1][1]
"""


@pytest.fixture
def ab():
    rng = np.random.default_rng(1)
    return rng.normal(size=(2, 2, 2))


def _machine(num_registers, a, b):
    return RegisterMachine(num_registers, {"a": a, "b": b, "c": np.full((2, 2), np.nan)})


def test_seed_c00_trace_runs_with_seed_counts_and_register_table(ab):
    a, b = ab
    machine = _machine(3, a, b)
    for step, instruction in enumerate(assemble(SEED_C00_TRACE), start=1):
        machine.execute(instruction, step)
    # The essay: "4 LOADs + 2 MACs + 1 STORE = 7 cycles".
    assert (machine.counts.cycles, machine.counts.dram_reads, machine.counts.dram_writes) == \
        (7, 4, 1)
    assert machine.dram["c"][0, 0] == pytest.approx(a[0, 0] * b[0, 0] + a[0, 1] * b[1, 0])
    # The final row of the essay's table is a01 | b10 | c00; with no note the sum is spelled out.
    assert [v.label for v in machine.registers] == ["a01", "b10", "a00·b00 + a01·b10"]


def test_c00_builder_is_the_seed_trace_and_names_c00(ab):
    a, b = ab
    program = dot_product_c00(a, b)
    assert [str(i) for i in program.instructions] == [str(i) for i in
                                                      assemble(SEED_C00_TRACE)]
    result = run(program)
    # The essay's table rows 3 and 6: R2 = a00 b00, then c00.
    assert result.steps[2].registers[2].label == "a00·b00"
    assert [v.label for v in result.steps[-1].registers] == ["a01", "b10", "c00"]
    assert result.output("c")[0, 0] == pytest.approx((a @ b)[0, 0])


def test_outer_product_builder_is_the_seed_trace(ab):
    a, b = ab
    program = matmul_outer_product(a, b)
    assert program.num_registers == 6
    assert [str(i) for i in program.instructions] == [str(i) for i in
                                                      assemble(SEED_OUTER_TRACE)]
    result = run(program)
    # The essay: "10 LOADs + 8 MACs + 4 STOREs = 22 cycles with 6 registers".
    assert (result.counts.cycles, result.counts.dram_reads, result.counts.dram_writes) == \
        (22, 10, 4)
    np.testing.assert_allclose(result.output("c"), a @ b)


def test_every_opcode_computes_what_the_seed_says():
    machine = RegisterMachine(4, {"x": np.array([3.0, -2.0]), "out": np.zeros(4)})
    for line in ["LOAD x[0], R0", "LOAD x[1], R1"]:
        machine.execute(assemble(line)[0])
    expected = {
        "MAC_Z R0, R1, R2": -6.0, "MAC R0, R1, R0, R2": -3.0, "MAX R0, R1, R2": 3.0,
        "SUB R0, R1, R2": 5.0, "EXP R1, R2": np.exp(-2.0), "ADD R0, R1, R2": 1.0,
        "MUL R0, R1, R2": -6.0, "DIV R0, R1, R2": -1.5, "MOV R1, R2": -2.0,
    }
    for line, value in expected.items():
        machine.execute(assemble(line)[0])
        assert machine.registers[2].number == pytest.approx(value), line
    machine.execute(op("STORE", "R2", "out[3]"))
    assert machine.dram["out"][3] == -2.0
    assert machine.counts.cycles == 2 + len(expected) + 1  # one cycle per instruction
    assert (machine.counts.dram_reads, machine.counts.dram_writes) == (2, 1)


def test_labels_compose_like_the_seed_tables():
    machine = RegisterMachine(4, {"x": np.array([1.0, 2.0])})
    for line in ["LOAD x[0], R0", "LOAD x[1], R1", "SUB R0, R1, R2", "EXP R2, R3",
                 "MUL R0, R3, R3"]:
        machine.execute(assemble(line)[0])
    assert [v.label for v in machine.registers] == ["x0", "x1", "x0 − x1", "x0·e^(x0 − x1)"]


def test_missing_register_is_an_error_naming_step_and_register(ab):
    a, b = ab
    machine = _machine(3, a, b)
    with pytest.raises(MachineError, match=r"step 1 \(LOAD a\[0\]\[0\], R3\): register R3 does "
                                           r"not exist on a 3-register machine \(R0..R2\)"):
        machine.execute(op("LOAD", "a[0][0]", "R3"))


def test_whole_program_is_checked_before_it_runs(ab):
    a, b = ab
    program = matmul_outer_product(a, b)
    program.num_registers = 5  # the essay's trace needs R5
    with pytest.raises(MachineError, match="register R5 does not exist"):
        run(program)


def test_read_before_write_is_an_error(ab):
    a, b = ab
    machine = _machine(3, a, b)
    machine.execute(op("LOAD", "a[0][0]", "R0"))
    with pytest.raises(MachineError, match=r"step 2 \(MAC_Z R0, R1, R2\): R1 is read before"):
        machine.execute(op("MAC_Z", "R0", "R1", "R2"), step=2)


@pytest.mark.parametrize("line, message", [
    ("LOAD z[0], R0", "DRAM has no array 'z'"),
    ("LOAD a[2][0], R0", r"a\[2\]\[0\] is outside a of shape \(2, 2\)"),
    ("LOAD a[0], R0", r"a\[0\] is outside a"),
])
def test_bad_dram_addresses_are_errors(ab, line, message):
    a, b = ab
    with pytest.raises(MachineError, match=message):
        _machine(3, a, b).execute(assemble(line)[0])


@pytest.mark.parametrize("opcode, operands, message", [
    ("FMA", ("R0", "R1", "R2"), "unknown opcode 'FMA'"),
    ("MAC", ("R0", "R1", "R2"), "MAC takes 4 operands, got 3"),
    ("LOAD", ("R0", "R1"), "'R0' is not a DRAM address"),
    ("ADD", ("R0", "x[0]", "R1"), "'x\\[0\\]' is not a register"),
])
def test_malformed_instructions_are_errors(opcode, operands, message):
    with pytest.raises(MachineError, match=message):
        Instruction(opcode, operands)


def test_assemble_reports_the_line_and_skips_comments():
    assert len(assemble("# comment\nLOAD x[0], r1  # the essay writes r1\n\n")) == 1
    with pytest.raises(MachineError, match="line 2: "):
        assemble("LOAD x[0], R0\nMAC R0, R0")


def test_machine_needs_a_register():
    with pytest.raises(ValueError, match="num_registers must be >= 1"):
        RegisterMachine(0, {})
