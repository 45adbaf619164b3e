import argparse

import pytest

from flashkit.algorithms.cli import TOPICS, register


def run(capsys, *argv):
    parser = argparse.ArgumentParser(prog="flashkit")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_softmax_prints_the_seed_example_through_every_variant(capsys):
    out = run(capsys, "learn", "softmax")
    assert out.count("[0.0043, 0.0116, 0.0315, 0.0858, 0.2331, 0.6337]") == 4
    assert out.count("5.4329") == 6  # torch, native, safe, online, 2-pass, 1-pass
    assert "OverflowError" in out


def test_merge_prints_every_grouping(capsys):
    out = run(capsys, "learn", "merge")
    assert out.count("o / l = 5.4329") == 5


def test_loop_orders_prints_the_traffic_table(capsys):
    out = run(capsys, "learn", "loop-orders")
    assert "FA1 (KV outer)" in out and "FA2 (Q outer)" in out
    assert "65,536" in out  # FA1's Q reads (non-causal): Tc x Nq x d = 4 x 256 x 64


def test_welford_prints_the_stream_and_the_cancellation(capsys):
    out = run(capsys, "learn", "welford")
    assert "sample variance M2 / (n - 1) = 4.5714" in out
    assert "Welford                                      = 30.0" in out


def test_all_prints_every_topic(capsys):
    out = run(capsys, "learn", "all")
    assert "5.4329" in out and "FA2 (Q outer)" in out and "Chan's merge" in out


def test_unknown_topic_is_rejected(capsys):
    with pytest.raises(SystemExit):
        run(capsys, "learn", "nope")
    assert "invalid choice" in capsys.readouterr().err
    assert set(TOPICS) == {"softmax", "merge", "loop-orders", "welford", "backward"}
