"""Ring attention against the float64 oracle on 1, 2 and 4 CPU processes (gloo).

Each world size runs every case of ring_cases in ONE process group (spawned once, cached for the
module); each test then reports one case. World size 1 runs in this process. The gpu test runs
the Triton backend over NCCL when two GPUs are present.
"""

from __future__ import annotations

import functools
import json
import socket

import pytest
import torch
import torch.multiprocessing as mp
from ring_cases import REJECT, VALID, run
from tests.ops.test_triton import INTERPRET

import flashkit.distributed as fd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_group(world: int, out_dir, dist_backend: str = "gloo", names=None) -> dict:
    path = str(out_dir / f"ring_{dist_backend}_{world}.json")
    args = (world, _free_port(), path, dist_backend, names)
    if world == 1:
        run(0, *args)
    else:
        mp.spawn(run, args=args, nprocs=world)
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory):
    """results(world): {case name: failure or ""}, from one group per world size."""
    return functools.cache(lambda world: _run_group(world, tmp_path_factory.mktemp("ring")))


def _report(results: dict, name: str) -> None:
    assert name in results, f"{name}: the worker did not run it"
    if results[name]:
        pytest.fail(results[name], pytrace=False)


@pytest.mark.parametrize("world, case", [(w, c) for c in VALID for w in c.worlds],
                         ids=lambda x: x.name if hasattr(x, "name") else str(x))
def test_ring_matches_oracle(cpu_results, world, case):
    if case.backend == "triton" and not INTERPRET:
        pytest.skip("CPU tensors: the Triton cases need TRITON_INTERPRET=1 (on a GPU, "
                    "test_ring_triton_nccl runs them)")
    _report(cpu_results(world), case.name)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reject", REJECT, ids=lambda r: r.name)
def test_ring_rejects(cpu_results, world, reject):
    """Every rank raises the expected clear error (none hangs) and the group stays usable."""
    _report(cpu_results(world), reject.name)


def test_needs_initialized_process_group():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(RuntimeError, match="group: torch.distributed is not initialized"):
        fd.ring_flash_attn_func(q, q, q)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_ring_triton_nccl(tmp_path):
    """The Triton backend over NCCL (the cases without float64 or an lse gradient)."""
    names = ("contiguous-causal", "zigzag-causal-gqa4", "zigzag-causal-bf16",
             "contiguous-window-odd-shards", "zigzag-causal-window", "contiguous-causal-q-longer",
             "varlen-zigzag-window", "contiguous-causal-alibi", "zigzag-alibi-window-softcap",
             "zigzag-causal-sink", "zigzag-causal-sink-bf16", "triton-alibi-sink-k-longer")
    results = _run_group(2, tmp_path, "nccl", names)
    failures = "\n".join(f"{n}: {results[n]}" for n in names if results[n])
    if failures:  # whole tracebacks: an assert's message would be cut short
        pytest.fail(failures, pytrace=False)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backward_gives_the_ring_its_gradients_unrounded(backend, varlen):
    """The ring sums its steps' gradients in the accumulation dtype (engine.ring_backward):
    each backend's backward with grad_dtype=float32 returns, for bf16 inputs, float32 gradients
    that round to exactly the bf16 ones it returns by default (the same sums, rounded once at
    the store)."""
    from flashkit.ops.custom_op import backend_module
    from flashkit.ops.params import AttentionParams

    kernels = backend_module(backend)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(7)
    lengths = (5, 11) if varlen else (9, 9)
    lead = (sum(lengths),) if varlen else (2, lengths[0])
    q, k, v, dout = (torch.randn(*lead, 2, 16, generator=gen).to(device, torch.bfloat16)
                     for _ in range(4))
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device=device)
    params = AttentionParams(0.25, None, 0, alibi_slopes=torch.rand(2, device=device),
                             **(dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=11,
                                     max_seqlen_k=11) if varlen else {}))
    out, lse = kernels.forward(q, k, v, params)
    rounded = kernels.backward(dout, q, k, v, out, lse, params, own_lse=False)[:3]
    exact = kernels.backward(dout, q, k, v, out, lse, params, own_lse=False,
                             grad_dtype=torch.float32)[:3]
    for name, r, e in zip(("dq", "dk", "dv"), rounded, exact, strict=True):
        assert r.dtype == torch.bfloat16 and e.dtype == torch.float32, name
        assert torch.equal(e.to(torch.bfloat16), r), name
        assert not torch.equal(e, r.float()), f"{name}: float32 values already bf16-rounded"
