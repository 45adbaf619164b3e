"""What the step, overhead and memory suites share: the benchmark helpers of bench_triton.py
(do_bench medians, environment, FLOP counts, grid inputs, compiled FlexAttention), the SDPA
anchors as callables, and writing results as JSON plus a markdown table."""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_triton import anchor_flex_compiled, bench, environment, flops, inputs  # noqa: E402

__all__ = ["anchor_flex_compiled", "bench", "environment", "flops", "inputs", "SDPA_ANCHORS",
           "sdpa_call", "flex_call", "write_results", "out_dir"]

SDPA_ANCHORS = ("cudnn", "flash", "efficient")  # SDPA backends, as bench_triton's anchors


def sdpa_call(name: str, causal: bool, enable_gqa: bool = False):
    """f(q, k, v) -> out: PyTorch SDPA forced to one backend, (b, h, s, d) layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]

    def run(q, k, v):
        with sdpa_kernel(backend):
            return sdpa(q, k, v, is_causal=causal, enable_gqa=enable_gqa)

    return run


def flex_call(seqlen: int, causal: bool):
    """f(q, k, v) -> out: FlexAttention compiled (once per shape), (b, h, s, d) layout."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = anchor_flex_compiled(flex_attention)
    mask = (create_block_mask(lambda b, h, i, j: j <= i, None, None, seqlen, seqlen)
            if causal else None)
    return lambda q, k, v: flex(q, k, v, block_mask=mask)


def out_dir(arg: str | None) -> str:
    """--out, else $OUT, else benchmarks/results/<suite>/ is the caller's default."""
    path = arg or os.environ.get("OUT")
    if not path:
        raise SystemExit("pass --out DIR or set OUT")
    os.makedirs(path, exist_ok=True)
    return path


def write_results(path: str, suite: str, config: dict, rows: list[dict], columns: list[str],
                  notes: str = "") -> str:
    """DIR/<suite>_<time>.json (environment, config, rows) and a markdown table beside it;
    returns the JSON path."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    base = os.path.join(path, f"{suite}_{stamp}")
    with open(base + ".json", "w") as f:
        json.dump({"suite": suite, "environment": environment(), "config": config,
                   "notes": notes, "rows": rows}, f, indent=1, default=str)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    with open(base + ".md", "w") as f:
        f.write(f"# {suite}\n\n{notes}\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return base + ".json"


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def synchronize() -> None:
    torch.cuda.synchronize()
