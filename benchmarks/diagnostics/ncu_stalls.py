"""Where a kernel's warps stall, per SASS instruction, from an Nsight Compute source page.

Collect on the GPU (the H200 machine has ncu; leave its clocks alone):

    ncu --clock-control none -k regex:fwd_hopper --launch-skip 2 --launch-count 1 \
        --section WarpStateStats --section SourceCounters -o prof python3 case.py
    ncu --import prof.ncu-rep --page source --csv --print-source sass | gzip > prof_sass.csv.gz

then here (no GPU needed):

    python3 benchmarks/diagnostics/ncu_stalls.py prof_sass.csv.gz [other.csv.gz]
        [--kernel REGEX] [--list]

Per kernel it prints the stall reasons over all sampled warps, the executed instruction mix,
and the same for the hottest loop: the instructions sharing the execution count that holds the
most samples (a software-pipelined body unrolled by n is one such group). Sampling covers every
warp, so warps parked at a barrier for the whole kernel (a producer warpgroup's idle warps)
inflate `barrier` in the totals; the loop's numbers are the ones to compare between variants.
--list prints the loop in address order with each instruction's samples and top two reasons.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def kernels(path: str) -> list[tuple[str, list[dict]]]:
    """[(kernel name, rows)] of one CSV; a "Kernel Name" line starts each kernel's block, the
    next line is its header."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        lines = list(csv.reader(f))
    blocks, header = [], None
    for line in lines:
        if line and line[0] == "Kernel Name":
            blocks.append((line[1], []))
            header = None
        elif blocks and header is None:
            header = line
        elif blocks:
            blocks[-1][1].append(dict(zip(header, line, strict=True)))
    return blocks


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:  # "-" for counters an instruction does not have
        return 0.0


def opcode(row: dict) -> str:
    """The opcode without modifiers or predicate: "@!P0 SYNCS.ARRIVE.TRANS64 ..." -> "SYNCS"."""
    words = row["Source"].split()
    words = words[1:] if words and words[0].startswith("@") else words
    return words[0].split(".")[0] if words else "?"


def stall_reasons(rows: list[dict]) -> collections.Counter:
    """Samples per stall reason (the "stall_x" columns, not their "(Not Issued)" twins)."""
    total = collections.Counter()
    for row in rows:
        for column, value in row.items():
            if column.startswith("stall_") and not column.endswith("(Not Issued)"):
                total[column[len("stall_"):]] += number(value)
    return total


def hottest_loop(rows: list[dict]) -> tuple[int, list[dict]]:
    """(execution count, rows) of the count whose instructions hold the most samples."""
    groups = collections.defaultdict(list)
    for row in rows:
        groups[int(number(row[EXECUTED]))].append(row)
    count = max((c for c in groups if c > 0),
                key=lambda c: sum(number(r[SAMPLES]) for r in groups[c]))
    return count, groups[count]


def shares(counter: collections.Counter, top: int = 9) -> str:
    total = sum(counter.values()) or 1.0
    return ", ".join(f"{name} {100 * value / total:.1f}%"
                     for name, value in counter.most_common(top))


def report(name: str, rows: list[dict], listing: bool) -> None:
    mix = collections.Counter()
    for row in rows:
        mix[opcode(row)] += number(row[EXECUTED])
    stalls = stall_reasons(rows)
    print(f"== {name}: {len(rows)} instructions, {sum(stalls.values()):.0f} samples")
    print(f"   stalls: {shares(stalls)}")
    print(f"   executed: {shares(mix, 12)}")
    count, loop = hottest_loop(rows)
    loop_stalls = stall_reasons(loop)
    print(f"   loop (executed {count}x): {len(loop)} instructions, "
          f"{sum(loop_stalls.values()):.0f} samples")
    print(f"   loop stalls: {shares(loop_stalls, 10)}")
    if listing:
        for row in loop:
            reasons = stall_reasons([row]).most_common(2)
            top = "  ".join(f"{r}:{v:.0f}" for r, v in reasons if v)
            print(f"   {number(row[SAMPLES]):6.0f}  {row['Source'].strip()[:72]:72s} {top}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="ncu source-page CSVs (.csv or .csv.gz)")
    parser.add_argument("--kernel", default="", help="only kernels whose name matches")
    parser.add_argument("--list", action="store_true", help="print the hottest loop")
    args = parser.parse_args()
    for path in args.csv:
        for name, rows in kernels(path):
            if re.search(args.kernel, name):
                report(f"{path}: {name[:60]}", rows, args.list)


if __name__ == "__main__":
    main()
