"""Where a training step's time goes, per kernel and per host op (torch.profiler over 20 steps),
with wall and main-thread CPU time per step: the overhead suite's tiny problem (b1, s128, h8,
d64, bf16; flashkit against SDPA cuDNN, full and causal), and the variants suite's examples
(forward without and with grad, the retained-graph backward and the step, device time per
kernel and do_bench wall). Needs a GPU:

    PYTHONPATH=src python3 benchmarks/diagnostics/step_kernels.py [--examples alibi,softcap]
"""

import argparse
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

SUITES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "suites")
sys.path.insert(0, SUITES)
import overhead  # noqa: E402

import flashkit  # noqa: E402
import variants as variants_suite  # noqa: E402

STEPS = 20


def profiled(fn, activities):
    """key_averages of STEPS calls of fn after a warm-up."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(STEPS):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages()


def device_rows(events) -> list:
    """(us per step, calls per step, name) of every device event, longest first."""
    rows = [(e.self_device_time_total / STEPS, e.count / STEPS, e.key) for e in events
            if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    return sorted(rows, reverse=True)


def tiny_step() -> None:
    for causal in (False, True):
        calls = overhead.tiny_calls(causal)
        for name in ("flashkit", "cudnn"):
            events = profiled(calls[name][1], [ProfilerActivity.CPU, ProfilerActivity.CUDA])
            print(f"== tiny step, causal={causal}, {name}: device events per step")
            for us, count, key in device_rows(events):
                print(f"   {count:4.1f}x {key[:90]}  {us:.1f} us")
            host = sorted((e for e in events if e.device_type.name == "CPU"),
                          key=lambda e: -e.self_cpu_time_total)[:12]
            print("  top host ops per step (self us):")
            for e in host:
                print(f"   {e.count / STEPS:4.1f}x {e.key[:70]}  "
                      f"{e.self_cpu_time_total / STEPS:.1f}")
        samples = {name: [overhead.per_call(calls[name][1], 300) for _ in range(7)]
                   for name in ("flashkit", "cudnn")}
        for name, runs in samples.items():
            wall = statistics.median(r["wall_us"] for r in runs)
            cpu = statistics.median(r["cpu_us"] for r in runs)
            print(f"tiny step, causal={causal}, {name}: wall {wall:.0f} us, main-thread CPU "
                  f"{cpu:.0f} us per step (medians of 7 loops of 300)")


def example_parts(p: dict, name: str) -> dict:
    """The timed parts of example `name` on the variants suite's problem p."""
    q, k, v, dout = p["q"], p["k"], p["v"], p["dout"]
    mods = variants_suite.ours_mods(name, p)

    def run(*t):
        return flashkit.flash_attn_func(*t, **mods)

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = run(*leaves)

    def forward_no_grad():
        with torch.no_grad():
            run(q, k, v)

    return {"forward, no grad": forward_no_grad,
            "forward with grad": lambda: run(*leaves),
            "backward (retained graph)": lambda: torch.autograd.grad(out, leaves, dout,
                                                                     retain_graph=True),
            "step": lambda: torch.autograd.grad(run(*leaves), leaves, dout)}


def example_steps(names: list) -> None:
    p = variants_suite.problem(4096)
    for name in names:
        print(f"== example {name} (bf16, 4 x 4096 tokens, 16 heads, d128)")
        for what, fn in example_parts(p, name).items():
            rows = device_rows(profiled(fn, [ProfilerActivity.CUDA]))
            kernels = ", ".join(f"{key[:40]} {us / 1e3:.3f} ms" for us, _, key in rows[:4])
            wall = variants_suite.bench(fn)
            print(f"  {what}: device {sum(r[0] for r in rows) / 1e3:.3f} ms ({kernels}); "
                  f"do_bench {wall:.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", default="alibi,softcap,prefix_lm,document",
                    help="comma-separated variants-suite examples")
    args = ap.parse_args()
    tiny_step()
    example_steps(args.examples.split(","))


if __name__ == "__main__":
    main()
