"""`flashkit bench --compare naive,tiled,triton`: where, if anywhere, one method overtakes another.

Under the Hood, chapter 8, Step 7 times its materialised attention against its pure-PyTorch tiled
loop (forward only) and says: at 1k naive often wins, at 2k they are comparable, from 4k tiled
wins (or naive does not run at all). This answers that question by measurement:

    naive    the chapter's materialised attention in the input dtype: softmax(q k^T / sqrt(d)) v,
             two (batch, nheads, seqlen, seqlen) tensors alive at once
    tiled    flashkit's pure-PyTorch tiled backend (backend="torch"): a Python loop over
             128 x 128 tiles of scores
    triton   flashkit's Triton kernels (backend="triton"): CUDA only. On the CPU they would run
             in Triton's interpreter, which executes every program in NumPy and is thousands of
             times slower than the compiled kernel: its times would say nothing about the
             kernel, so triton is skipped there with a note.

Forward only, non-causal, as the chapter times it; the chapter's problem (batch 2, 8 heads, head
dim 64, fp16) on the GPU, a smaller one on the CPU. A method that runs out of memory is slower
than any that runs. Crossovers are read off the measured sizes: "tiled overtakes naive between
2k and 4k" means naive was faster at 2k and tiled at 4k and every size after.

Timing that survives a loaded machine: the methods are timed in interleaved rounds (each round
times every method once at this size), each time is the mean of enough calls to fill about
--min-ms, and a method's time is the minimum over the rounds (noise only ever adds time).
A method whose next size is predicted (time grows as seqlen^2) to take longer than
--max-seconds per call is skipped from there on.

    flashkit bench --compare naive,tiled                 # CPU: 256..2k, under a minute
    flashkit bench --compare naive,tiled,triton --device cuda --seqlens 1k,2k,4k,8k,16k,32k
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import flashkit
from flashkit.experiments import plotting, results
from flashkit.experiments.attention_methods import DTYPES, unavailable
from flashkit.experiments.memory import is_out_of_memory

METHODS = ("naive", "tiled", "triton")


@dataclass(frozen=True)
class Problem:
    device: str
    dtype: str
    batch: int
    nheads: int
    headdim: int
    seqlens: tuple[int, ...]
    rounds: int = 5
    min_ms: float = 50.0  # each timed sample is the mean of enough calls to last this long
    max_seconds: float = 10.0


def default_problem(device: str, seqlens=None, rounds: int | None = None) -> Problem:
    """The chapter's problem on the GPU (b2, h8, d64, fp16, 1k..32k); float32 b1 h4 d64 at
    256..2k on the CPU."""
    if device.startswith("cuda"):
        return Problem(device, "float16", 2, 8, 64, tuple(seqlens or (1024 * 2**i for i in
                                                                         range(6))),
                       rounds or 3, 20.0, 10.0)
    return Problem(device, "float32", 1, 4, 64, tuple(seqlens or (256, 512, 1024, 2048)),
                   rounds or 3, 20.0, 10.0)


def score_tensor_note(problem: Problem, seqlen: int = 4096) -> str:
    """How big one of naive's (batch, nheads, seqlen, seqlen) tensors is; the chapter says 1 GB
    for batch 2, 8 heads, 4096 tokens in fp16, which is 0.54 GB (0.5 GiB)."""
    size = problem.batch * problem.nheads * seqlen * seqlen * DTYPES[problem.dtype].itemsize
    chapter = 2 * 8 * 4096 * 4096 * 2
    return (f"naive keeps two ({problem.batch}, {problem.nheads}, N, N) {problem.dtype} tensors "
            f"alive: {size / 1e9:.2f} GB each at N = {seqlen}. (Under the Hood, chapter 8, "
            f"Step 1 says 1 GB per tensor for (2, 8, 4096) in fp16: it is {chapter / 1e9:.2f} GB, "
            f"{chapter / 2**30:.2f} GiB.)")


def naive_attention(q, k, v):
    """The chapter's Step 1 attention on (batch, nheads, seqlen, d), in the input dtype."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, H, N, N)
    return torch.softmax(scores, dim=-1) @ v  # (B, H, N, N) @ (B, H, N, D)


