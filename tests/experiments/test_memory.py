"""The memory probe's pieces: what counts as OOM, what --max-gib predicts, how a cell reads."""

import torch

from flashkit.experiments import memory


def test_out_of_memory_errors_are_recognised():
    assert memory.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert memory.is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    assert memory.is_out_of_memory(MemoryError())
    assert not memory.is_out_of_memory(RuntimeError("shape mismatch"))


def test_naive_bytes_grows_with_the_square_of_seqlen():
    problem = memory.Problem(2, 4, 64, "bfloat16", False, "cpu")
    assert problem.naive_bytes(1024) == memory.NAIVE_SCORE_COPIES * 2 * 4 * 1024**2 * 2
    assert problem.naive_bytes(2048) == 4 * problem.naive_bytes(1024)


def test_cells_read_as_a_person_would():
    assert memory.Point("naive", 64, "ok", 3 * 2**20).cell() == "3.0 MiB"
    assert memory.Point("naive", 64, "oom").cell() == "OOM"
    assert memory.Point("triton", 64, "skipped", note="needs CUDA").cell() == "skipped: needs CUDA"


def test_probe_skips_a_method_once_its_next_point_is_predicted_too_slow(monkeypatch):
    # Each point "takes" 0.3 s: 64 runs, 128 is predicted at 0.3 * (128/64)^2 = 1.2 s > 1 s.
    def measured(problem, method, seqlen):
        return memory.Point(method, seqlen, "ok", 1, seconds=0.3)
    monkeypatch.setattr(memory, "measure", measured)
    problem = memory.Problem(1, 1, 16, "float32", False, "cpu")
    points = memory.probe(problem, [64, 128, 256], ["tiled"], None, max_seconds=1.0)
    assert [p.status for p in points] == ["ok", "skipped", "skipped"]
    assert "~1s > --max-seconds 1" in points[1].note and "64 took 0.3s" in points[1].note
    assert [p.status for p in memory.probe(problem, [64, 128], ["tiled"], None, 2.0)] == [
        "ok", "ok"]


def test_probe_stops_a_method_at_its_first_out_of_memory(monkeypatch):
    def naive_fits_up_to_128(problem, method, seqlen):
        if seqlen > 128:
            return memory.Point(method, seqlen, "oom", note="CUDA out of memory")
        return memory.Point(method, seqlen, "ok", 1, seconds=0.0)
    monkeypatch.setattr(memory, "measure", naive_fits_up_to_128)
    problem = memory.Problem(1, 1, 16, "float32", False, "cuda")
    points = memory.probe(problem, [128, 256, 512], ["naive"], None, max_seconds=1.0)
    assert [p.status for p in points] == ["ok", "oom", "skipped"]
    assert points[2].cell() == "skipped: OOM already at 256"


def test_defaults_follow_the_device():
    assert memory.default_problem("cpu") == memory.Problem(1, 4, 64, "float32", False, "cpu")
    gpu = memory.default_problem("cuda", nheads=8)
    assert (gpu.nheads, gpu.headdim, gpu.dtype) == (8, 128, "bfloat16")
    assert max(memory.default_seqlens("cuda")) == 256 * 1024
    assert memory.default_max_seconds("cuda") < memory.default_max_seconds("cpu")
