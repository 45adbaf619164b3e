"""The `flashkit` command: each area of the package adds its own subcommands here."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules with a register(subparsers) function, in the order `flashkit --help` lists them.
COMMAND_MODULES = [
    "flashkit.experiments.cli",  # demo, memory, bench, break-it, train
    "flashkit.algorithms.cli",  # learn: the algorithms behind FlashAttention
    "flashkit.sim.cli",  # simulate: register machine, systolic array, TPU, HBM IO
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashkit",
        description="Exact, memory-efficient attention (FlashAttention): run the experiments, "
                    "learn the algorithm, simulate the machines it was designed for.")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    problem = args.check(args) if hasattr(args, "check") else None
    if problem:
        parser.error(problem)  # exit status 2, as for any bad argument
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