def call(method: str, q, k, v):
    """One forward of `method` on q, k, v in (batch, nheads, seqlen, d)."""
    if method == "naive":
        return naive_attention(q, k, v)
    backend = {"tiled": "torch", "triton": "triton"}[method]
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))  # flash-attn layout: views, no copy
    return flashkit.flash_attn_func(qs, ks, vs, backend=backend).transpose(1, 2)


@dataclass
class Point:
    method: str
    seqlen: int
    ms: float | None = None  # min over rounds of the mean ms per call
    samples: list[float] = field(default_factory=list)
    note: str = ""  # OOM, skipped, unavailable


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _sample_ms(fn, calls: int, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / calls


def measure_size(problem: Problem, seqlen: int, methods, skip: dict[str, str]) -> list[Point]:
    """Every method at one size, timed in interleaved rounds; min over rounds."""
    shape = (problem.batch, problem.nheads, seqlen, problem.headdim)
    gen = torch.Generator(device=problem.device).manual_seed(seqlen)
    q, k, v = (torch.randn(shape, generator=gen, device=problem.device,
                           dtype=DTYPES[problem.dtype]) for _ in range(3))
    points = {m: Point(m, seqlen, note=skip.get(m, "")) for m in methods}
    calls = {}
    with torch.inference_mode():
        for m, p in points.items():  # warm-up (compiles the kernels) and calls per sample
            if p.note:
                continue
            try:
                once = _sample_ms(lambda m=m: call(m, q, k, v), 1, problem.device)
            except Exception as error:  # noqa: BLE001 - only running out of memory is a result
                if not is_out_of_memory(error):
                    raise
                p.note = "out of memory"
                _free(problem.device)
                continue
            calls[m] = max(1, int(problem.min_ms / max(once, 1e-3)))
        for _ in range(problem.rounds):
            for m, n_calls in calls.items():
                points[m].samples.append(
                    _sample_ms(lambda m=m: call(m, q, k, v), n_calls, problem.device))
    for p in points.values():
        if p.samples:
            p.ms = min(p.samples)
    return list(points.values())


def _free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def measure(problem: Problem, methods) -> list[Point]:
    skip = {m: f"skipped: {why}" for m in methods if (why := unavailable(m, problem.device))}
    if "triton" in methods and not problem.device.startswith("cuda"):
        skip["triton"] = ("skipped: on the CPU Triton only interprets its kernels (NumPy, "
                          "thousands of times slower than compiled), which times nothing real")
    last: dict[str, Point] = {}
    points = []
    for seqlen in problem.seqlens:
        for m in methods:
            prev = last.get(m)
            if m not in skip and prev is not None and prev.ms is not None:
                predicted = prev.ms / 1e3 * (seqlen / prev.seqlen) ** 2
                if predicted > problem.max_seconds:
                    skip[m] = (f"skipped from {seqlen}: ~{predicted:.0f} s per call predicted "
                               f"> --max-seconds {problem.max_seconds:g}")
        now = measure_size(problem, seqlen, methods, skip)
        _free(problem.device)  # this size's inputs are gone: give their memory back
        for p in now:
            if p.ms is not None:
                last[p.method] = p
        points += now
        print(f"  seqlen {seqlen:>6}: " + ", ".join(
            f"{p.method} {p.ms:.3g} ms" if p.ms is not None else
            f"{p.method} {'OOM' if p.note == 'out of memory' else '-'}" for p in now), flush=True)
    return points


def _rank(p: Point) -> float:
    """Time for comparison: out of memory is slower than anything that ran."""
    if p.ms is not None:
        return p.ms
    return float("inf") if p.note == "out of memory" else float("nan")


def crossovers(points: list[Point], methods) -> list[str]:
    """For every pair of methods: who is faster where, and between which sizes it changes."""
    by = {(p.method, p.seqlen): p for p in points}
    seqlens = sorted({p.seqlen for p in points})
    lines = []
    for i, a in enumerate(methods):
        for b in methods[i + 1:]:
            both = [(n, _rank(by[a, n]), _rank(by[b, n])) for n in seqlens]
            both = [(n, ta, tb) for n, ta, tb in both
                    if ta == ta and tb == tb and not (ta == tb == float("inf"))]  # drop NaN
            if not both:
                lines.append(f"{a} vs {b}: not both measured at any size")
                continue
            winners = [(n, a if ta < tb else b) for n, ta, tb in both]
            changes = [(winners[j - 1][0], n, w) for j, (n, w) in enumerate(winners)
                       if j and w != winners[j - 1][1]]
            span = f"{_k(both[0][0])}..{_k(both[-1][0])}"
            if not changes:
                lines.append(f"{a} vs {b}: {winners[0][1]} is faster at every size measured "
                             f"({span}): no crossover")
                continue
            steps = "; ".join(f"{w} overtakes between {_k(lo)} and {_k(hi)}"
                              for lo, hi, w in changes)
            lines.append(f"{a} vs {b}: {winners[0][1]} faster at {_k(both[0][0])}; {steps}")
    return lines


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def table(points: list[Point], methods) -> tuple[list[str], list[list]]:
    by = {(p.method, p.seqlen): p for p in points}
    seqlens = sorted({p.seqlen for p in points})
    rows = []
    for n in seqlens:
        cells = []
        for m in methods:
            p = by[m, n]
            cells.append(f"{p.ms:.3g}" if p.ms is not None else
                         ("OOM" if p.note == "out of memory" else "-"))
        rows.append([n, *cells])
    return ["seqlen", *(f"{m} ms" for m in methods)], rows


def plot(points: list[Point], methods, problem: Problem, path: Path) -> Path | None:
    plt = plotting.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, m in enumerate(methods):
        mine = [p for p in points if p.method == m and p.ms is not None]
        if mine:
            ax.plot([p.seqlen for p in mine], [p.ms for p in mine], marker="o", color=f"C{i}",
                    label=m)
        for p in points:
            if p.method == m and p.note == "out of memory":
                ax.axvline(p.seqlen, color=f"C{i}", linestyle=":", alpha=0.6)
                ax.annotate(f"{m} OOM", (p.seqlen, ax.get_ylim()[1]), fontsize=7,
                            color=f"C{i}", rotation=90, va="top")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("ms per forward (min over rounds)")
    ax.set_title(f"forward, batch {problem.batch} x {problem.nheads} heads x d{problem.headdim},"
                 f" {problem.dtype}, {problem.device}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return plotting.save(fig, path)


def run(problem: Problem, methods, out: Path) -> dict:
    """Time, print the table and the crossovers, write crossover.json and crossover.png."""
    out = results.output_dir(out)
    methods = list(methods)
    print(f"forward time, batch {problem.batch} x {problem.nheads} heads x d{problem.headdim}, "
          f"{problem.dtype}, {problem.device}; min over {problem.rounds} interleaved rounds:")
    print(score_tensor_note(problem))
    points = measure(problem, methods)
    header, rows = table(points, methods)
    print("\n" + results.text_table(header, rows))
    notes = sorted({f"{p.method}: {p.note}" for p in points if p.note
                    and p.note != "out of memory"})
    for line in notes:
        print("  " + line)
    found = crossovers(points, methods)
    print("\nwhere the lines cross (the chapter: naive wins at 1k, even at 2k, tiled from 4k):")
    for line in found:
        print("  " + line)
    data = {"environment": results.environment(problem.device), "problem": asdict(problem),
            "points": [asdict(p) for p in points], "crossovers": found}
    files = [results.write_json(out / "crossover.json", data)]
    png = plot(points, methods, problem, out / "crossover.png")
    return {**data, "files": files + ([png] if png else []),
            "markdown": results.markdown_table(header, rows)}
