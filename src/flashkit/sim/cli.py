"""``flashkit simulate ...``: run the machines FlashAttention was designed for, print their tables.

``flashkit/cli.py`` calls :func:`register`; each machine is one sub-subcommand whose
handler prints its tables and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib.util

import numpy as np

from flashkit.sim.hbm import (
    flash_attention_io,
    flash_block_sizes,
    format_io_sweep,
    format_sram_sweep,
    format_triton_configs,
    standard_attention_io,
)
from flashkit.sim.loop_orders import format_loop_orders
from flashkit.sim.machine import run
from flashkit.sim.machine_tables import cost_tables, format_counts, format_trace
from flashkit.sim.programs import PROGRAM_NAMES, example_program
from flashkit.sim.systolic import format_stagger, systolic_matmul
from flashkit.sim.tpu import (
    compare_attention,
    format_comparison,
    format_vmem_table,
    format_vpu_breakdown,
)

__all__ = ["register"]

_DESCRIPTION = """\
Simulate the machines FlashAttention was designed for, and print what they count.

Start with `machine` (the toy register machine of the essay "Flash attention": why the number
of registers decides how often DRAM is read), then `loop-orders` (the same question for
attention's two loops), `systolic` and `tpu` (from "Forcing Flash Attention onto a TPU": a matrix
unit that is a tile processor), and `hbm` (Theorem 2 of the FlashAttention paper, Dao et al.
2022). Every count is measured by running the machine.
"""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _tile(text: str) -> tuple[int, int]:
    block_m, sep, block_n = text.lower().partition("x")
    if not (sep and block_m.isdigit() and block_n.isdigit() and int(block_m) and int(block_n)):
        raise argparse.ArgumentTypeError(f"expected BLOCK_MxBLOCK_N such as 128x64, got {text!r}")
    return int(block_m), int(block_n)


def _add(machines, name: str, summary: str, description: str, examples: list[str], handler):
    """One machine's parser: help text as written (line breaks kept) and its examples."""
    parser = machines.add_parser(
        name, help=summary, description=description,
        epilog="examples:\n" + "\n".join(f"  flashkit simulate {name} {e}".rstrip()
                                         for e in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(func=_usage_errors(parser, handler))
    return parser


def _usage_errors(parser: argparse.ArgumentParser, handler):
    """The handler, with the machines' ValueErrors (arguments that fit each alone but not
    together, such as too few --registers for a --program) reported as argparse errors: the
    message and exit status 2, not a traceback."""
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ValueError as error:
            parser.error(str(error))
    return run


# -- machine ------------------------------------------------------------------------------------

def _machine(args: argparse.Namespace) -> int:
    if args.program is None:
        print(cost_tables(n=args.n, softmax_n=args.n if args.n > 2 else 8))
        return 0
    program = example_program(args.program, n=args.n, d=args.d, seed=args.seed,
                              registers=args.registers)
    result = run(program)
    print(f"{program.name}: {program.description} ({program.num_registers} registers)\n")
    print(format_trace(result, values=args.values))
    print()
    print(format_counts(result))
    for name in program.outputs:
        print(f"\n{name} =\n{result.output(name)}")
    return 0


def _add_machine(machines) -> None:
    parser = _add(machines, "machine", "the toy register machine of the essay", """\
Run a program on the toy register machine of the essay "Flash attention". DRAM holds the
arrays, the register file holds a few values; LOAD and STORE move one value between them and
every instruction takes one cycle. The table shows every register after every step, with the
essay's names for the values (--values for the numbers).

Without --program: the essay's cost tables (inner vs outer product matmul, safe vs online
softmax, softmax vs attention), each measured by running the programs.""", [
        "", "--program c00                  # the essay's 7-step trace",
        "--program matmul-outer --n 2   # 6 registers, 22 cycles",
        "--program online-softmax --n 4 --values",
        "--program online-attention --n 3 --d 2"], _machine)
    parser.add_argument("--program", choices=PROGRAM_NAMES,
                        help="program to run; leave out for the essay's cost comparison tables")
    parser.add_argument("--n", type=_positive, default=2,
                        help="size: n x n matmul, length-n softmax, n queries and keys "
                             "(default 2)")
    parser.add_argument("--d", type=_positive, default=1,
                        help="head dimension for online-attention (default 1)")
    parser.add_argument("--registers", type=_positive,
                        help="run on a machine with this many registers (default: the fewest "
                             "the program needs)")
    parser.add_argument("--seed", type=int, default=0, help="random inputs' seed (default 0)")
    parser.add_argument("--values", action="store_true",
                        help="show the numbers in the registers instead of the essay's names")


# -- loop-orders --------------------------------------------------------------------------------

def _loop_orders(args: argparse.Namespace) -> int:
    print(format_loop_orders(n=args.n, d=args.d, seed=args.seed))
    return 0


def _add_loop_orders(machines) -> None:
    parser = _add(machines, "loop-orders", "FA2 (queries outside) vs FA1 (KV outside): traffic",
                  """\
Run attention in both loop orders against a memory that counts every row moved between
HBM and fast memory: queries outside (FlashAttention-2, the inner product) reloads K and
V for every query; keys and values outside (FlashAttention-1, the outer product) reloads
every query's output state for every key. The essay's cost comparison, then the spectrum
between them as more outputs stay in fast memory.""", ["--n 16"], _loop_orders)
    parser.add_argument("--n", type=_positive, default=8,
                        help="number of queries and of keys (default 8)")
    parser.add_argument("--d", type=_positive, default=4, help="head dimension (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="random inputs' seed (default 0)")


# -- systolic -----------------------------------------------------------------------------------

def _systolic(args: argparse.Namespace) -> int:
    a = np.arange(1, args.m * args.k + 1, dtype=np.float64).reshape(args.m, args.k)
    b = np.random.default_rng(args.seed).integers(0, 3, (args.k, args.n)).astype(np.float64)
    print(f"A =\n{a}\nB =\n{b}\n")
    for design in ["weight", "output"] if args.design == "both" else [args.design]:
        result = systolic_matmul(a, b, design)
        grid = f"{args.k} x {args.n}" if design == "weight" else f"{args.m} x {args.n}"
        print(f"{design}-stationary array ({grid} cells): what enters each row, cycle by cycle")
        print(format_stagger(result, design))
        print(f"C =\n{result.product}\nmatches A @ B: {np.allclose(result.product, a @ b)}; "
              f"cycles {result.cycles}, M + K + N - 2 = {args.m + args.k + args.n - 2}\n")
    return 0


def _add_systolic(machines) -> None:
    parser = _add(machines, "systolic", "weight- and output-stationary arrays, cycle by cycle",
                  """\
Tick a systolic array through C = A @ B (A is M x K, B is K x N) and show the stagger
that keeps every cell busy (as in "Forcing Flash Attention onto a TPU"). Weight-stationary
(the TPU MXU): B sits in a K x N grid, A streams in from the left, partial sums flow down.
Output-stationary: each cell of an M x N grid accumulates one C[i, j] while A and B stream
past.""",
                  ["--m 2 --k 3 --n 2 --design both"], _systolic)
    for name, default, meaning in [("m", 2, "rows of A"), ("k", 3, "inner dimension"),
                                   ("n", 2, "columns of B")]:
        parser.add_argument(f"--{name}", type=_positive, default=default,
                            help=f"{meaning} (default {default})")
    parser.add_argument("--design", choices=["weight", "output", "both"], default="weight",
                        help="weight-stationary (the TPU MXU), output-stationary, or both")
    parser.add_argument("--seed", type=int, default=0, help="seed for B's entries (default 0)")


# -- tpu ----------------------------------------------------------------------------------------

def _tpu(args: argparse.Namespace) -> int:
    if args.memory_table:
        print(format_vmem_table(d=args.d, element_bytes=4))
        return 0
    runs = compare_attention(n=args.n, d=args.d, blocks=args.blocks, causal=not args.no_causal,
                             seed=args.seed)
    kind = "non-causal" if args.no_causal else "causal"
    print(format_comparison(runs, title=f"TPU cycles, {kind} attention, n = {args.n}, "
                                        f"d = {args.d} (flash at each block size vs standard)"))
    if args.breakdown:
        print()
        print(format_vpu_breakdown(runs))
    return 0


def _add_tpu(machines) -> None:
    parser = _add(machines, "tpu", "TPU MXU + VPU cycles: tiled flash vs standard attention", """\
Run attention on a cycle model of one TPU core (the TPU post). Matmuls go to the MXU and cost
M + K + N - 2 cycles (ticked through the systolic array when every dimension is <= 16);
elementwise work goes to a 128-lane VPU at one cycle per 128 values (exp: two). The VPU
op list is in flashkit.sim.tpu's docstring; --breakdown prints it for each configuration.
The defaults reproduce the TPU post's table.""", [
        "                                # the TPU post's table",
        "--n 2048 --blocks 128 256 512 --breakdown",
        "--n 48 --d 8 --blocks 8 16       # small tiles tick the systolic array"], _tpu)
    parser.add_argument("--n", type=_positive, default=512, help="sequence length (default 512)")
    parser.add_argument("--d", type=_positive, default=64, help="head dimension (default 64)")
    parser.add_argument("--blocks", type=_positive, nargs="+", default=[64, 128],
                        help="square tile sizes for flash attention (default 64 128)")
    parser.add_argument("--no-causal", action="store_true", help="attend to every key")
    parser.add_argument("--breakdown", action="store_true", help="VPU cycles per operation")
    parser.add_argument("--memory-table", action="store_true",
                        help="instead: the float32 score matrix against the output in MiB for "
                             "n = 512..32k at head dim --d, and where the scores stop fitting "
                             "128 MiB of VMEM")
    parser.add_argument("--seed", type=int, default=0, help="random inputs' seed (default 0)")


# -- hbm ----------------------------------------------------------------------------------------

# The Triton fused-attention tutorial's autotuning grid: BLOCK_M 64/128, BLOCK_N 32/64/128.
_SEED_TILES = [(m, n) for m in (64, 128) for n in (32, 64, 128)]


def _hbm(args: argparse.Namespace) -> int:
    sram = args.sram_kib * 1024 // args.dtype_bytes  # Theorem 2's M counts elements
    print(format_io_sweep(args.ns, args.d, sram, args.dtype_bytes))
    print(_nine_times_note(args.ns, args.d, sram, args.dtype_bytes))
    print()
    print(format_sram_sweep(args.ns[-1], args.d, [sram // 4, sram // 2, sram, sram * 2],
                            args.dtype_bytes))
    print()
    ours = _triton_forward_tile(args.head_dim)
    tiles = args.tiles if ours is None or ours in args.tiles else [ours, *args.tiles]
    print(format_triton_configs(args.seqlen, args.head_dim, tiles, args.causal,
                                args.dtype_bytes, args.batch, args.nheads))
    if ours is None:
        print("(flashkit's own Triton tile is listed when triton is installed: "
              "pip install triton==3.6.0)")
    else:
        print(f"flashkit's Triton forward uses {ours[0]}x{ours[1]} at head dim {args.head_dim}.")
    return 0


def _triton_forward_tile(head_dim: int) -> tuple[int, int] | None:
    """flashkit's own Hopper forward tile (BLOCK_M, BLOCK_N) for this head dim, or None without
    triton: the tile tables live in the Triton backend, which imports triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    from flashkit.ops.triton import configs
    return configs.HOPPER["forward"][configs.padded_head_dim(head_dim)][:2]


def _nine_times_note(ns, d: int, sram: int, dtype_bytes: int) -> str:
    """Where the sweep stands against the FlashAttention paper's "up to 9x fewer HBM accesses",
    and the paper's block-size rule on a small worked example (N = 5, d = 3, M = 59)."""
    def best(m: int) -> float:
        return max(standard_attention_io(n, d).elements / flash_attention_io(n, d, m).elements
                   for n in ns)
    kib = sram * dtype_bytes // 1024
    hopper = 228 * 1024 // dtype_bytes
    block_r, block_c = flash_block_sizes(3, 59)
    return (f"The FlashAttention paper reports up to 9x fewer HBM accesses than standard "
            f"attention. Here, with {kib} KiB of SRAM, the most is {best(sram):.1f}x; with 228 "
            f"KiB (a Hopper SM) it is {best(hopper):.1f}x (largest N of the sweep).\n"
            f"Block sizes: B_c = ceil(M / 4d), B_r = min(B_c, d). For N = 5, d = 3, M = 59 that "
            f"is B_c = ceil(59 / 12) = {block_c}, B_r = {block_r} (a published walkthrough of "
            "Algorithm 1 writes B_c = 4).")


def _add_hbm(machines) -> None:
    parser = _add(machines, "hbm", "HBM traffic: standard vs FlashAttention, Triton tiles", """\
Count what attention moves between HBM and SRAM (Theorem 2 of the FlashAttention paper): standard
attention Theta(N d + N^2), FlashAttention (Algorithm 1) Theta(N^2 d^2 / M) for an SRAM of M
elements; each divided by its Theta term settles to a constant as N grows. Then the
FlashAttention-2 Triton forward's predicted traffic for each BLOCK_M x BLOCK_N tile,
every program's loads counted (no L2 reuse: an upper bound).""", [
        "", "--d 128 --sram-kib 228 --ns 1024 4096 16384 65536",
        "--seqlen 8192 --head-dim 128 --causal --tiles 128x64 128x128 --batch 2 --nheads 16"],
        _hbm)
    parser.add_argument("--ns", type=_positive, nargs="+",
                        default=[512, 1024, 2048, 4096, 8192, 16384],
                        help="sequence lengths N to sweep (default 512 .. 16384)")
    parser.add_argument("--d", type=_positive, default=64, help="head dimension (default 64)")
    parser.add_argument("--sram-kib", type=_positive, default=192,
                        help="SRAM per streaming multiprocessor in KiB, Theorem 2's M "
                             "(default 192, an A100 SM as in the paper)")
    parser.add_argument("--dtype-bytes", type=_positive, default=2,
                        help="bytes per element: 2 for fp16/bf16, 4 for fp32 (default 2)")
    parser.add_argument("--seqlen", type=_positive, default=4096,
                        help="sequence length for the Triton tile table (default 4096)")
    parser.add_argument("--head-dim", type=_positive, default=128,
                        help="head dimension for the Triton tile table (default 128)")
    parser.add_argument("--tiles", type=_tile, nargs="+", default=_SEED_TILES,
                        help="BLOCK_MxBLOCK_N tiles (default: the Triton tutorial's autotune grid)")
    parser.add_argument("--causal", action="store_true", help="causal Triton forward")
    parser.add_argument("--batch", type=_positive, default=1, help="batch size (default 1)")
    parser.add_argument("--nheads", type=_positive, default=1, help="query heads (default 1)")


def register(subparsers) -> None:
    """Add the ``simulate`` command, with one sub-subcommand per machine, to ``subparsers``."""
    parser = subparsers.add_parser(
        "simulate", help="register machine, loop orders, systolic array, TPU, HBM IO model",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    machines = parser.add_subparsers(title="machines", metavar="MACHINE")
    for add in (_add_machine, _add_loop_orders, _add_systolic, _add_tpu, _add_hbm):
        add(machines)

    def print_help(args: argparse.Namespace) -> int:
        parser.print_help()
        return 0

    parser.set_defaults(func=print_help)
