"""``flashkit simulate ...``: run the machines of the seed documents and print their tables.

The lead's ``flashkit/cli.py`` calls :func:`register`; each machine is one sub-subcommand whose
handler returns an exit code.
"""

from __future__ import annotations

import argparse

__all__ = ["register"]

_DESCRIPTION = """\
Simulate the machines FlashAttention was designed for, and print what they count.

  machine      the toy register machine (seed 002): register table after every step,
               cycles, DRAM reads and writes; without --program, the seed's cost tables
  loop-orders  attention with queries outside (FA2) or keys/values outside (FA1): HBM loads
               and stores of Q, KV and O, and how keeping outputs in fast memory moves them
  systolic     a weight-stationary (TPU MXU) and an output-stationary systolic array, ticked
               cycle by cycle: the stagger, the product, M + K + N - 2 cycles
  tpu          a TPU core's MXU (systolic array) and 128-lane VPU running causal flash
               attention at several block sizes and standard attention: cycles, utilisation
  hbm          the FlashAttention paper's Theorem 2: HBM traffic of standard attention vs
               FlashAttention as N and the SRAM size grow, and a Triton kernel's block config
"""

_MACHINE_EPILOG = """\
examples:
  flashkit simulate machine                       # inner vs outer product, softmax passes
  flashkit simulate machine --program c00         # the seed's 7-step trace
  flashkit simulate machine --program matmul-outer --n 2
  flashkit simulate machine --program online-softmax --n 4 --values
  flashkit simulate machine --program online-attention --n 3 --d 2
"""


def _print_help(parser: argparse.ArgumentParser):
    def handler(args: argparse.Namespace) -> int:
        parser.print_help()
        return 0
    return handler


