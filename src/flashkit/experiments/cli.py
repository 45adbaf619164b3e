"""The experiment subcommands of `flashkit`: demo, memory, bench, break-it, train.

Every subcommand runs at small sizes on the CPU by default and at real sizes with --device cuda;
sizes left unset get the default for the device. Results go under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from flashkit.experiments import bench, break_it, crossover, demo, memory, train
from flashkit.experiments.attention_methods import DTYPES, METHODS


def register(subparsers) -> None:
    """Add the experiment subcommands to the `flashkit` parser's subparsers."""
    _add_demo(subparsers)
    _add_memory(subparsers)
    _add_bench(subparsers)
    _add_break_it(subparsers)
    _add_train(subparsers)


def positive(kind):
    """An argparse type: a number of `kind` (int or float) that is > 0 (and finite)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def ints_arg(text: str) -> list[int]:
    """'1k,4k,128k' or '1024,4096' -> [1024, 4096, ...]: positive sizes, k = 1024."""
    values = []
    for item in text.split(","):
        item = item.strip().lower()
        scale = 1024 if item.endswith("k") else 1
        try:
            value = int(item.removesuffix("k")) * scale
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated positive sizes such as 512,1k,4k, got {text!r}")
        values.append(value)
    return values


def floats_arg(text: str) -> list[float]:
    """'1,4,25' -> [1.0, 4.0, 25.0]: positive finite numbers."""
    parse = positive(float)
    return [parse(item) for item in text.split(",")]


def device_arg(text: str) -> str:
    """cpu, cuda, cuda:N or auto: the devices the experiments measure on."""
    kind, _, index = text.partition(":")
    if text in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or auto, got {text!r}")


def _lengths(values) -> str:
    """[1024, 4096] -> '1k,4k' (the form ints_arg reads)."""
    return ",".join(f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in values)


def choices_arg(allowed):
    """An argparse type: a comma-separated subset of `allowed`."""
    def parse(text: str) -> list[str]:
        picked = text.split(",")
        unknown = [p for p in picked if p not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {list(allowed)}")
        return picked
    return parse


def _device(args) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch here")
    return args.device


def _common(parser: argparse.ArgumentParser, out: str) -> None:
    parser.add_argument("--device", type=device_arg, default="auto",
                        help="cpu, cuda or cuda:N; auto (default) takes cuda when there is one")
    parser.add_argument("--out", type=Path, default=Path(out),
                        help=f"folder for the results (default: {out})")


def _add_demo(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="run every experiment and write a report folder (start here)",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=demo.__doc__)
    _common(parser, "flashkit-report")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true",
                      help="each step at its subcommand's default sizes instead of the quick "
                           "ones (on the GPU: the numbers the README quotes)")
    size.add_argument("--smoke", action="store_true",
                      help="the smallest sizes at which every step runs (for CI; the numbers "
                           "mean little)")
    parser.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    _, failed = demo.run(_device(args), args.out, smoke=args.smoke, full=args.full)
    return 1 if failed else 0


def _add_memory(subparsers) -> None:
    parser = subparsers.add_parser(
        "memory", help="peak memory of naive vs tiled vs Triton vs SDPA attention",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=memory.__doc__)
    _common(parser, "flashkit-results")
    parser.add_argument("--seqlens", type=ints_arg,
                        help="comma-separated lengths, k = 1024 (default: 512,1k,2k,4k on the "
                             "CPU; 1k,2k,...,256k on the GPU)")
    parser.add_argument("--methods", type=choices_arg(METHODS), default=list(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all; "
                             "triton is skipped with a note without CUDA)")
    parser.add_argument("--batch", type=positive(int), default=1, help="default: 1")
    parser.add_argument("--nheads", type=positive(int),
                        help="default: 4 on the CPU, 16 on the GPU")
    parser.add_argument("--headdim", type=positive(int),
                        help="default: 64 on the CPU, 128 on the GPU")
    parser.add_argument("--dtype", choices=list(DTYPES),
                        help="default: float32 on the CPU, bfloat16 on the GPU")
    parser.add_argument("--causal", action="store_true", help="causal attention")
    parser.add_argument("--max-gib", type=positive(float),
                        help="CPU only: skip naive points whose score matrices would need more "
                             "than this (default: half the available memory)")
    parser.add_argument("--max-seconds", type=positive(float),
                        help="skip a method's longer lengths once the next one is predicted "
                             "(time grows with seqlen^2) to take longer than this (default: 60 "
                             "on the CPU; 5 on the GPU, where the tiled Python loop would "
                             "otherwise take minutes at 64k tokens and up)")
    parser.set_defaults(func=_run_memory)


def _run_memory(args) -> int:
    device = _device(args)
    problem = memory.default_problem(device, args.batch, args.nheads, args.headdim, args.dtype,
                                     args.causal)
    max_gib = (None if device.startswith("cuda")
               else args.max_gib or memory.default_max_gib())
    memory.run(problem, args.seqlens or memory.default_seqlens(device), args.methods, args.out,
               max_gib, args.max_seconds or memory.default_max_seconds(device))
    return 0


def _add_bench(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="TFLOP/s of flashkit vs SDPA (FA2, cuDNN, efficient) and FlexAttention",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=bench.__doc__)
    _common(parser, "flashkit-results")
    parser.add_argument("--full", action="store_true",
                        help="GPU: the whole grid of docs/design.md section 6 (bf16 and fp16, "
                             "d 64/128/256, seqlen 512..16k); default: bf16, d 64/128, seqlen "
                             "1k/4k/16k")
    parser.add_argument("--methods", type=choices_arg(dict.fromkeys(bench.GPU_METHODS
                                                                    + bench.CPU_METHODS)),
                        help=f"comma-separated subset (GPU: {','.join(bench.GPU_METHODS)}; "
                             f"CPU: {','.join(bench.CPU_METHODS)})")
    parser.add_argument("--seqlens", type=ints_arg, help="override the grid's lengths")
    parser.add_argument("--headdims", type=ints_arg, help="override the grid's head dims")
    parser.add_argument("--directions", type=choices_arg(("fwd", "bwd")),
                        help="fwd, bwd or fwd,bwd (default: both)")
    parser.add_argument("--compare", type=choices_arg(crossover.METHODS),
                        help="instead: forward time of these methods (naive,tiled,triton) and "
                             "where one overtakes another (Under the Hood, chapter 8, Step 7); "
                             "--seqlens sets the sizes (default: 256..2k on the CPU, 1k..32k "
                             "on the GPU)")
    parser.add_argument("--jax-baselines", action="store_true",
                        help="instead: the JAX/TPU write-up's nojit, unfused, fused and flash "
                             "(fori, vmap) baselines on one causal float32 head, beside its TPU "
                             "ratios; --seqlens sets n (default: 512..4k)")
    parser.add_argument("--max-seconds", type=float, default=10.0,
                        help="--compare: skip a method's larger sizes once a call is predicted "
                             "to take longer than this (default: 10)")
    parser.set_defaults(func=_run_bench)


def _run_bench(args) -> int:
    device = _device(args)
    if args.jax_baselines:
        from flashkit.experiments import jax_baselines  # jax is imported only when asked for
        jax_baselines.run(args.seqlens or [512, 1024, 2048, 4096], args.out)
        return 0
    if args.compare:
        problem = dataclasses.replace(crossover.default_problem(device, args.seqlens),
                                      max_seconds=args.max_seconds)
        crossover.run(problem, args.compare, args.out)
        return 0
    gpu = device.startswith("cuda")
    grid = bench.gpu_grid(args.full) if gpu else bench.cpu_grid()
    overrides = {"seqlens": args.seqlens, "headdims": args.headdims,
                 "directions": args.directions}
    grid = dataclasses.replace(grid, **{k: v for k, v in overrides.items() if v})
    methods = args.methods or list(bench.GPU_METHODS if gpu else bench.CPU_METHODS)
    bench.run(grid, methods, device, args.out)
    return 0


def _add_break_it(subparsers) -> None:
    parser = subparsers.add_parser(
        "break-it", help="remove the running max or the rescaling and watch attention break",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=break_it.__doc__)
    _common(parser, "flashkit-results")
    parser.add_argument("--logit-stds", type=floats_arg,
                        default=[1.0, 4.0, 25.0],
                        help="standard deviations of the scores s = q.k/sqrt(d) to try: 1 is a "
                             "fresh model, 4 and 25 sharp trained heads (default: 1,4,25)")
    parser.add_argument("--seqlen", type=positive(int), default=512,
                        help="query and key length (default: 512)")
    parser.add_argument("--nheads", type=positive(int), default=2, help="default: 2")
    parser.add_argument("--headdim", type=positive(int), default=64, help="default: 64")
    parser.add_argument("--block", type=positive(int), default=64,
                        help="tile edge: block query rows x block keys (default: 64)")
    parser.add_argument("--train-steps", type=int,
                        help="train the GPT this many steps with each causal break (tiles of "
                             "seqlen/4; the model and sizes of `flashkit train`); 0 skips it "
                             f"(default: {train.CPU_DEFAULTS.steps} on the CPU, "
                             f"{train.GPU_DEFAULTS.steps} on the GPU)")
    parser.set_defaults(func=_run_break_it)


def _run_break_it(args) -> int:
    device = _device(args)
    config = train.configs(device, steps=args.train_steps)[0]
    break_it.run(args.out, args.logit_stds, args.seqlen, args.nheads, args.headdim, args.block,
                 device, config if config.steps > 0 else None)
    return 0


def _add_train(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="train a small GPT with naive and with flashkit attention, same seed",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=train.__doc__)
    _common(parser, "flashkit-results")
    sizes = [("--steps", int, "steps", "training steps per run"),
             ("--tokens", int, "tokens", "tokens per batch, batch = tokens / seqlen"),
             ("--layers", int, "n_layer", "transformer blocks"),
             ("--heads", int, "n_head", "attention heads"),
             ("--embd", int, "n_embd", "model width (head dim = embd / heads)"),
             ("--lr", float, "lr", "AdamW learning rate")]
    for flag, kind, field, what in sizes:
        cpu, gpu = getattr(train.CPU_DEFAULTS, field), getattr(train.GPU_DEFAULTS, field)
        parser.add_argument(flag, type=positive(kind), help=f"{what} (default: {cpu:g} on the CPU, "
                                                   f"{gpu:g} on the GPU)")
    parser.add_argument("--seqlens", type=ints_arg,
                        help="one training comparison per length, k = 1024 (default: "
                             f"{_lengths(train.CPU_DEFAULTS.seqlens)} on the CPU; "
                             f"{_lengths(train.GPU_DEFAULTS.seqlens)} on the GPU)")
    parser.add_argument("--seed", type=int, default=0,
                        help="initial weights and batch order, the same for both runs "
                             "(default: 0)")
    parser.add_argument("--backend", choices=["torch", "triton"],
                        help="flashkit's backend for the flashkit run (default: triton on CUDA, "
                             "the tiled torch backend elsewhere)")
    parser.set_defaults(func=_run_train, check=_check_train)


def train_configs(args, device: str) -> list[train.TrainConfig]:
    """One TrainConfig per seqlen, with the device's defaults for what args leave unset."""
    return train.configs(device, args.seed, args.backend, steps=args.steps,
                         seqlens=args.seqlens and tuple(args.seqlens), tokens=args.tokens,
                         n_layer=args.layers, n_head=args.heads, n_embd=args.embd, lr=args.lr)


def _check_train(args) -> str | None:
    """What is wrong with a train command line that each argument alone cannot tell."""
    if args.heads and args.embd and args.embd % args.heads:
        return f"--embd {args.embd} must be a multiple of --heads {args.heads}"
    return None


def _run_train(args) -> int:
    train.run(train_configs(args, _device(args)), args.out)
    return 0
