"""`flashkit bench`: attention throughput (TFLOP/s) of flashkit and the anchors, in one run.

The method of docs/design.md section 6: FLOPs are 4 * batch * nheads * seqlen^2 * headdim for the
forward (half of it when causal), 2.5 times that for the backward; times are medians after
warm-up on CUDA (triton.testing.do_bench), and on the CPU the fastest call of two rounds in which
the methods take turns (see TIMING). batch = tokens / seqlen and nheads = head_budget /
headdim keep the work per point comparable across the grid.

    GPU: flashkit's Triton kernels vs PyTorch SDPA with the FLASH_ATTENTION (FA2), CUDNN and
         EFFICIENT backends and FlexAttention (compiled); each reported as a ratio to cuDNN.
    CPU: flashkit's tiled PyTorch backend vs torch's CPU SDPA kernel, at a small grid.

    flashkit bench                          # CPU: seqlen 256..1k, a minute
    flashkit bench --device cuda            # GPU: bf16, d 64/128, seqlen 1k/4k/16k
    flashkit bench --device cuda --full     # GPU: the whole grid of docs/design.md section 6
    flashkit bench --device cuda --methods flashkit,sdpa-cudnn --headdims 128 --directions fwd
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import flashkit
from flashkit.experiments import plotting, results
from flashkit.experiments.attention_methods import DTYPES
from flashkit.experiments.progress import track

GPU_METHODS = ("flashkit", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")
CPU_METHODS = ("flashkit", "sdpa")


@dataclass(frozen=True)
class Grid:
    dtypes: list[str]
    headdims: list[int]
    seqlens: list[int]
    causal: list[bool]
    directions: list[str]  # "fwd", "bwd"
    tokens: int  # batch * seqlen
    head_budget: int  # nheads * headdim


def gpu_grid(full: bool) -> Grid:
    """docs/design.md section 6's grid (full) or its quick subset (bf16, d 64/128, 1k/4k/16k)."""
    if full:
        return Grid(["bfloat16", "float16"], [64, 128, 256], [512 * 2**i for i in range(6)],
                    [False, True], ["fwd", "bwd"], 16384, 2048)
    return Grid(["bfloat16"], [64, 128], [1024, 4096, 16384], [False, True], ["fwd", "bwd"],
                16384, 2048)


def cpu_grid() -> Grid:
    return Grid(["float32"], [64], [256, 512, 1024], [False, True], ["fwd", "bwd"], 2048, 256)


@dataclass
class Result:
    method: str
    dtype: str
    headdim: int
    seqlen: int
    causal: bool
    direction: str
    batch: int
    nheads: int
    ms: float | None = None
    tflops: float | None = None
    ratio: float | None = None  # tflops / the reference method's (cuDNN on GPU, SDPA on CPU)
    error: str = ""


def flops(batch: int, nheads: int, seqlen: int, headdim: int, causal: bool,
          direction: str) -> float:
    forward = 4 * batch * nheads * seqlen * seqlen * headdim / (2 if causal else 1)
    return forward * (2.5 if direction == "bwd" else 1.0)


# How time_ms measures, by "is this a CUDA device" (the reports quote it).
TIMING = {True: "median of repeated calls after warm-up (triton.testing.do_bench)",
          False: "fastest of 3 to 20 calls after a warm-up call, in two rounds with the methods "
                 "taking turns (on a shared CPU other processes can only add time, so the "
                 "minimum of interleaved repeats is what they distort least)"}


def time_ms(fn, device: str) -> float:
    """Milliseconds per call after warm-up, as TIMING says: the median of do_bench on CUDA, the
    fastest of several wall-clock calls elsewhere."""
    if device.startswith("cuda") and importlib.util.find_spec("triton") is not None:
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm-up
    times = []
    budget = time.perf_counter() + 1.0  # at least 3 calls, at most about a second more
    while len(times) < 3 or (time.perf_counter() < budget and len(times) < 20):
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times) if device.startswith("cuda") else min(times)


def _sdpa(backend_name: str | None):
    """SDPA on (batch, nheads, seqlen, headdim), restricted to one kernel when named."""
    def call(q, k, v, causal):
        if backend_name is None:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(getattr(SDPBackend, backend_name)):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