def _machine(args: argparse.Namespace) -> int:
    from flashkit.sim.machine import run
    from flashkit.sim.machine_tables import cost_tables, format_counts, format_trace
    from flashkit.sim.programs import example_program

    if args.program is None:
        print(cost_tables(n=args.n, softmax_n=args.n if args.n > 2 else 8))
        return 0
    program = example_program(args.program, n=args.n, d=args.d, seed=args.seed)
    result = run(program)
    print(f"{program.name}: {program.description} ({program.num_registers} registers)\n")
    print(format_trace(result, values=args.values))
    print()
    print(format_counts(result))
    for name in program.outputs:
        print(f"\n{name} =\n{result.output(name)}")
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_machine(machines) -> None:
    from flashkit.sim.programs import PROGRAM_NAMES

    parser = machines.add_parser(
        "machine", help="the toy register machine of seed 002",
        description="Run a program on the toy register machine: LOAD/STORE move one value "
                    "between DRAM and a register, every instruction is one cycle.",
        epilog=_MACHINE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", choices=PROGRAM_NAMES,
                        help="program to run; leave out for the seed's cost comparison tables")
    parser.add_argument("--n", type=_positive, default=2,
                        help="size: n x n matmul, length-n softmax, n queries and keys "
                             "(default 2)")
    parser.add_argument("--d", type=_positive, default=1,
                        help="head dimension for online-attention (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="random inputs' seed (default 0)")
    parser.add_argument("--values", action="store_true",
                        help="show the numbers in the registers instead of the seed's names")
    parser.set_defaults(func=_machine)


def _loop_orders(args: argparse.Namespace) -> int:
    from flashkit.sim.loop_orders import format_loop_orders

    print(format_loop_orders(n=args.n, d=args.d, seed=args.seed))
    return 0


def _add_loop_orders(machines) -> None:
    parser = machines.add_parser(
        "loop-orders", help="FA2 (queries outside) vs FA1 (KV outside): HBM traffic",
        description="Run attention in both loop orders against a memory that counts every row "
                    "moved between HBM and fast memory (seed 002's cost comparison).",
        epilog="example:\n  flashkit simulate loop-orders --n 16",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=_positive, default=8,
                        help="number of queries and of keys (default 8)")
    parser.add_argument("--d", type=_positive, default=4, help="head dimension (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="random inputs' seed (default 0)")
    parser.set_defaults(func=_loop_orders)


def _systolic(args: argparse.Namespace) -> int:
    import numpy as np

    from flashkit.sim.systolic import format_stagger, systolic_matmul

    a = np.arange(1, args.m * args.k + 1, dtype=np.float64).reshape(args.m, args.k)
    b = np.random.default_rng(args.seed).integers(0, 3, (args.k, args.n)).astype(np.float64)
    print(f"A =\n{a}\nB =\n{b}\n")
    designs = ["weight", "output"] if args.design == "both" else [args.design]
    for design in designs:
        result = systolic_matmul(a, b, design)
        grid = f"{args.k} x {args.n}" if design == "weight" else f"{args.m} x {args.n}"
        print(f"{design}-stationary array ({grid} cells): what enters each row, cycle by cycle")
        print(format_stagger(result, design))
        formula = args.m + args.k + args.n - 2
        print(f"C =\n{result.product}\nmatches A @ B: {np.allclose(result.product, a @ b)}; "
              f"cycles {result.cycles}, M + K + N - 2 = {formula}\n")
    return 0


def _add_systolic(machines) -> None:
    parser = machines.add_parser(
        "systolic", help="weight- and output-stationary systolic arrays, cycle by cycle",
        description="Tick a systolic array through C = A @ B (A is M x K, B is K x N) and show "
                    "the stagger that keeps every cell busy (seed 003).",
        epilog="example:\n  flashkit simulate systolic --m 2 --k 3 --n 2 --design both",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default, meaning in [("m", 2, "rows of A"), ("k", 3, "inner dimension"),
                                   ("n", 2, "columns of B")]:
        parser.add_argument(f"--{name}", type=_positive, default=default,
                            help=f"{meaning} (default {default})")
    parser.add_argument("--design", choices=["weight", "output", "both"], default="weight",
                        help="weight-stationary (the TPU MXU), output-stationary, or both")
    parser.add_argument("--seed", type=int, default=0, help="seed for B's entries (default 0)")
    parser.set_defaults(func=_systolic)


def _tpu(args: argparse.Namespace) -> int:
    from flashkit.sim.tpu import compare_attention, format_comparison, format_vpu_breakdown

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
    parser = machines.add_parser(
        "tpu", help="TPU MXU + VPU cycles: tiled flash vs standard attention",
        description="Run attention on a cycle model of one TPU core (seed 003): matmuls on the "
                    "MXU cost M + K + N - 2 cycles (ticked through the systolic array when "
                    "every dimension is <= 16), elementwise work on a 128-lane VPU costs one "
                    "cycle per 128 values (exp: two). The VPU op list is in "
                    "flashkit.sim.tpu's docstring; --breakdown prints it per configuration.",
        epilog="examples:\n  flashkit simulate tpu                      # seed 003's table\n"
               "  flashkit simulate tpu --n 2048 --blocks 128 256 512 --breakdown\n"
               "  flashkit simulate tpu --n 48 --d 8 --blocks 8 16  # small tiles tick the array",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=_positive, default=512, help="sequence length (default 512)")
    parser.add_argument("--d", type=_positive, default=64, help="head dimension (default 64)")
    parser.add_argument("--blocks", type=_positive, nargs="+", default=[64, 128],
                        help="square tile sizes for flash attention (default 64 128)")
    parser.add_argument("--no-causal", action="store_true", help="attend to every key")
    parser.add_argument("--breakdown", action="store_true", help="VPU cycles per operation")
    parser.add_argument("--seed", type=int, default=0, help="random inputs' seed (default 0)")
    parser.set_defaults(func=_tpu)


def _tile(text: str) -> tuple[int, int]:
    block_m, sep, block_n = text.lower().partition("x")
    if not sep or not block_m.isdigit() or not block_n.isdigit() or "0" in (block_m, block_n):
        raise argparse.ArgumentTypeError(f"expected BLOCK_MxBLOCK_N such as 128x64, got {text!r}")
    return int(block_m), int(block_n)


# The seed 004 Triton tutorial's autotuning grid: BLOCK_M in {64, 128}, BLOCK_N in {32, 64, 128}.
_SEED_TILES = [(m, n) for m in (64, 128) for n in (32, 64, 128)]


def _hbm(args: argparse.Namespace) -> int:
    from flashkit.sim.hbm import format_io_sweep, format_sram_sweep, format_triton_configs

    sram = args.sram_kib * 1024 // args.dtype_bytes
    print(format_io_sweep(args.ns, args.d, sram, args.dtype_bytes))
    print()
    print(format_sram_sweep(args.ns[-1], args.d, [sram // 4, sram // 2, sram, sram * 2]))
    print()
    print(format_triton_configs(args.seqlen, args.head_dim, args.tiles, args.causal,
                                args.dtype_bytes, args.batch, args.nheads))
    return 0


def _add_hbm(machines) -> None:
    parser = machines.add_parser(
        "hbm", help="HBM traffic: standard attention vs FlashAttention (Theorem 2), Triton tiles",
        description="Count the elements and bytes attention moves between HBM and SRAM: "
                    "standard attention Theta(N d + N^2), FlashAttention (Algorithm 1) "
                    "Theta(N^2 d^2 / M), and the FlashAttention-2 Triton forward for each "
                    "BLOCK_M x BLOCK_N tile (every program's loads counted: no L2 reuse).",
        epilog="examples:\n  flashkit simulate hbm\n"
               "  flashkit simulate hbm --d 128 --sram-kib 228 --ns 1024 4096 16384 65536\n"
               "  flashkit simulate hbm --seqlen 8192 --head-dim 128 --causal "
               "--tiles 128x64 128x128 --batch 2 --nheads 16",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", type=_positive, nargs="+",
                        default=[512, 1024, 2048, 4096, 8192, 16384],
                        help="sequence lengths N to sweep (default 512 .. 16384)")
    parser.add_argument("--d", type=_positive, default=64, help="head dimension (default 64)")
    parser.add_argument("--sram-kib", type=_positive, default=192,
                        help="SRAM per streaming multiprocessor in KiB, M in Theorem 2 "
                             "(default 192, an A100 SM as in the paper)")
    parser.add_argument("--dtype-bytes", type=_positive, default=2,
                        help="bytes per element: 2 for fp16/bf16, 4 for fp32 (default 2)")
    parser.add_argument("--seqlen", type=_positive, default=4096,
                        help="sequence length for the Triton tile table (default 4096)")
    parser.add_argument("--head-dim", type=_positive, default=128,
                        help="head dimension for the Triton tile table (default 128)")
    parser.add_argument("--tiles", type=_tile, nargs="+", default=_SEED_TILES,
                        help="BLOCK_MxBLOCK_N tiles (default: the seed's autotune grid)")
    parser.add_argument("--causal", action="store_true", help="causal Triton forward")
    parser.add_argument("--batch", type=_positive, default=1, help="batch size (default 1)")
    parser.add_argument("--nheads", type=_positive, default=1, help="query heads (default 1)")
    parser.set_defaults(func=_hbm)


def register(subparsers) -> None:
    """Add the ``simulate`` command, with one sub-subcommand per machine, to ``subparsers``."""
    parser = subparsers.add_parser(
        "simulate", help="register machine, loop orders, systolic array, TPU, HBM IO model",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    machines = parser.add_subparsers(title="machines", metavar="MACHINE")
    _add_machine(machines)
    _add_loop_orders(machines)
    _add_systolic(machines)
    _add_tpu(machines)
    _add_hbm(machines)
    parser.set_defaults(func=_print_help(parser))
