"""Step wall time with autograd's device thread (the default) against the backward on the calling
thread (torch.autograd.set_multithreading_enabled(False)): flashkit, SDPA cuDNN and an
autograd.Function that does nothing, in interleaved loops. Needs a GPU:

    PYTHONPATH=src python3 benchmarks/diagnostics/step_threads.py [--steps 1000]

The problem is the host-overhead suite's tiny one (b1, s128, h8, d64, bf16), where the kernels
take microseconds and a step's time is its host work.
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "suites"))
from overhead import B, D, H, S, per_call, tiny_calls  # noqa: E402


class _Empty(torch.autograd.Function):
    """The floor of any autograd.Function: a forward and a backward that do no work."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad, grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000, help="steps per timed loop")
    args = ap.parse_args()
    calls = tiny_calls(causal=False)  # the overhead suite's (forward, step) of each library
    leaves = [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for _ in range(3)]
    dout = torch.randn_like(leaves[0])
    steps = {"flashkit": calls["flashkit"][1], "cudnn": calls["cudnn"][1],
             "empty Function": lambda: torch.autograd.grad(_Empty.apply(*leaves), leaves, dout)}
    times = {}
    for _ in range(5):
        for device_thread in (True, False):
            torch.autograd.set_multithreading_enabled(device_thread)
            for name, step in steps.items():
                for _ in range(30):  # warm-up
                    step()
                times.setdefault((name, device_thread), []).append(
                    per_call(step, args.steps)["wall_us"])
    torch.autograd.set_multithreading_enabled(True)
    for (name, device_thread), us in times.items():
        print(f"{name:16s} device thread={device_thread!s:5s} median "
              f"{statistics.median(us):7.1f} us  (all {[round(x) for x in us]})")


if __name__ == "__main__":
    main()
