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
