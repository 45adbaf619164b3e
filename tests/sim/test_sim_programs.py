"""Programs for the register machine: correct numbers, the essay's counts, the closed forms."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashkit.sim.machine import assemble, run
from flashkit.sim.machine_tables import cost_tables, format_counts, format_trace
from flashkit.sim.programs import (
    PROGRAM_NAMES,
    dot_product_c00,
    example_program,
    matmul_inner_product,
    matmul_outer_product,
    online_attention,
    online_softmax,
    safe_softmax,
)


def _counts(result):
    return result.counts.cycles, result.counts.dram_reads, result.counts.dram_writes


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_matmuls_are_correct_and_follow_their_closed_forms(n):
    rng = np.random.default_rng(n)
    a, b = rng.normal(size=(2, n, n))
    inner, outer = run(matmul_inner_product(a, b)), run(matmul_outer_product(a, b))
    np.testing.assert_allclose(inner.output("c"), a @ b, rtol=1e-12)
    np.testing.assert_allclose(outer.output("c"), a @ b, rtol=1e-12)
    assert _counts(inner) == (3 * n**3 + 1, 2 * n**3 - n**2 + 1, n**2)
    assert _counts(outer) == (2 * n**3 + n**2 + n, n**3 + n, n**2)
    assert outer.program.num_registers == n * n + 2
    c00 = run(dot_product_c00(a, b))
    assert c00.output("c")[0, 0] == pytest.approx((a @ b)[0, 0])
    assert _counts(c00) == (3 * n + 1, 2 * n, 1)


def test_two_by_two_matmul_matches_the_seed_cost_table():
    a, b = np.arange(8.0).reshape(2, 2, 2)
    inner, outer = run(matmul_inner_product(a, b)), run(matmul_outer_product(a, b))
    # The essay, "Inner product | Outer product": registers 3 | 6, cycles 25 | 22, LOADs 13 | 10.
    assert (inner.program.num_registers, inner.counts.cycles, inner.counts.dram_reads) == \
        (3, 25, 13)
    assert (outer.program.num_registers, outer.counts.cycles, outer.counts.dram_reads) == \
        (6, 22, 10)
    # The essay's hint: after c00, R0 holds a01, so c01 comes next and reuses it.
    loads = [str(i) for i in inner.program.instructions if i.opcode == "LOAD"]
    assert loads[4] == "LOAD b[1][1], R1"


@pytest.mark.parametrize("n", [1, 2, 7])
def test_safe_softmax_three_passes(n):
    x = np.random.default_rng(n).normal(size=n) * 3
    result = run(safe_softmax(x))
    np.testing.assert_allclose(result.output("out"), _softmax(x), rtol=1e-12)
    # The essay, "Hint: Total cost": reads n | n | n (3n total), writes 0 | 0 | n (n total).
    per_pass = [(c.dram_reads, c.dram_writes) for c in result.section_counts.values()]
    assert per_pass == [(n, 0), (n, 0), (n, n)]
    assert _counts(result) == (11 * n - 1, 3 * n, n)


def test_safe_softmax_register_table_uses_the_seed_names():
    result = run(safe_softmax(np.array([0.5, 2.0, -1.0])))
    labels = {str(s.instruction): [v.label if v else "" for v in s.registers]
              for s in result.steps}
    # The essay pass 1: r1 = max(x0, x1) after the first MAX, m at the end; pass 3 divides by S.
    assert labels["MAX R0, R1, R1"][1] in ("max(x0..x1)", "m")
    assert result.steps[4].registers[1].label == "m"
    assert result.steps[-2].registers[0].label == "e^(x2 − m) / S"


@pytest.mark.parametrize("n", [1, 2, 9])
def test_online_softmax_two_passes(n):
    x = np.random.default_rng(n).normal(size=n) * 3
    result = run(online_softmax(x))
    np.testing.assert_allclose(result.output("out"), _softmax(x), rtol=1e-12)
    # The essay, "Total cost (4 registers, 2 passes)": reads n | n (2n), writes 0 | n (n).
    per_pass = [(c.dram_reads, c.dram_writes) for c in result.section_counts.values()]
    assert per_pass == [(n, 0), (n, n)]
    assert _counts(result) == (14 * n - 4, 2 * n, n)


def test_safe_softmax_is_the_seed_trace():
    # The essay, Problem 4 hints, passes 1-3 for n = 2, with the essay's register names.
    seed_trace = assemble("""
        LOAD x[0], r1
        LOAD x[1], R0
        MAX R0, r1, r1
        LOAD x[0], R0
        SUB R0, r1, R0
        EXP R0, R0
        MOV R0, r2
        LOAD x[1], R0
        SUB R0, r1, R0
        EXP R0, R0
        ADD r2, R0, r2
        LOAD x[0], R0
        SUB R0, r1, R0
        EXP R0, R0
        DIV R0, r2, R0
        STORE R0, out[0]
        LOAD x[1], R0
        SUB R0, r1, R0
        EXP R0, R0
        DIV R0, r2, R0
        STORE R0, out[1]""")
    program = safe_softmax(np.array([0.3, -1.2]))
    assert [str(i) for i in program.instructions] == [str(i).replace("r", "R")
                                                      for i in seed_trace]


def test_online_softmax_init_is_the_seed_trace():
    # The essay, Problem 5 "Initialization (first element)".
    seed_init = assemble("""
        LOAD x[0], R0
        MOV R0, r1
        SUB R0, r1, R0
        EXP R0, R0
        MOV R0, r2""")
    body = online_softmax(np.array([1.0, 3.0])).sections[0][1]
    assert [str(i) for i in body[:5]] == [str(i).replace("r", "R") for i in seed_init]


def test_online_softmax_steady_state_is_the_seed_trace():
    program = online_softmax(np.array([1.0, 3.0, 2.0]))
    # The essay, Problem 5 "Steady state (each subsequent element x_i)", steps 1-9 for i = 1,
    # written with the essay's register names R0, r1, r2, r3.
    seed_steps = assemble("""
        LOAD x[1], R0
        MOV r1, r3
        MAX r1, R0, r1
        SUB r3, r1, r3
        SUB R0, r1, R0
        EXP r3, r3
        EXP R0, R0
        MUL r2, r3, r2
        ADD r2, R0, r2""")
    body = program.sections[0][1]
    assert [str(i) for i in body[5:14]] == [str(i).replace("r", "R") for i in seed_steps]
    result = run(program)
    # After step 8: r2 = s·e^(m − m'), with the essay's m, m' written m1, m2.
    assert result.steps[12].registers[2].label == "s1·e^(m1 − m2)"


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-1000, 1000), min_size=1, max_size=12))
def test_softmax_programs_never_overflow(values):
    x = np.array(values)
    for builder in (safe_softmax, online_softmax):
        out = run(builder(x)).output("out")
        np.testing.assert_allclose(out, _softmax(x), rtol=1e-9, atol=1e-300)


@pytest.mark.parametrize("nq, nk, d, dv", [(1, 1, 1, 1), (3, 4, 1, 1), (2, 5, 3, 2)])
def test_online_attention_is_one_pass_and_correct(nq, nk, d, dv):
    rng = np.random.default_rng(nq + nk + d)
    q, k, v = rng.normal(size=(nq, d)), rng.normal(size=(nk, d)), rng.normal(size=(nk, dv))
    result = run(online_attention(q, k, v))
    weights = np.apply_along_axis(_softmax, 1, q @ k.T)
    np.testing.assert_allclose(result.output("o"), weights @ v, rtol=1e-12)
    per_query = d + 2 * nk * d + 4 + dv + (nk - 1) * (8 + 4 * dv) + 2 * dv
    assert _counts(result) == (nq * per_query, nq * d + nq * nk * (d + dv), nq * dv)
    assert result.program.num_registers == d + dv + 5
    # One pass: every key element is read once per query, nothing else is re-read.
    loads = [str(i.operands[0]) for i in result.program.instructions if i.opcode == "LOAD"]
    assert loads.count("k[0][0]") == nq and loads.count("v[0][0]") == nq


def test_builders_reject_bad_shapes_and_too_few_registers():
    with pytest.raises(ValueError, match="a and b must be square"):
        matmul_inner_product(np.ones((2, 3)), np.ones((3, 2)))
    with pytest.raises(ValueError, match="x must be a non-empty vector"):
        safe_softmax(np.ones((2, 2)))
    with pytest.raises(ValueError, match="registers=5 is too few: this program needs 6"):
        matmul_outer_product(np.ones((2, 2)), np.ones((2, 2)), registers=5)
    with pytest.raises(ValueError, match="need q"):
        online_attention(np.ones((2, 3)), np.ones((2, 2)), np.ones((2, 1)))
    with pytest.raises(ValueError, match="program must be one of"):
        example_program("bubble-sort")


def test_programs_run_on_a_larger_machine():
    result = run(online_softmax(np.array([1.0, 2.0]), registers=8))
    assert result.program.num_registers == 8 and result.steps[-1].registers[7] is None


@pytest.mark.parametrize("name", PROGRAM_NAMES)
def test_every_example_prints_its_register_table(name):
    result = run(example_program(name, n=2))
    text = format_trace(result)
    assert text.count("\n") >= len(result.steps) and "R0" in text
    assert "total" in format_counts(result)
    assert not np.isnan(next(iter(result.dram[n] for n in result.program.outputs))).any()


def test_cost_tables_print_the_seed_numbers():
    text = cost_tables(n=2, softmax_n=8)
    # The essay: cycles 25 | 22, LOADs 13 | 10; softmax 3n | 2n reads, n writes.
    assert "Cycles (full matmul)             25             22" in text
    assert "LOADs                            13             10" in text
    assert "24 (3n)" in text and "16 (2n)" in text
