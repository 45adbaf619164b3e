"""Where the host time of a tiny training step and of an eager decoding step goes, on a GPU:
flashkit against SDPA cuDNN in interleaved loops (the step with autograd's device thread and
on the calling thread), then cProfile of each flashkit call, and the cost of CUDA allocations.

    PYTHONPATH=src python3 benchmarks/diagnostics/host_profile.py > profile.txt

The problems are the overhead suite's (benchmarks/suites/overhead.py): the step on b1 s128 h8
d64 bf16, decoding one new token over 1k and 16k cached keys (32 query / 4 kv heads, d128).
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "suites"))
from overhead import decode_calls, interleaved, per_call, profile, tiny_calls  # noqa: E402


def median_us(fn, calls: int, rounds: int = 5) -> float:
    return statistics.median(per_call(fn, calls)["wall_us"] for _ in range(rounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300, help="calls per timed or profiled loop")
    n = ap.parse_args().calls
    calls = tiny_calls(causal=False)
    ours, cudnn = calls["flashkit"][1], calls["cudnn"][1]
    for device_thread in (True, False):
        torch.autograd.set_multithreading_enabled(device_thread)
        print("device thread", device_thread,
              interleaved({"flashkit": ours, "cudnn": cudnn}, n, 5), flush=True)
    torch.autograd.set_multithreading_enabled(False)  # cProfile sees the calling thread only
    print("=== flashkit step, calling thread\n", profile(ours, n, top=35), flush=True)
    print("=== cudnn step, calling thread\n", profile(cudnn, n), flush=True)
    q = torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16)
    print({"empty_like x4": median_us(lambda: [torch.empty_like(q) for _ in range(4)], n),
           "empty (lse shape) f32": median_us(lambda: torch.empty(1, 8, 128, device="cuda"), n),
           "torch.zeros small": median_us(lambda: torch.zeros(8, device="cuda"), n)}, flush=True)
    for cached in (1024, 16384):
        step = decode_calls(cached)
        print("decode", cached, interleaved({"flashkit": step["flashkit"],
                                             "cudnn": step["cudnn"]}, n, 5), flush=True)
        print(profile(step["flashkit"], n, top=30), flush=True)


if __name__ == "__main__":
    main()
