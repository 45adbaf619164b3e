"""The demo keeps going when a step fails, and says so in its report and exit status."""

from flashkit.experiments import bench, demo


def test_a_failing_step_is_reported_and_the_next_still_runs(tmp_path):
    def broken(sizes, out, report):
        raise RuntimeError("kernel exploded")

    def fine(sizes, out, report):
        report.add("Fine step", "it ran")
    path, failed = demo.run("cpu", tmp_path, smoke=True,
                            steps=[("1. broken", broken), ("2. fine", fine)])
    text = path.read_text()
    assert failed == ["1. broken"]
    assert "1. broken: FAILED" in text and "RuntimeError: kernel exploded" in text
    assert "Fine step" in text


def test_full_sizes_are_the_subcommands_defaults():
    sizes = demo.full_sizes("cuda")
    assert max(sizes.memory_seqlens) == 256 * 1024 and "naive" in sizes.memory_methods
    assert [c.seqlen for c in sizes.train] == [1024, 4096] and sizes.train[0].steps == 200
    assert "sdpa-cudnn" in sizes.bench_methods and "flex" not in sizes.bench_methods
    assert sizes.bench == bench.gpu_grid(full=False)


def test_bench_table_shows_flashkit_as_a_ratio_to_the_reference():
    point = dict(dtype="bfloat16", headdim=64, seqlen=1024, causal=True, direction="fwd",
                 batch=16, nheads=32)
    rows = [bench.Result("flashkit", **point, tflops=300.0),
            bench.Result("sdpa-cudnn", **point, tflops=400.0)]
    bench._add_ratios(rows, bench.reference_method("cuda"))
    header, (row,) = bench.table(rows, ["flashkit", "sdpa-cudnn"], "cuda")
    assert header[-1] == "flashkit / sdpa-cudnn" and row[-1] == "0.75"


def test_cpu_bench_methods_take_turns_and_keep_their_fastest_round(monkeypatch):
    calls = []

    def fake_measure(method, call, layout, r, device):
        calls.append(method)
        r.ms = {("flashkit", 1): 5.0, ("flashkit", 4): 3.0}.get((method, len(calls)), 4.0)
        return r
    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "method_call", lambda method: (None, "bshd"))
    grid = bench.Grid(["float32"], [16], [64], [True], ["fwd"], 64, 32)
    rows = bench.run_grid(grid, ["flashkit", "sdpa"], "cpu")
    assert calls == ["flashkit", "sdpa", "sdpa", "flashkit"]
    assert [(r.method, r.ms) for r in rows] == [("flashkit", 3.0), ("sdpa", 4.0)]
