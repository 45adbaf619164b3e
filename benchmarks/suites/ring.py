"""ring: weak scaling of ring attention, tokens/s per GPU as the group grows.

Each GPU holds T tokens.

Causal, zigzag layout, bf16, head dim 128, nheads 16, batch 1, forward + backward, Triton block
kernels over NCCL. For every T (tokens per GPU, default 32k..256k) it times

    ring    flashkit.distributed.ring_flash_attn_func on the whole group (global seqlen W * T)
    local   the same rank's block calls and merges with no communication: one GPU doing one
            shard's worth of the work (on W = 1 the two are the same program)

and reports tokens/s per GPU for both, efficiency = local / ring time (1.0 = the P2P transfers
are fully hidden behind the kernels), and attention TFLOP/s per GPU (4 b h d per visible pair
forward, 2.5x that backward; causal visible pairs N (N + 1) / 2 over the group, 1/W per GPU).

    PYTHONPATH=src python3 benchmarks/suites/ring.py             # spawns one rank per GPU
    PYTHONPATH=src torchrun --nproc-per-node 4 benchmarks/suites/ring.py

    PYTHONPATH=src python3 benchmarks/suites/ring.py --cpu 2 --tokens 256 --out /tmp
                                               # smoke test of the script: gloo, CPU, float32

Timing: wall clock of each of --iters iterations after --warmup, ranks released together by a
barrier and the device synchronised around it; the slowest rank's median counts. Rank 0 writes
benchmarks/results/ring/<date>_<W>gpu.json with the date, device, versions and config.

--check-tokens T first checks the ring (bf16, causal, GQA 8:2, d 128, T tokens per rank, both
layouts) and single-device flash_attn_func against the float64 oracle on the gathered tensors,
with docs/design.md section 5's rule (error <= 2 x the bf16 materialised computation's + 1e-5) for
out, dq, dk, dv; the errors go into the JSON too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import default_out

import flashkit
import flashkit.distributed as fd
from flashkit import reference
from flashkit.distributed.engine import RingProblem, ring_backward, ring_forward
from flashkit.distributed.plan import ring_plans
from flashkit.distributed.ring import Pending
from flashkit.ops.params import AttentionParams
from flashkit.testing import max_error


class NoComm:
    """A ring whose shifts hand back what they were given: the compute of a step, no transfer."""

    def shift(self, tensors):
        return Pending([], tensors)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device, warmup: int, iters: int) -> float:
    """The slowest rank's median wall time of fn() in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    worst = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def bench_one(tokens: int, args, rank: int, world: int, device: torch.device) -> dict:
    """Time the ring and its communication-free twin on random shards of `tokens` tokens."""
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    shape, dtype = (1, tokens, args.nheads, args.headdim), _dtype(device)
    q, k, v, dout = (torch.randn(shape, generator=gen, device=device, dtype=dtype)
                     for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def ring():
        out = fd.ring_flash_attn_func(q, k, v, causal=True, layout="zigzag")
        out.backward(dout)

    plans = ring_plans("zigzag", rank, world, [tokens], [tokens], None, 0)
    problem = RingProblem(NoComm(), plans, AttentionParams(softmax_scale=args.headdim ** -0.5),
                          _backend(device))

    def local():
        with torch.no_grad():
            out, lse = ring_forward(q, k, v, None, problem)
            ring_backward(dout, q, k, v, None, out, lse, None, problem)

    ring_ms = _median_ms(ring, device, args.warmup, args.iters)
    local_ms = _median_ms(local, device, args.warmup, args.iters)
    n = world * tokens
    flops = 3.5 * 4 * args.nheads * args.headdim * (n * (n + 1) / 2) / world
    return {"tokens_per_gpu": tokens, "global_seqlen": n, "ring_ms": ring_ms,
            "local_ms": local_ms, "efficiency": local_ms / ring_ms,
            "tokens_per_s_per_gpu": tokens / (ring_ms / 1e3),
            "local_tokens_per_s": tokens / (local_ms / 1e3),
            "tflops_per_gpu": flops / (ring_ms / 1e3) / 1e12}


def _attend(kind: str, q, k, v, dout, layout: str, rank: int, world: int, device):
    """(out, dq, dk, dv) on the global tensors: the oracle, the materialised baseline, the
    single-device kernel, or the ring on this rank's shards (gathered back)."""
    if kind == "ring":
        q, k, v, dout = (fd.shard(x, 1, rank, world, layout) for x in (q, k, v, dout))
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    if kind in ("oracle", "baseline"):
        out = reference.attention(q, k, v, causal=True)[0]
    elif kind == "single":
        out = flashkit.flash_attn_func(q, k, v, causal=True, backend=_backend(device))
    else:
        out = fd.ring_flash_attn_func(q, k, v, causal=True, layout=layout)
    out.backward(dout)
    results = (out, q.grad, k.grad, v.grad)
    if kind == "ring":
        results = tuple(fd.gather_unshard(x, 1, layout) for x in results)
    return results


def check(tokens: int, rank: int, world: int, device: torch.device) -> list:
    """Errors against the float64 oracle, and the docs/design.md section 5 verdict, per layout."""
    gen = torch.Generator(device=device).manual_seed(4321)  # the same tensors on every rank
    n, dtype = world * tokens, _dtype(device)
    shapes = [(1, n, 8, 128), (1, n, 2, 128), (1, n, 2, 128), (1, n, 8, 128)]
    full = [torch.randn(s, generator=gen, device=device, dtype=torch.float64) for s in shapes]
    low = [x.to(dtype) for x in full]
    oracle = _attend("oracle", *full, "contiguous", rank, world, device)
    baseline = _attend("baseline", *low, "contiguous", rank, world, device)
    single = _attend("single", *low, "contiguous", rank, world, device)
    rows = []
    for layout in ("zigzag", "contiguous"):
        ring = _attend("ring", *low, layout, rank, world, device)
        for name, r, s, b, o in zip(("out", "dq", "dk", "dv"), ring, single, baseline, oracle,
                                    strict=True):
            bound = 2 * max_error(b, o) + 1e-5
            rows.append({"layout": layout, "tensor": name, "ring": max_error(r, o),
                         "single": max_error(s, o), "bound": bound,
                         "ok": max_error(r, o) <= bound and max_error(s, o) <= bound})
    return rows


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "torch"


def main(rank: int, world: int, args) -> None:
    """One rank: join the group (NCCL, or gloo with --cpu), time every T, rank 0 writes."""
    if args.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        checked = check(args.check_tokens, rank, world, device) if args.check_tokens else []
        if rank == 0:
            for row in checked:
                print(json.dumps(row), flush=True)
        rows = []
        for tokens in args.tokens:
            row = bench_one(tokens, args, rank, world, device)
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if rank == 0:
            _write(rows, checked, world, device, args)
    finally:
        dist.destroy_process_group()


def _versions() -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton_version,
            "flashkit": flashkit.__version__}


