"""`flashkit memory`: peak memory of one attention forward pass against sequence length.

The memory probe of Under the Hood, chapter 8, made honest on both kinds of machine. What is
reported is the *extra* memory a forward pass needs on top of its inputs (q, k, v already
allocated):

- GPU: in this process, torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus
  what was allocated before the call. An allocation that does not fit is reported as OOM.
- CPU: each point runs in a fresh Python process (so nothing left over from an earlier point is
  reused) that reads the kernel's own account of its resident memory: the peak resident set
  (VmHWM in /proc/self/status, reset to the current size just before the call), or the growth of
  ru_maxrss where /proc is not available. Points whose materialised scores would exceed --max-gib
  are skipped with the size they would need, rather than sending the machine into swap.

Naive attention holds seqlen x seqlen scores per head, so its curve climbs 4x per doubling until
it dies; the tiled and Triton kernels hold one tile of scores at a time and grow linearly.

    flashkit memory                         # CPU: 512..4k tokens, a minute or two
    flashkit memory --device cuda           # GPU: 1k..256k tokens; naive runs out near 64k
    flashkit memory --seqlens 1k,8k --methods naive,tiled --causal
"""

from __future__ import annotations

import gc
import json
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flashkit.experiments import plotting, results
from flashkit.experiments.attention_methods import DTYPES, attend, random_qkv, unavailable
from flashkit.experiments.progress import track

GIB = 2**30
# The reference keeps about this many score-sized tensors alive at its peak (scores, the masked
# scores, their exponentials); used only to decide what --max-gib skips.
NAIVE_SCORE_COPIES = 3


@dataclass(frozen=True)
class Problem:
    """One attention forward: q, k, v of shape (batch, seqlen, nheads, headdim)."""
    batch: int
    nheads: int
    headdim: int
    dtype: str
    causal: bool
    device: str

    def naive_bytes(self, seqlen: int) -> int:
        """What the materialised score matrices of the naive method need."""
        itemsize = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        return NAIVE_SCORE_COPIES * self.batch * self.nheads * seqlen * seqlen * itemsize


@dataclass
class Point:
    """One measurement: status is "ok", "oom", "skipped" or "error"."""
    method: str
    seqlen: int
    status: str
    extra_bytes: int | None = None
    seconds: float | None = None
    note: str = ""

    def cell(self) -> str:
        if self.status == "ok":
            return format_bytes(self.extra_bytes)
        if self.status == "oom":
            return "OOM"
        return f"{self.status}: {self.note}"


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def is_out_of_memory(error: BaseException) -> bool:
    """torch.OutOfMemoryError, MemoryError, or a RuntimeError that says memory ran out."""
    if isinstance(error, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text
                                                or "can't allocate memory" in text)


def probe(problem: Problem, seqlens: list[int], methods: list[str], max_gib: float | None,
          max_seconds: float) -> list[Point]:
    """Measure every (method, seqlen). A method whose next length is predicted to take longer
    than max_seconds is skipped from there on (the tiled Python loop is slow at GPU sizes):
    attention's time grows with seqlen^2, so the prediction is the last time scaled by that."""
    points = []
    last_ok = {}  # method -> its last measured point, to predict the next one's time
    out_of_memory = {}  # method -> the first seqlen at which it ran out of memory
    todo = [(m, n) for n in seqlens for m in methods]
    for method, seqlen in track(todo, "memory", lambda mn: f"{mn[0]} seqlen={mn[1]}"):
        reason = unavailable(method, problem.device)
        if reason is None and method in out_of_memory:
            reason = f"OOM already at {out_of_memory[method]}"
        need = problem.naive_bytes(seqlen)
        if reason is None and method == "naive" and max_gib is not None and need > max_gib * GIB:
            reason = f"would need {need / GIB:.1f} GiB (> --max-gib {max_gib:g})"
        reason = reason or _too_slow(last_ok.get(method), seqlen, max_seconds)
        if reason:
            points.append(Point(method, seqlen, "skipped", note=reason))
            continue
        point = measure(problem, method, seqlen)
        if point.status == "oom":
            out_of_memory[method] = seqlen
        elif point.seconds is not None:
            last_ok[method] = point
        points.append(point)
    return points


