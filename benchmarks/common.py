"""Helpers every benchmark suite shares (the method of docs/design.md section 6).

- `bench(fn)`: milliseconds, the median of triton.testing.do_bench after warm-up.
- `idle_start_ms(fn)`: milliseconds, the median of single calls timed with CUDA events from an
  idle GPU (host time counts where it exceeds the GPU's).
- `environment()`: date, device, versions; stored at the top of every result file.
- `flops(...)`: forward 4 b h sq sk d over visible pairs (causal halves it), backward 2.5x,
  step (forward with grad + backward) 3.5x.
- `inputs(seqlen, head_dim, dtype)`: the standard grid's q, k, v, dout (batch = 16k tokens /
  seqlen, nheads = 2048 / head_dim), (batch, seqlen, nheads, head_dim).
- Anchors measured in the same run: `sdpa(name)` for PyTorch SDPA's FLASH_ATTENTION (FA2), CUDNN
  and EFFICIENT backends, `anchor_flex_compiled` for FlexAttention under torch.compile, and
  `anchor(name, q, k, v, dout, causal)` for their (forward ms, backward ms).
- `Result(suite, out)`: writes DIR/<date>_<device>.json (and .md), rewritten as a run goes on
  so a run cut short keeps its numbers.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import time
from pathlib import Path

import torch

TOKENS, WIDTH = 16384, 2048  # the standard grid: batch * seqlen and nheads * head_dim
RESULTS = Path(__file__).resolve().parent / "results"
ANCHORS = ("cudnn", "flash", "efficient", "flex")


def bench(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of fn() over `rep` ms of calls after `warmup` ms (L2 flushed)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def idle_start_ms(fn, reps: int = 15, warm: int = 4) -> float:
    """Median milliseconds of fn() over `reps` calls timed with CUDA events, after `warm`
    calls, the GPU idle at each start: where the host takes longer than the GPU, its time
    counts (a call as a user makes it, one at a time)."""
    import statistics

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def environment() -> dict:
    """Date (UTC), device and versions of this process."""
    import triton

    import flashkit

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
           "python": platform.python_version(), "flashkit": flashkit.__version__}
    if torch.cuda.is_available():
        env["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    return env


DIRECTION_FACTOR = {"fwd": 1.0, "bwd": 2.5, "step": 3.5}


def flops(batch, nheads, seqlen, head_dim, causal, direction="fwd", seqlen_k=None) -> float:
    """FLOPs of one call: 4 b h sq sk d over visible pairs, times 1 / 2.5 / 3.5 for fwd / bwd /
    step. Causal counts half the square (the standard grid's convention)."""
    seqlen_k = seqlen if seqlen_k is None else seqlen_k
    pairs = seqlen * seqlen_k * (0.5 if causal else 1.0)
    return 4 * batch * nheads * pairs * head_dim * DIRECTION_FACTOR[direction]


def tflops(flop: float, ms: float) -> float:
    return flop / (ms * 1e-3) / 1e12


def inputs(seqlen, head_dim, dtype=torch.bfloat16, tokens=TOKENS, width=WIDTH):
    """q, k, v, dout of the standard grid, (batch, seqlen, nheads, head_dim) on the GPU."""
    batch, nheads = max(1, tokens // seqlen), width // head_dim
    shape = (batch, seqlen, nheads, head_dim)
    return tuple(torch.randn(shape, dtype=dtype, device="cuda") for _ in range(4))


def sdpa(name: str):
    """fn(q, k, v, causal=False, **kw) running PyTorch SDPA with one backend, on (b, h, s, d)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]

    def run(q, k, v, causal=False, **kw):
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)

    return run


_FLEX = {}


def anchor_flex_compiled(flex_attention=None):
    """flex_attention compiled once; the grid's shapes exceed dynamo's default recompile limit
    of 8, past which it would silently run the unfused fallback, so the limits are raised."""
    if "fn" not in _FLEX:
        if flex_attention is None:
            from torch.nn.attention.flex_attention import flex_attention
        for name, limit in (("cache_size_limit", 256), ("recompile_limit", 256),
                            ("accumulated_recompile_limit", 4096)):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, limit)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def anchor_call(name: str, causal: bool):
    """fn(q, k, v) of one anchor on (b, h, s, d) tensors: an SDPA backend or FlexAttention."""
    if name != "flex":
        run = sdpa(name)
        return lambda q, k, v: run(q, k, v, causal)
    from torch.nn.attention.flex_attention import create_block_mask

    flex, masks = anchor_flex_compiled(), {}

    def run_flex(q, k, v):
        if causal and q.shape[2] not in masks:
            masks[q.shape[2]] = create_block_mask(lambda b, h, i, j: j <= i, None, None,
                                                  q.shape[2], k.shape[2])
        return flex(q, k, v, block_mask=masks.get(q.shape[2]))

    return run_flex


def anchor(name, q, k, v, dout, causal) -> tuple[float, float]:
    """(forward ms, backward ms) of one anchor on (b, h, s, d) copies of (b, s, h, d) inputs;
    the backward is autograd.grad on a retained graph."""
    run = anchor_call(name, causal)
    qh, kh, vh, douth = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
    with torch.no_grad():
        t_fwd = bench(lambda: run(qh, kh, vh))
    leaves = [x.requires_grad_() for x in (qh, kh, vh)]
    out = run(*leaves)
    t_bwd = bench(lambda: torch.autograd.grad(out, leaves, douth, retain_graph=True))
    return t_fwd, t_bwd


def graphed(fn, warmups: int = 3):
    """fn captured in a CUDA graph, warmed up on a side stream first (as capture requires: lazy
    allocations and autotuning must happen outside it); returns the graph's replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def peak_memory(fn) -> int:
    """Bytes allocated at the peak of fn() above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def default_out(suite: str) -> str:
    """$OUT/<suite> when $OUT is set (the device runs), else benchmarks/results/<suite>."""
    return os.path.join(os.environ["OUT"], suite) if os.environ.get("OUT") else str(
        RESULTS / suite)


def name_list(parser, option: str, value: str, known) -> list[str]:
    """The comma-separated names given to `option`, each one of `known`; an unknown name is the
    parser's usage error."""
    names = [name for name in value.split(",") if name]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"{option}: unknown {unknown}")
    return names


def add_out_argument(parser, suite: str) -> None:
    parser.add_argument("--out", default=None,
                        help=f"result folder (default: $OUT/{suite} or benchmarks/results/{suite})")


class Result:
    """One run's result file, DIR/<YYYYmmdd_HHMM>_<device>[_tag].json, plus a markdown summary
    beside it. `save(key, value)` rewrites the JSON at once."""

    def __init__(self, suite: str, out: str | None = None, tag: str = "", config=None):
        self.dir = Path(out or default_out(suite))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data = {"suite": suite, "env": environment(), "config": config or {}}
        device = re.sub(r"[^a-z0-9]+", "", self.data["env"]["device"].lower().replace(
            "nvidia", ""))[:12] or "cpu"
        stamp = time.strftime("%Y%m%d_%H%M", time.gmtime())
        self.path = self.dir / f"{stamp}_{device}{'_' + tag if tag else ''}.json"

    def save(self, key: str, value) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def markdown(self, text: str) -> None:
        self.path.with_suffix(".md").write_text(text)


def table(rows: list[dict], columns: list[str], fmt: str = "{:.3g}") -> str:
    """A markdown table of rows' columns (numbers formatted, missing cells '-')."""
    def cell(v):
        if v is None:
            return "-"
        return fmt.format(v) if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def log(msg: str) -> None:
    print(msg, flush=True)
