"""`flashkit demo`: every experiment gathered into one report folder.

    flashkit demo                      # CPU: quick sizes, about a minute on two idle cores
    flashkit demo --device cuda        # GPU: the same steps, GPU-sized where it stays quick
    flashkit demo --full               # each step at its subcommand's default sizes (on the
                                       # GPU: memory up to 256k tokens, 200 training steps at
                                       # 1k and 4k tokens, the quick bench grid; a few minutes)

writes flashkit-report/README.md (open it in any Markdown viewer) with the PNGs, JSON and CSV
next to it:
1. every backend against the float64 oracle, 2. measured peak memory, naive vs tiled (and Triton
and SDPA on the GPU), 3. BREAK IT, 4. naive vs flashkit GPT training from the same seed,
5. throughput against torch's own kernels. The page ends with what the demo skipped and why (a
backend this machine cannot run, a size that would not fit). A step that fails is reported as
failed in the page and the demo goes on with the next one (and exits with status 1).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

from flashkit.experiments import bench, break_it, memory, oracle_check, results, train
from flashkit.experiments.attention_methods import METHODS, unavailable
from flashkit.experiments.report import Report


@dataclass(frozen=True)
class Sizes:
    """How big each step of the demo runs."""
    check_dtypes: list[str]
    memory: memory.Problem
    memory_seqlens: list[int]
    memory_methods: list[str]
    memory_max_seconds: float
    break_it_seqlen: int
    train: list[train.TrainConfig]
    bench: bench.Grid
    bench_methods: list[str]


# The quick presets never skip a size for time (max seconds = inf): their sizes are small enough
# everywhere, and a prediction from one timing on a busy machine would skip points at random.
CPU = Sizes(
    ["float32"], memory.Problem(1, 4, 64, "float32", False, "cpu"), [512, 2048],
    ["naive", "tiled"], float("inf"), 256,
    [train.TrainConfig(steps=30, batch=8, seqlen=64, n_layer=2, n_head=4, n_embd=64, lr=3e-3,
                       device="cpu")],
    bench.Grid(["float32"], [64], [256, 512], [True], ["fwd", "bwd"], 1024, 256),
    list(bench.CPU_METHODS))

GPU = Sizes(
    ["float32", "bfloat16", "float16"], memory.Problem(1, 16, 128, "bfloat16", False, "cuda"),
    [4096, 16384, 65536], ["naive", "triton", "sdpa"], float("inf"), 512,
    [train.TrainConfig(steps=60, batch=16, seqlen=1024, n_layer=4, n_head=8, n_embd=512,
                       lr=1e-3, device="cuda")],
    bench.Grid(["bfloat16"], [128], [4096, 16384], [False, True], ["fwd", "bwd"], 16384, 2048),
    ["flashkit", "sdpa-flash", "sdpa-cudnn"])

# The smallest sizes at which every step still does its job: for tests and CI.
SMOKE = replace(
    CPU, memory_seqlens=[128, 256], break_it_seqlen=64,
    train=[replace(CPU.train[0], steps=3, batch=2, seqlen=16, n_layer=1, n_head=2, n_embd=16)],
    bench=bench.Grid(["float32"], [16], [64], [True], ["fwd"], 64, 32))


def full_sizes(device: str) -> Sizes:
    """Every step at the default sizes of its own subcommand (`flashkit memory`, `train`,
    `bench`, `break-it` on this device), except that the bench leaves out FlexAttention on the
    GPU: it compiles every shape, minutes for the grid (`flashkit bench` still includes it)."""
    gpu = device.startswith("cuda")
    return Sizes(
        ["float32", "bfloat16", "float16"] if gpu else ["float32"],
        memory.default_problem(device), memory.default_seqlens(device), list(METHODS),
        memory.default_max_seconds(device), 512, train.configs(device),
        bench.gpu_grid(full=False) if gpu else bench.cpu_grid(),
        [m for m in bench.GPU_METHODS if m != "flex"] if gpu else list(bench.CPU_METHODS))


def sizes_for(device: str, smoke: bool = False, full: bool = False) -> Sizes:
    """The preset for a device, with the device filled in."""
    if full:
        return full_sizes(device)
    preset = SMOKE if smoke else (GPU if device.startswith("cuda") else CPU)
    return replace(preset, memory=replace(preset.memory, device=device),
                   train=[replace(config, device=device) for config in preset.train])


def run(device: str, out: Path, smoke: bool = False, full: bool = False,
        steps=None) -> tuple[Path, list[str]]:
    """Run the demo's steps in order, printing as they go; returns the report's path and the
    titles of the steps that failed (each is in the report with its error)."""
    out = results.output_dir(out)
    sizes = sizes_for(device, smoke, full)
    report = Report("flashkit demo report", results.environment(device))
    path = out / "README.md"
    failed = []
    start = time.perf_counter()
    for title, step in steps or STEPS:
        print(f"\n=== {title} " + "=" * max(0, 90 - len(title)))
        try:
            step(sizes, out, report)
        except Exception as error:  # noqa: BLE001 - one broken step must not hide the others
            traceback.print_exc()
            failed.append(title)
            report.add(f"{title}: FAILED", f"```\n{type(error).__name__}: {error}\n```")
        report.write(path)  # after every step, so an interrupted demo leaves a page
    print(f"\ndemo finished in {time.perf_counter() - start:.0f}s; report: {path}"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return path, failed


def _backends(sizes: Sizes, out: Path, report: Report) -> None:
    device = sizes.memory.device
    checks = oracle_check.check_all(device, sizes.check_dtypes)
    for backend in ("reference", "torch", "triton"):
        if backend not in oracle_check.backends(device):
            report.skip(f"oracle check of the {backend} backend",
                        unavailable(backend, device) or f"not run on {device}")
    for check in checks:
        if check.error is None:
            report.skip(f"oracle check of the {check.backend} backend in {check.dtype}",
                        check.note)
    rows = [c.row() for c in checks]
    print(results.text_table(oracle_check.HEADER, rows))
    report.add("Every backend agrees with the float64 oracle",
               "Causal attention, batch 2, 203 tokens (not a multiple of any tile), 4 heads of "
               "64, random inputs. A backend passes when its max error is within twice that of "
               "naive attention computed in the same dtype, plus 1e-5 (docs/design.md section "
               "5).\n\n"
               + results.markdown_table(oracle_check.HEADER, rows))


def _memory(sizes: Sizes, out: Path, report: Report) -> None:
    problem = sizes.memory
    max_gib = None if problem.device.startswith("cuda") else memory.default_max_gib()
    summary = memory.run(problem, sizes.memory_seqlens, sizes.memory_methods, out, max_gib,
                         sizes.memory_max_seconds)
    for point in summary["points"]:
        if point["status"] == "skipped":
            report.skip(f"memory of {point['method']} at seqlen {point['seqlen']}", point["note"])
    report.add("Memory: the score matrix is the wall",
               "Extra memory of one attention forward on top of its inputs, measured (not "
               "estimated): naive attention materialises seqlen x seqlen scores per head and "
               "grows 4x per doubling until it runs out of memory; the tiled and Triton "
               "kernels (and SDPA's fused ones) keep one tile of scores and grow linearly.\n\n"
               + summary["markdown"], summary["png"])


def _break_it(sizes: Sizes, out: Path, report: Report) -> None:
    summary = break_it.run(out, logit_stds=(1.0, 4.0, 25.0), seqlen=sizes.break_it_seqlen,
                           device=sizes.memory.device)
    report.add("BREAK IT: both moves of the streaming softmax are load-bearing",
               "The chapter's tiled loop with one move removed, on scores drawn with the standard "
               "deviation shown (std 1: a fresh model; std 4 and 25: sharp, trained heads). "
               "Without the max subtraction exp(s) overflows (fp16 above s = 11.1, fp32 above "
               "88.7) and the output turns to NaN/inf; without the rescaling nothing overflows "
               "but the result is simply wrong.\n\n" + summary["markdown"]
               + "\n\nTile by tile, without the max subtraction:\n\n```\n"
               + summary["lesson"] + "\n```")


def _train(sizes: Sizes, out: Path, report: Report) -> None:
    config = sizes.train[0]
    summary = train.run(sizes.train, out)
    for c in summary["comparisons"]:
        for side in ("naive", "flashkit"):
            if c[f"oom_{side}"]:
                report.skip(f"training with {side} attention at seqlen {c['seqlen']}",
                            f"out of memory ({c[f'oom_{side}']})")
    precision = ("bfloat16 autocast, so both runs round in bfloat16"
                 if config.device.startswith("cuda") else "float32")
    report.add("Training: the same loss curve, naive or flashkit",
               f"A {config.n_layer}-layer character-level GPT ({config.n_head} heads, width "
               f"{config.n_embd}) on Shakespeare, {config.steps} steps from the same seed with "
               f"the same batches of {config.batch * config.seqlen} tokens; only the attention "
               f"differs ({precision}). The curves agree to floating-point rounding. Step times "
               f"are measured after training, the two models taking turns for "
               f"{train.TIMED_REPEATS} steps each; each side's fastest step counts (on a "
               "shared machine other processes only add time), and the speed-up is naive's "
               "fastest step over flashkit's.\n\n" + summary["markdown"],
               summary["png"])


def _bench(sizes: Sizes, out: Path, report: Report) -> None:
    device = sizes.memory.device
    summary = bench.run(sizes.bench, sizes.bench_methods, device, out)
    left_out = [m for m in bench.GPU_METHODS if m not in sizes.bench_methods]
    if left_out:
        report.skip(f"throughput of {', '.join(left_out)}",
                    "GPU kernels, not run on the CPU" if not device.startswith("cuda") else
                    "left out of the demo (FlexAttention compiles every shape); `flashkit bench "
                    "--device cuda` includes them")
    for error in summary["errors"]:
        report.skip("throughput of " + error.split(":")[0], error.split(":", 1)[1].strip())
    report.add("Throughput",
               "FLOP/s by the count of docs/design.md section 6 (4 b h n^2 d forward, halved "
               f"when causal; backward 2.5x), {bench.TIMING[device.startswith('cuda')]}. On the "
               "CPU flashkit runs its tiled PyTorch loop, which is about memory, not speed; on "
               "the GPU its Triton kernels. `flashkit bench --device cuda --full` runs the "
               "whole grid with FlexAttention too.\n\n" + summary["markdown"],
               summary["pngs"][0] if summary["pngs"] else None)


STEPS = [("1. every backend against the float64 oracle", _backends),
         ("2. peak memory: naive (materialised) vs tiled attention", _memory),
         ("3. BREAK IT: remove the running max, or the rescaling", _break_it),
         ("4. a small GPT trained with naive and with flashkit attention, same seed", _train),
         ("5. throughput against torch's own attention kernels", _bench)]
