"""Every experiment subcommand runs at tiny sizes through `flashkit ...` and writes files that
parse."""

import csv

from tests.experiments.conftest import assert_png_if_matplotlib, load_json


def test_memory_measures_naive_and_tiled_and_skips_triton_on_cpu(flashkit_cli, tmp_path):
    flashkit_cli("memory", "--device", "cpu", "--out", tmp_path, "--seqlens", "256,1k",
                 "--methods", "naive,tiled,triton")
    points = {(p["method"], p["seqlen"]): p for p in load_json(tmp_path / "memory.json")["points"]}
    for seqlen in (256, 1024):
        assert points["naive", seqlen]["status"] == "ok"
        assert points["tiled", seqlen]["status"] == "ok"
        assert points["triton", seqlen]["status"] == "skipped"
    # 4 heads x 1024^2 float32 scores are 16 MiB per copy: naive needs far more than tiled.
    assert points["naive", 1024]["extra_bytes"] > 16 * 2**20
    assert points["naive", 1024]["extra_bytes"] > 4 * points["tiled", 1024]["extra_bytes"]
    assert len(list(csv.DictReader((tmp_path / "memory.csv").open()))) == 6
    assert_png_if_matplotlib(tmp_path / "memory.png")


def test_memory_cap_reports_what_naive_would_need(flashkit_cli, tmp_path):
    flashkit_cli("memory", "--device", "cpu", "--out", tmp_path, "--seqlens", "64",
                 "--methods", "naive", "--max-gib", "1e-6")
    (point,) = load_json(tmp_path / "memory.json")["points"]
    assert point["status"] == "skipped" and "would need" in point["note"]


def test_bench_times_flashkit_and_sdpa(flashkit_cli, tmp_path):
    flashkit_cli("bench", "--device", "cpu", "--out", tmp_path, "--seqlens", "64",
                 "--headdims", "16", "--directions", "fwd,bwd")
    data = load_json(tmp_path / "bench.json")
    assert {r["method"] for r in data["results"]} == {"flashkit", "sdpa"}
    assert all(r["tflops"] > 0 and not r["error"] for r in data["results"])
    assert len(list(csv.DictReader((tmp_path / "bench.csv").open()))) == len(data["results"])
    assert_png_if_matplotlib(tmp_path / "bench_float32.png")


def test_break_it_reports_each_variant(flashkit_cli, tmp_path):
    flashkit_cli("break-it", "--out", tmp_path, "--seqlen", "64", "--nheads", "1",
                 "--headdim", "16", "--block", "16", "--logit-stds", "1,25", "--train-steps", "2")
    outcomes = load_json(tmp_path / "break_it.json")["outcomes"]
    assert len(outcomes) == 2 * 2 * 3  # stds x dtypes x variants
    by = {(o["logit_std"], o["dtype"], o["variant"]): o for o in outcomes}
    assert by[25.0, "float16", "no max subtraction"]["nonfinite"] > 0
    assert by[1.0, "float32", "intact"]["max_error"] < 1e-5
    data = load_json(tmp_path / "break_it.json")
    causal = {(o["dtype"], o["variant"]): o for o in data["causal_outcomes"]}
    assert causal["float32", "mask from arange(0) in each tile"]["max_error"] > 0.1
    assert len(data["training"]["runs"]) == 3
    assert all(len(r["losses"]) == 2 for r in data["training"]["runs"])
    for png in ("break_it.png", "break_it_train.png"):
        assert_png_if_matplotlib(tmp_path / png)


def test_train_writes_both_loss_curves(flashkit_cli, tmp_path):
    flashkit_cli("train", "--device", "cpu", "--out", tmp_path, "--steps", "3", "--seqlens",
                 "16", "--tokens", "32", "--layers", "1", "--heads", "2", "--embd", "16")
    data = load_json(tmp_path / "train.json")
    assert [r["attention"] for r in data["runs"]] == ["naive", "flashkit"]
    assert all(len(r["losses"]) == 3 for r in data["runs"])
    (comparison,) = data["comparisons"]
    assert comparison["max_delta"] < 1e-4 and comparison["tokens_per_s_flashkit"] > 0
    assert_png_if_matplotlib(tmp_path / "train.png")

