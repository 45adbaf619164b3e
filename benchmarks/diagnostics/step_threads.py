"""Step wall time with autograd's device thread (the default) against the backward on the calling
thread (torch.autograd.set_multithreading_enabled(False)): flashkit, SDPA cuDNN and an
autograd.Function that does nothing, in interleaved loops. Needs a GPU:

    PYTHONPATH=src python3 benchmarks/diagnostics/step_threads.py [--steps 1000]

The problem is the host-overhead suite's tiny one (b1, s128, h8, d64, bf16), where the kernels
take microseconds and a step's time is its host work.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashkit

B, S, H, D = 1, 128, 8, 64


class _Empty(torch.autograd.Function):
    """The floor of any autograd.Function: a forward and a backward that do no work."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad, grad


def per_step_us(step, steps: int = 1000) -> float:
    for _ in range(30):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000, help="steps per timed loop")
    args = ap.parse_args()
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    heads_first = [x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
    dout_heads_first = dout.transpose(1, 2).contiguous()

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(*heads_first)
        return torch.autograd.grad(out, heads_first, dout_heads_first)

    steps = {"flashkit": lambda: torch.autograd.grad(flashkit.flash_attn_func(*leaves), leaves,
                                                     dout),
             "cudnn": cudnn,
             "empty Function": lambda: torch.autograd.grad(_Empty.apply(*leaves), leaves, dout)}
    times = {}
    for _ in range(5):
        for device_thread in (True, False):
            torch.autograd.set_multithreading_enabled(device_thread)
            for name, step in steps.items():
                times.setdefault((name, device_thread), []).append(
                    per_step_us(step, args.steps))
    torch.autograd.set_multithreading_enabled(True)
    for (name, device_thread), us in times.items():
        print(f"{name:16s} device thread={device_thread!s:5s} median "
              f"{statistics.median(us):7.1f} us  (all {[round(x) for x in us]})")


if __name__ == "__main__":
    main()
