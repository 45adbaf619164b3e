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


def test_probe_skips_a_method_after_a_slow_point(monkeypatch):
    def slow(problem, method, seqlen):
        return memory.Point(method, seqlen, "ok", 1, seconds=5.0)
    monkeypatch.setattr(memory, "measure", slow)
    problem = memory.Problem(1, 1, 16, "float32", False, "cpu")
    points = memory.probe(problem, [64, 128], ["tiled"], None, max_seconds=1.0)
    assert [p.status for p in points] == ["ok", "skipped"]
    assert "took 5s" in points[1].note
