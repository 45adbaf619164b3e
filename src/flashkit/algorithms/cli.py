"""`flashkit learn <topic>`: print a worked example of an algorithm behind FlashAttention."""

from __future__ import annotations

import argparse

from flashkit.algorithms import lessons
from flashkit.sim import backward

TOPICS = {
    "softmax": lessons.softmax,
    "merge": lessons.merge_states,
    "loop-orders": lessons.loop_orders,
    "welford": lessons.welford_variance,
    "backward": backward.lesson,
}


def register(subparsers) -> None:
    """Add the `learn` subcommand to the `flashkit` parser's subparsers."""
    parser = subparsers.add_parser(
        "learn", help="print worked examples of the algorithms behind FlashAttention",
        description="Print a worked example of an algorithm behind FlashAttention.\n\n" + "\n".join(
            f"  {name:<12} {lesson.__doc__.splitlines()[0]}" for name, lesson in TOPICS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("topic", choices=[*TOPICS, "all"], help="which example to print")
    parser.set_defaults(func=_learn)


def _learn(args: argparse.Namespace) -> int:
    names = list(TOPICS) if args.topic == "all" else [args.topic]
    for n, name in enumerate(names):
        if n:
            print("\n" + "-" * 100 + "\n")
        TOPICS[name]()
    return 0
