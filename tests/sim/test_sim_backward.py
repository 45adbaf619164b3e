"""The tiled backward's gradients against autograd, and its HBM counts against the closed forms."""

import numpy as np
import pytest
import torch

from flashkit import reference
from flashkit.sim import backward
from flashkit.sim.machine import run
from flashkit.sim.programs import example_program


def _autograd(q, k, v, do):
    q, k, v = (torch.tensor(t, requires_grad=True) for t in (q, k, v))
    out, _ = reference.attention(q[None, :, None], k[None, :, None], v[None, :, None])
    out.backward(torch.tensor(do)[None, :, None])
    return q.grad.numpy(), k.grad.numpy(), v.grad.numpy()


@pytest.mark.parametrize("order", backward.ORDERS)
@pytest.mark.parametrize("d_trick", [True, False])
@pytest.mark.parametrize("n, nk, block_r, block_c", [(7, 5, 3, 2), (8, 8, 4, 4), (1, 9, 2, 4)])
def test_gradients_match_autograd(order, d_trick, n, nk, block_r, block_c):
    rng = np.random.default_rng(n * 10 + nk)
    q, do = rng.normal(size=(2, n, 3))
    k, v = rng.normal(size=(2, nk, 3))
    g = backward.attention_backward(q, k, v, do, block_r, block_c, order, d_trick)
    for got, want in zip((g.dq, g.dk, g.dv), _autograd(q, k, v, do), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("order", backward.ORDERS)
def test_closed_form_equals_the_executed_count(order):
    q, k, v, do = np.random.default_rng(0).normal(size=(4, 12, 5))
    executed = backward.attention_backward(q, k, v, do, 4, 4, order).io
    closed = backward._backward_io(12, 5, 4, order)
    assert executed.reads == closed.reads and executed.writes == closed.writes


def test_d_trick_halves_k_loads_row_wise_and_leaves_one_column_wise():
    q, k, v, do = np.random.default_rng(1).normal(size=(4, 16, 4))
    loads = {(order, trick): backward.attention_backward(q, k, v, do, 4, 4, order, trick)
             .io.reads["K"] // (16 * 4) for order in backward.ORDERS for trick in (False, True)}
    assert loads == {("row", False): 8, ("row", True): 4, ("column", False): 5,
                     ("column", True): 1}


def test_column_wise_is_two_inner_one_outer():
    q, k, v, do = np.random.default_rng(2).normal(size=(4, 16, 4))
    writes = {order: backward.attention_backward(q, k, v, do, 4, 4, order).io.writes
              for order in backward.ORDERS}
    once = 16 * 4
    assert [writes["row"][g] == once for g in ("dQ", "dK", "dV")] == [True, False, False]
    assert [writes["column"][g] == once for g in ("dQ", "dK", "dV")] == [False, True, True]


def test_inner_product_with_six_registers_is_twenty_cycles():
    result = run(example_program("matmul-inner-6", 2, seed=3))
    a, b = result.program.inputs["a"], result.program.inputs["b"]
    np.testing.assert_array_equal(result.output("c"), a @ b)
    assert (result.counts.cycles, result.counts.dram_reads, result.counts.dram_writes) == (20, 8, 4)
    assert result.program.num_registers == 6


def test_learn_backward_prints_the_tables(capsys):
    from flashkit import cli
    assert cli.main(["learn", "backward"]) == 0
    text = capsys.readouterr().out
    assert "2 inner, 1 outer" in text and "1 inner, 2 outer" in text
    assert "inner product, 6 registers" in text and "FLOPs / byte" in text


def test_hbm_states_where_nine_times_is_reached_and_the_block_size_example(capsys):
    from flashkit import cli
    assert cli.main(["simulate", "hbm"]) == 0
    text = capsys.readouterr().out
    assert "with 192 KiB of SRAM, the most is 7.6x; with 228 KiB (a Hopper SM) it is 9.1x" in text
    assert "B_c = ceil(59 / 12) = 5, B_r = 3" in text


def test_chapter_score_tensor_is_half_a_gigabyte():
    from flashkit.experiments import crossover
    note = crossover.score_tensor_note(crossover.default_problem("cuda"))
    assert "0.54 GB each at N = 4096" in note and "0.50 GiB" in note