def _too_slow(last: Point | None, seqlen: int, max_seconds: float) -> str | None:
    """Why seqlen is skipped, when last's time scaled by (seqlen / last.seqlen)^2 is too long."""
    if last is None:
        return None
    predicted = last.seconds * (seqlen / last.seqlen) ** 2
    if predicted <= max_seconds:
        return None
    return (f"~{predicted:.0f}s > --max-seconds {max_seconds:g} ({last.seqlen} took "
            f"{last.seconds:.1f}s)")


def measure(problem: Problem, method: str, seqlen: int) -> Point:
    """One point, on the GPU in this process, on the CPU in a fresh one."""
    if problem.device.startswith("cuda"):
        # Warm up at full size: one-off compilation and workspace must not count as the kernel's.
        return _measure_here(problem, method, seqlen, _CudaPeak(problem.device), seqlen)
    spec = json.dumps({"problem": asdict(problem), "method": method, "seqlen": seqlen})
    proc = subprocess.run([sys.executable, "-m", "flashkit.experiments.memory", spec],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        killed = proc.returncode < 0
        return Point(method, seqlen, "oom" if killed else "error",
                     note=f"worker killed by signal {-proc.returncode}" if killed
                     else proc.stderr.strip().splitlines()[-1] if proc.stderr else "")
    return Point(**json.loads(proc.stdout.strip().splitlines()[-1]))


def _measure_here(problem: Problem, method: str, seqlen: int, peak, warmup_seqlen: int) -> Point:
    """Warm up (first calls load code, compile kernels and may allocate one-off workspace), then
    measure one forward."""
    torch.manual_seed(0)
    q, k, v = random_qkv(problem.batch, seqlen, problem.nheads, problem.headdim,
                         DTYPES[problem.dtype], problem.device)
    out = None
    try:
        with torch.no_grad():
            n = warmup_seqlen
            attend(method, q[:, :n], k[:, :n], v[:, :n], causal=problem.causal)
            peak.release()
            peak.reset()
            start = time.perf_counter()
            out = attend(method, q, k, v, causal=problem.causal)
            peak.sync()
        return Point(method, seqlen, "ok", peak.extra(), time.perf_counter() - start)
    except Exception as error:  # noqa: BLE001 - an OOM is a result, anything else is reported
        if is_out_of_memory(error):
            return Point(method, seqlen, "oom", note=str(error).splitlines()[0][:200])
        return Point(method, seqlen, "error", note=f"{type(error).__name__}: {error}"[:200])
    finally:
        del q, k, v, out
        peak.release()


class _CudaPeak:
    """Peak of torch's CUDA caching allocator above what was allocated at reset()."""

    def __init__(self, device: str):
        self.device = torch.device(device)

    def reset(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)

    def sync(self):
        torch.cuda.synchronize(self.device)

    def extra(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) - self.base

    def release(self):
        gc.collect()
        torch.cuda.empty_cache()


class _ProcessPeak:
    """Peak resident memory of this process above its size at reset() (Linux /proc, else
    ru_maxrss growth, which can under-count when an earlier peak was higher)."""

    def reset(self):
        gc.collect()
        self.proc = _reset_peak_rss()
        self.base = _rss_bytes("VmRSS") if self.proc else _maxrss_bytes()

    def sync(self):
        pass

    def extra(self) -> int:
        peak = _rss_bytes("VmHWM") if self.proc else _maxrss_bytes()
        return max(peak - self.base, 0)

    def release(self):
        gc.collect()


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current resident size (Linux >= 4.0); False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _rss_bytes("VmHWM") > 0
    except OSError:
        return False


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _maxrss_bytes() -> int:
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def table(points: list[Point], methods: list[str]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): one row per seqlen, one column per method."""
    cells = {(p.method, p.seqlen): p.cell() for p in points}
    seqlens = sorted({p.seqlen for p in points})
    return ["seqlen", *methods], [[n, *(cells[m, n] for m in methods)] for n in seqlens]


def plot(points: list[Point], methods: list[str], problem: Problem, path: Path) -> Path | None:
    """Log-log plot of extra memory against seqlen; OOM points are red crosses on the top edge."""
    plt = plotting.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = [p for p in points if p.status == "ok"]
    top = max((p.extra_bytes for p in ok), default=GIB) / GIB * 4
    for index, method in enumerate(methods):
        mine = [p for p in ok if p.method == method]
        if mine:  # markers and dashes differ so that lines lying on each other stay visible
            ax.plot([p.seqlen for p in mine], [max(p.extra_bytes, 1) / GIB for p in mine],
                    marker="os^D"[index % 4], markersize=8 - 1.5 * (index % 4),
                    linestyle=("-", "-", "--", ":")[index % 4], label=method)
        ooms = [p.seqlen for p in points if p.method == method and p.status == "oom"]
        if ooms:
            ax.scatter(ooms, [top] * len(ooms), marker="x", color="red", s=80, zorder=5)
            ax.annotate(f"{method}: OOM", (ooms[0], top), textcoords="offset points",
                        xytext=(0, 6), ha="center", color="red")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylim(top=top * 8)  # room for the OOM labels above the crosses
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("extra memory of one forward (GiB)")
    ax.set_title(f"attention forward, batch {problem.batch}, {problem.nheads} heads x "
                 f"{problem.headdim}, {problem.dtype}{', causal' if problem.causal else ''}, "
                 f"{problem.device}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    if ok:
        ax.legend(loc="upper left")  # the curves start low on the left; OOMs are on the right
    return plotting.save(fig, path)


def default_problem(device: str, batch: int = 1, nheads: int | None = None,
                    headdim: int | None = None, dtype: str | None = None,
                    causal: bool = False) -> Problem:
    """The probe's shape, with the device's defaults for what is None: 4 heads x 64 in float32
    on the CPU; 16 heads x 128 in bfloat16 on the GPU (docs/design.md section 6's memory wall)."""
    gpu = device.startswith("cuda")
    return Problem(batch, nheads or (16 if gpu else 4), headdim or (128 if gpu else 64),
                   dtype or ("bfloat16" if gpu else "float32"), causal, device)


def default_seqlens(device: str) -> list[int]:
    """512..4k on the CPU; 1k, 2k, ..., 256k on the GPU (naive dies at 64k there)."""
    if device.startswith("cuda"):
        return [1024 * 2**i for i in range(9)]
    return [512, 1024, 2048, 4096]


def default_max_seconds(device: str) -> float:
    """60 s on the CPU; 5 s on the GPU, where the tiled Python loop would take minutes at 64k."""
    return 5.0 if device.startswith("cuda") else 60.0


def default_max_gib() -> float:
    """Half of MemAvailable (Linux /proc/meminfo), else a cautious 2 GiB."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20 / 2
    except OSError:
        pass
    return 2.0


def run(problem: Problem, seqlens: list[int], methods: list[str], out: Path,
        max_gib: float | None = None, max_seconds: float = 60.0) -> dict:
    """Probe, print the table, write memory.json/.csv/.png under out; returns the summary."""
    out = results.output_dir(out)
    points = probe(problem, seqlens, methods, max_gib, max_seconds)
    header, rows = table(points, methods)
    print(f"\nextra memory of one attention forward ({problem.device}, {problem.dtype}):")
    print(results.text_table(header, rows))
    data = {"environment": results.environment(problem.device), "problem": asdict(problem),
            "points": [asdict(p) for p in points]}
    files = [results.write_json(out / "memory.json", data),
             results.write_csv(out / "memory.csv", [asdict(p) for p in points])]
    png = plot(points, methods, problem, out / "memory.png")
    return {**data, "markdown": results.markdown_table(header, rows), "png": png,
            "files": files + ([png] if png else [])}


def _worker(spec_json: str) -> None:
    """Entry point of the fresh process that measures one CPU point; prints one JSON line."""
    spec = json.loads(spec_json)
    problem = Problem(**spec["problem"])
    point = _measure_here(problem, spec["method"], spec["seqlen"], _ProcessPeak(),
                          warmup_seqlen=min(spec["seqlen"], 64))
    print(json.dumps(asdict(point)))


if __name__ == "__main__":
    _worker(sys.argv[1])