def _flex():
    """FlexAttention compiled once per shape, with a causal block mask when asked (built once
    per shape too, outside the timed calls)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    _allow_recompiles()
    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def call(q, k, v, causal):
        mask = None
        if causal:
            key = (q.shape[2], k.shape[2], str(q.device))
            if key not in masks:
                masks[key] = create_block_mask(lambda b, h, i, j: i >= j, None, None, *key[:2],
                                               device=q.device)
            mask = masks[key]
        return compiled(q, k, v, block_mask=mask)
    return call


def _allow_recompiles():
    """Each grid point is a new static shape: let dynamo compile them all, not fall back."""
    import torch._dynamo
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)


def _flashkit(q, k, v, causal):
    return flashkit.flash_attn_func(q, k, v, causal=causal)


def method_call(method: str):
    """(call, layout): layout "bshd" is flash-attn's, "bhsd" SDPA's."""
    if method == "flashkit":
        return _flashkit, "bshd"
    if method == "flex":
        return _flex(), "bhsd"
    kernels = {"sdpa": None, "sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
               "sdpa-efficient": "EFFICIENT_ATTENTION"}
    return _sdpa(kernels[method]), "bhsd"


def measure(method: str, call, layout: str, r: Result, device: str) -> Result:
    """Fill in r's time and TFLOP/s (or its error) for one method at one grid point."""
    shape = ((r.batch, r.seqlen, r.nheads, r.headdim) if layout == "bshd"
             else (r.batch, r.nheads, r.seqlen, r.headdim))
    backward = r.direction == "bwd"
    try:
        q, k, v = (torch.randn(shape, device=device, dtype=DTYPES[r.dtype],
                               requires_grad=backward) for _ in range(3))
        if backward:
            out = call(q, k, v, r.causal)
            grad = torch.randn_like(out)
            fn = lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
        else:
            fn = lambda: call(q, k, v, r.causal)
        with torch.inference_mode(not backward):
            r.ms = time_ms(fn, device)
        r.tflops = flops(r.batch, r.nheads, r.seqlen, r.headdim, r.causal, r.direction) / (
            r.ms * 1e-3) / 1e12
    except Exception as error:  # noqa: BLE001 - a kernel that cannot run this point is a result
        r.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        r.error = r.error[:200]
    finally:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return r


CPU_ROUNDS = 2  # on the CPU the methods take turns at each point, each keeping its best round


