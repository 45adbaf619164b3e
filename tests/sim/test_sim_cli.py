"""``flashkit simulate ...`` through its own argparse parser."""

import argparse

import pytest

from flashkit.sim.cli import register


def _parser():
    parser = argparse.ArgumentParser(prog="flashkit")
    register(parser.add_subparsers())
    return parser


def _run(capsys, *argv):
    args = _parser().parse_args(["simulate", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_simulate_alone_prints_help(capsys):
    assert "machine" in _run(capsys)


def test_machine_cost_tables(capsys):
    out = _run(capsys, "machine")
    assert "Inner product" in out and "25" in out and "22" in out


def test_machine_program_trace(capsys):
    out = _run(capsys, "machine", "--program", "c00")
    assert "MAC R0, R1, R2, R2" in out and "c00" in out
    assert "total         7           4            1" in out


def test_machine_values_and_attention(capsys):
    out = _run(capsys, "machine", "--program", "online-attention", "--n", "2", "--d", "2",
               "--values")
    assert "[query 1]" in out and "o =" in out


def test_machine_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["simulate", "machine", "--n", "0"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["simulate", "machine", "--program", "sort"])
    assert "--n" in capsys.readouterr().err


def test_loop_orders_prints_the_seed_table(capsys):
    out = _run(capsys, "loop-orders", "--n", "4")
    assert "Q loads     4 (n)                16 (n^2)" in out
    assert "resident R" in out


def test_systolic_both_designs(capsys):
    out = _run(capsys, "systolic", "--design", "both")
    assert out.count("matches A @ B: True; cycles 5, M + K + N - 2 = 5") == 2


def test_tpu_prints_the_seed_table(capsys):
    out = _run(capsys, "tpu", "--breakdown")
    assert "VPU cycles         10,876     10,576    18,432" in out and "exp rescale" in out


def test_hbm_prints_the_theorem_and_the_tiles(capsys):
    out = _run(capsys, "hbm", "--ns", "256", "1024", "--causal", "--tiles", "128x64")
    assert "standard / (Nd+N^2)" in out and "FA1 x M / (N^2 d^2)" in out
    assert "Triton forward, causal" in out and "128       64" in out


def test_hbm_rejects_a_bad_tile():
    with pytest.raises(SystemExit):
        _parser().parse_args(["simulate", "hbm", "--tiles", "128"])


def test_machine_on_more_registers_and_too_few(capsys):
    out = _run(capsys, "machine", "--program", "safe-softmax", "--registers", "5")
    assert "(5 registers)" in out and "R4" in out
    args = _parser().parse_args(["simulate", "machine", "--program", "matmul-outer",
                                 "--registers", "3"])
    with pytest.raises(SystemExit) as stop:  # a usage error: the message and exit status 2
        args.func(args)
    assert stop.value.code == 2
    assert "registers=3 is too few: this program needs 6" in capsys.readouterr().err


def test_every_machine_has_teaching_help(capsys):
    for machine in ("machine", "loop-orders", "systolic", "tpu", "hbm"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["simulate", machine, "--help"])
        assert "examples:\n  flashkit simulate " + machine in capsys.readouterr().out