def _write(rows: list, checked: list, world: int, device: torch.device, args) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    record = {"benchmark": "ring attention weak scaling", "date": now.isoformat(),
              "device": f"{world} x {name or 'cpu'}", "world": world, "versions": _versions(),
              "config": {"layout": "zigzag", "causal": True, "dtype": str(_dtype(device)),
                         "batch": 1, "nheads": args.nheads, "headdim": args.headdim,
                         "backend": _backend(device), "dist_backend": dist.get_backend(),
                         "warmup": args.warmup, "iters": args.iters, "pass": "forward+backward"},
              "check": checked, "results": rows}
    kind = "cpu" if device.type == "cpu" else "gpu"
    path = Path(args.out or default_out("ring")) / f"{now:%Y%m%d_%H%M}_{world}{kind}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+",
                   default=[32768, 65536, 131072, 262144], help="tokens per GPU")
    p.add_argument("--nheads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--check-tokens", type=int, default=0, metavar="T",
                   help="first check against the float64 oracle, T tokens per rank")
    p.add_argument("--cpu", type=int, default=0, metavar="W",
                   help="smoke test: W gloo processes on the CPU, torch backend, float32")
    p.add_argument("--out", "--out-dir", dest="out", default=None,
                   help="result folder (default: $OUT/ring or benchmarks/results/ring)")
    return p.parse_args()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    arguments = _parse()
    if "RANK" in os.environ:  # torchrun set up the rendezvous (one node)
        main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), arguments)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        ranks = arguments.cpu or torch.cuda.device_count()
        mp.spawn(main, args=(ranks, arguments), nprocs=ranks)
