"""The experiment subcommands of `flashkit`: demo, memory (and the rest as they land).

Every subcommand runs at small sizes on the CPU by default and at real sizes with --device cuda;
sizes left unset get the default for the device. Results go under --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from flashkit.experiments import memory
from flashkit.experiments.attention_methods import DTYPES, METHODS


def register(subparsers) -> None:
    """Add the experiment subcommands to the `flashkit` parser's subparsers."""
    _add_demo(subparsers)
    _add_memory(subparsers)


def seqlens_arg(text: str) -> list[int]:
    """'1k,4k,128k' or '1024,4096' -> [1024, 4096, ...]."""
    values = []
    for item in text.split(","):
        item = item.strip().lower()
        scale = 1024 if item.endswith("k") else 1
        values.append(int(item.rstrip("k")) * scale)
    return values


def _device(args) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch here")
    return args.device


def _common(parser: argparse.ArgumentParser, out: str) -> None:
    parser.add_argument("--device", default="auto",
                        help="cpu, cuda or cuda:N; auto (default) takes cuda when there is one")
    parser.add_argument("--out", type=Path, default=Path(out),
                        help=f"folder for the results (default: {out})")


def _add_demo(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="run every experiment at quick sizes and write a report folder",
        description="Run the experiments at quick sizes and gather them into one report "
                    "(Markdown + PNG): every backend checked against the float64 oracle, then "
                    "naive vs tiled peak memory. On a two-core CPU it takes about two minutes.")
    _common(parser, "flashkit-report")
    parser.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from flashkit.experiments import demo
    demo.run(_device(args), args.out)
    return 0


def _add_memory(subparsers) -> None:
    parser = subparsers.add_parser(
        "memory", help="peak memory of naive vs tiled vs Triton vs SDPA attention",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=memory.__doc__)
    _common(parser, "flashkit-results")
    parser.add_argument("--seqlens", type=seqlens_arg,
                        help="comma-separated lengths, k = 1024 (default: 512,1k,2k,4k on the "
                             "CPU; 1k,2k,...,256k on the GPU)")
    parser.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all; "
                             "triton is skipped with a note without CUDA)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--nheads", type=int, help="default: 4 on the CPU, 16 on the GPU")
    parser.add_argument("--headdim", type=int, help="default: 64 on the CPU, 128 on the GPU")
    parser.add_argument("--dtype", choices=list(DTYPES),
                        help="default: float32 on the CPU, bfloat16 on the GPU")
    parser.add_argument("--causal", action="store_true", help="causal attention")
    parser.add_argument("--max-gib", type=float,
                        help="CPU only: skip naive points whose score matrices would need more "
                             "than this (default: half the available memory)")
    parser.add_argument("--max-seconds", type=float, default=60.0,
                        help="skip a method's longer lengths once one point took longer than "
                             "this (default: 60)")
    parser.set_defaults(func=_run_memory)


def _run_memory(args) -> int:
    device = _device(args)
    gpu = device.startswith("cuda")
    problem = memory.Problem(
        batch=args.batch, nheads=args.nheads or (16 if gpu else 4),
        headdim=args.headdim or (128 if gpu else 64),
        dtype=args.dtype or ("bfloat16" if gpu else "float32"), causal=args.causal,
        device=device)
    seqlens = args.seqlens or ([1024 * 2**i for i in range(9)] if gpu
                               else [512, 1024, 2048, 4096])
    max_gib = None if gpu else (args.max_gib or memory.default_max_gib())
    memory.run(problem, seqlens, args.methods, args.out, max_gib, args.max_seconds)
    return 0

