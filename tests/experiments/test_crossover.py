"""The crossover bench: who overtakes whom, read off the measured sizes."""

from flashkit.experiments import crossover
from flashkit.experiments.crossover import Point

from .conftest import assert_png_if_matplotlib, load_json


def _points(times):
    return [Point(m, n, ms, note="out of memory" if ms is None else "")
            for m, series in times.items() for n, ms in series.items()]


def test_crossover_between_the_sizes_where_the_winner_changes():
    points = _points({"naive": {1024: 1.0, 2048: 4.0, 4096: 16.0},
                      "tiled": {1024: 2.0, 2048: 3.0, 4096: 9.0}})
    [line] = crossover.crossovers(points, ["naive", "tiled"])
    assert line == "naive vs tiled: naive faster at 1k; tiled overtakes between 1k and 2k"


def test_out_of_memory_loses_to_anything_that_ran():
    points = _points({"naive": {1024: 1.0, 2048: None}, "tiled": {1024: 5.0, 2048: 50.0}})
    [line] = crossover.crossovers(points, ["naive", "tiled"])
    assert "tiled overtakes between 1k and 2k" in line


def test_no_crossover_says_so():
    points = _points({"naive": {256: 1.0, 512: 2.0}, "tiled": {256: 3.0, 512: 9.0}})
    [line] = crossover.crossovers(points, ["naive", "tiled"])
    assert line == "naive vs tiled: naive is faster at every size measured (256..512): no crossover"


def test_naive_is_the_chapters_attention():
    import torch
    q, k, v = torch.randn(3, 1, 2, 33, 16, dtype=torch.float64)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert (crossover.naive_attention(q, k, v) - expected).abs().max() < 1e-12
    tiled = crossover.call("tiled", q, k, v)
    assert (tiled - expected).abs().max() < 1e-12


def test_bench_compare_on_cpu(flashkit_cli, tmp_path):
    flashkit_cli("bench", "--compare", "naive,tiled,triton", "--seqlens", "64,128",
                 "--device", "cpu", "--out", tmp_path)
    data = load_json(tmp_path / "crossover.json")
    by = {(p["method"], p["seqlen"]): p for p in data["points"]}
    assert by["naive", 64]["ms"] > 0 and by["tiled", 128]["ms"] > 0
    assert by["triton", 64]["ms"] is None and "interprets" in by["triton", 64]["note"]
    assert len(data["crossovers"]) == 3
    assert_png_if_matplotlib(tmp_path / "crossover.png")