def run_grid(grid: Grid, methods: list[str], device: str) -> list[Result]:
    """Every method at every grid point; on the CPU in CPU_ROUNDS rounds per point, the methods'
    order reversed from round to round, each keeping its fastest (see TIMING)."""
    points = [(dtype, d, n, causal, direction) for dtype in grid.dtypes for d in grid.headdims
              for n in grid.seqlens for causal in grid.causal for direction in grid.directions]
    rounds = 1 if device.startswith("cuda") else CPU_ROUNDS
    todo = [(m, p) for p in points for turn in range(rounds)
            for m in (methods if turn % 2 == 0 else methods[::-1])]
    calls = {}
    best = {}  # (method, point) -> its fastest Result (insertion order: point, then method)
    for method, point in track(
            todo, "bench", lambda mp: f"{mp[0]} {mp[1][0]} d{mp[1][1]} n{mp[1][2]}"
            f"{' causal' if mp[1][3] else ''} {mp[1][4]}"):
        if method not in calls:
            calls[method] = method_call(method)
        n, d = point[2], point[1]
        r = measure(method, *calls[method], Result(method, *point, batch=max(1, grid.tokens // n),
                                                   nheads=max(1, grid.head_budget // d)), device)
        kept = best.get((method, point))
        if kept is None or (r.ms is not None and (kept.ms is None or r.ms < kept.ms)):
            best[method, point] = r
    out = list(best.values())
    _add_ratios(out, reference_method(device))
    return out


def reference_method(device: str) -> str:
    """What every ratio is to: cuDNN on the GPU (docs/design.md section 6), torch's SDPA on
    the CPU."""
    return "sdpa-cudnn" if device.startswith("cuda") else "sdpa"


def _add_ratios(rows: list[Result], reference: str) -> None:
    key = lambda r: (r.dtype, r.headdim, r.seqlen, r.causal, r.direction)
    ref = {key(r): r.tflops for r in rows if r.method == reference and r.tflops}
    for r in rows:
        if r.tflops and key(r) in ref:
            r.ratio = r.tflops / ref[key(r)]


HEADER = ["dtype", "d", "seqlen", "causal", "dir"]


def unit(device: str) -> tuple[str, float]:
    """TFLOP/s on a GPU; GFLOP/s on the CPU, where TFLOP/s would read 0.00."""
    return ("TFLOP/s", 1.0) if device.startswith("cuda") else ("GFLOP/s", 1e3)


def table(rows: list[Result], methods: list[str], device: str) -> tuple[list[str], list[list]]:
    """One row per grid point, one throughput column per method ("x" when it could not run),
    and flashkit's ratio to the reference method when both were timed."""
    name, scale = unit(device)
    reference = reference_method(device)
    with_ratio = "flashkit" in methods and reference in methods
    cells = {}
    for r in rows:
        point = (r.dtype, r.headdim, r.seqlen, r.causal, r.direction)
        cells.setdefault(point, {})[r.method] = f"{r.tflops * scale:.3g}" if r.tflops else "x"
        if with_ratio and r.method == "flashkit":
            cells[point]["ratio"] = f"{r.ratio:.2f}" if r.ratio else "-"
    body = [[*p[:3], "yes" if p[3] else "no", p[4], *(c.get(m, "") for m in methods),
             *([c.get("ratio", "-")] if with_ratio else [])]
            for p, c in cells.items()]
    header = HEADER + [f"{m} {name}" for m in methods]
    return header + ([f"flashkit / {reference}"] if with_ratio else []), body


def plot(rows: list[Result], methods: list[str], dtype: str, device: str,
         path: Path) -> Path | None:
    """TFLOP/s against seqlen: one panel per (direction, causal), one line per method and d."""
    plt = plotting.pyplot()
    if plt is None:
        return None
    panels = sorted({(r.direction, r.causal) for r in rows if r.dtype == dtype},
                    key=lambda p: (p[0] != "fwd", p[1]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    styles = ["-", "--", ":"]
    name, scale = unit(device)
    headdims = sorted({r.headdim for r in rows})
    for ax, (direction, causal) in zip(axes[0], panels, strict=True):
        for m_index, method in enumerate(methods):
            for d_index, d in enumerate(headdims):
                mine = [r for r in rows if (r.method, r.dtype, r.headdim, r.direction, r.causal)
                        == (method, dtype, d, direction, causal) and r.tflops]
                if mine:
                    ax.plot([r.seqlen for r in mine], [r.tflops * scale for r in mine],
                            linestyle=styles[d_index % 3], marker="o", color=f"C{m_index}",
                            label=f"{method} d{d}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(name)
        ax.set_title(f"{direction}, {'causal' if causal else 'not causal'}, {dtype}, {device}",
                     fontsize=9)
        ax.grid(True, alpha=0.3)
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=7)
    return plotting.save(fig, path)


def run(grid: Grid, methods: list[str], device: str, out: Path) -> dict:
    """Time the grid, print the table, write bench.json/.csv and one PNG per dtype."""
    out = results.output_dir(out)
    rows = run_grid(grid, methods, device)
    header, body = table(rows, methods, device)
    print(f"\nattention throughput on {device} ({unit(device)[0]}, higher is better; x = could "
          "not run):")
    print(results.text_table(header, body))
    errors = sorted({f"{r.method}: {r.error}" for r in rows if r.error})
    for line in errors:
        print("  " + line)
    env = results.environment(device)
    if results.busy_cpu_note(env) and not device.startswith("cuda"):
        print(f"note: {results.busy_cpu_note(env)}")
    data = {"environment": env, "grid": asdict(grid),
            "results": [asdict(r) for r in rows]}
    files = [results.write_json(out / "bench.json", data),
             results.write_csv(out / "bench.csv", [asdict(r) for r in rows])]
    pngs = [plot(rows, methods, dtype, device, out / f"bench_{dtype}.png")
            for dtype in grid.dtypes]
    pngs = [p for p in pngs if p]
    return {**data, "markdown": results.markdown_table(header, body), "pngs": pngs,
            "errors": errors, "files": files + pngs}
