"""compute-sanitizer over every kernel family at small shapes (GPU).

    PYTHONPATH=src python3 benchmarks/diagnostics/sanitizer.py --out "$OUT"

Runs `compute-sanitizer --tool memcheck` on a small driver (this file with --drive FAMILY), one
process per family: forward, backward, decode (with splits: the merge kernel), append (the
append kernel and the decode step that appends itself), and on sm_90 the Gluon forward and
backward. Then `--tool racecheck` on the families whose kernels share memory across warps (the
tl.dot / wgmma operands staged in shared memory, the Gluon kernels' producer and consumer
warps). The caching allocator is off (PYTORCH_NO_CUDA_MEMORY_CACHING=1), so memcheck sees every
tensor as its own allocation and an access past one is an error, not a read of a neighbour.
Writes sanitizer.json and sanitizer.md to --out: per family and tool, the error count from the
tool's summary line (or why there is none: missing tool, timeout, crash) and the first lines of
any report. Exit status 0 when every run is clean.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

FAMILIES = ("forward", "backward", "decode", "append", "gluon_forward", "gluon_backward")
RACECHECK = ("forward", "backward", "decode", "gluon_forward", "gluon_backward")


def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, else in a CUDA toolkit under /usr/local."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    candidates = sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer")
                        + glob.glob("/usr/local/cuda*/compute-sanitizer/compute-sanitizer"))
    return candidates[-1] if candidates else None


def drive(family: str) -> None:
    """Run one family's kernels at small, awkward shapes (what the sanitizer watches)."""
    import torch

    import flashkit
    from flashkit.ops.params import AttentionParams

    dev = "cuda"
    torch.manual_seed(0)

    def rand(*shape, dtype=torch.float16):
        return torch.randn(*shape, device=dev, dtype=dtype)

    if family in ("forward", "backward"):
        for dtype, (sq, sk, d), kw in ((torch.float16, (17, 33, 40), dict(causal=True)),
                                       (torch.bfloat16, (65, 31, 96), dict(window_size=(7, 3))),
                                       (torch.float32, (3, 130, 64), dict(softcap=5.0)),
                                       (torch.float16, (33, 33, 256), dict(dropout_p=0.2))):
            q, k, v = (rand(2, s, 4, d, dtype=dtype).requires_grad_(family == "backward")
                       for s in (sq, sk, sk))
            out = flashkit.flash_attn_func(q, k, v, **kw)
            if family == "backward":
                out.backward(torch.randn_like(out))
        cu_q = torch.tensor([0, 0, 5, 22], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, 3, 3, 40], dtype=torch.int32, device=dev)
        q, k, v = (rand(n, 4, 64).requires_grad_(family == "backward") for n in (22, 40, 40))
        out = flashkit.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 37, causal=True)
        if family == "backward":
            out.backward(torch.randn_like(out))
    elif family in ("decode", "append"):
        with torch.no_grad():
            for page, new in ((None, 0), (16, 0), (None, 1), (16, 5), (None, 9)):
                if family == "decode" and new:
                    continue
                if family == "append" and not new:
                    continue
                shape = (3, 100, 2, 64) if page is None else (30, page, 2, 64)
                kc, vc = rand(*shape), rand(*shape)
                table = None if page is None else torch.randperm(30, device=dev)[:27].view(
                    3, 9).to(torch.int32)
                seqlens = torch.tensor([0, 37, 90], dtype=torch.int32, device=dev)
                kn = vn = None
                rot = {}
                if new:
                    kn, vn = rand(3, new, 2, 64), rand(3, new, 2, 64)
                    angles = torch.rand(200, 16, device=dev)
                    rot = dict(rotary_cos=angles.cos(), rotary_sin=angles.sin())
                for splits in (1, 3):
                    flashkit.flash_attn_with_kvcache(rand(3, 2, 8, 64), kc, vc, kn, vn,
                                                     cache_seqlens=seqlens, block_table=table,
                                                     causal=True, num_splits=splits, **rot)
    elif family in ("gluon_forward", "gluon_backward"):
        from flashkit.ops.triton import forward_hopper

        if torch.cuda.get_device_capability() != (9, 0):
            print("SKIP: the Gluon kernels run on sm_90 only")
            return
        for causal in (False, True):
            q, k, v = (rand(1, 256, 4, 128, dtype=torch.bfloat16).requires_grad_(
                family == "gluon_backward") for _ in range(3))
            params = AttentionParams(softmax_scale=128 ** -0.5,
                                     window_right=0 if causal else None)
            print("gluon forward eligible:", forward_hopper.eligible(q, k, v, params, None, None,
                                                                     None))
            out = flashkit.flash_attn_func(q, k, v, causal=causal)
            if family == "gluon_backward":
                out.backward(torch.randn_like(out))
    else:
        raise ValueError(f"--drive: unknown family {family!r}; expected one of {FAMILIES}")
    torch.cuda.synchronize()
    print(f"driven: {family}")


def sanitize(tool_path: str, tool: str, family: str, timeout: float) -> dict:
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    cmd = [tool_path, "--tool", tool, "--error-exitcode", "9", "--print-limit", "20",
           sys.executable, os.path.abspath(__file__), "--drive", family]
    start = time.perf_counter()
    try:
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(family=family, tool=tool, status="timeout", seconds=timeout)
    text = run.stdout + run.stderr
    # memcheck ends with "ERROR SUMMARY: N errors", racecheck with "RACECHECK SUMMARY: H
    # hazards displayed (N errors, W warnings)"
    summary = re.findall(r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed "
                         r"\((\d+) error", text)
    summary = [memcheck or racecheck for memcheck, racecheck in summary]
    errors = int(summary[-1]) if summary else None
    skipped = "SKIP:" in text
    status = ("skipped" if skipped else "clean" if errors == 0 and run.returncode == 0
              else "errors" if errors else f"failed (exit {run.returncode})")
    report_lines = [ln for ln in text.splitlines() if ln.startswith("=========")][:40]
    return dict(family=family, tool=tool, status=status, errors=errors,
                seconds=round(time.perf_counter() - start, 1), returncode=run.returncode,
                report=report_lines, tail=text.splitlines()[-15:] if status != "clean" else [])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--drive", choices=FAMILIES, help="(internal) run one family's kernels")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="seconds per sanitizer run (default 90)")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds for all runs; later runs are skipped (default 420)")
    parser.add_argument("--no-racecheck", action="store_true")
    args = parser.parse_args(argv)
    if args.drive:
        drive(args.drive)
        return 0
    os.makedirs(args.out, exist_ok=True)
    tool_path = find_sanitizer()
    results = []
    if tool_path is None:
        results.append(dict(status="missing", detail="compute-sanitizer not on PATH nor under "
                            "/usr/local/cuda*/bin: install the CUDA toolkit's sanitizer"))
        print("compute-sanitizer: not found (which compute-sanitizer; /usr/local/cuda*/bin)")
    else:
        runs = [("memcheck", f) for f in args.families]
        if not args.no_racecheck:
            runs += [("racecheck", f) for f in args.families if f in RACECHECK]
        start = time.perf_counter()
        for tool, family in runs:
            left = args.budget - (time.perf_counter() - start)
            if left < 10:
                results.append(dict(family=family, tool=tool, status="not run (budget)"))
                continue
            result = sanitize(tool_path, tool, family, min(args.timeout, left))
            results.append(result)
            print(f"{tool:10s} {family:15s} {result['status']:10s} "
                  f"errors={result.get('errors')} {result.get('seconds')} s", flush=True)
    with open(os.path.join(args.out, "sanitizer.json"), "w") as f:
        json.dump(dict(tool=tool_path, results=results), f, indent=1)
    with open(os.path.join(args.out, "sanitizer.md"), "w") as f:
        f.write(f"# compute-sanitizer ({tool_path or 'missing'})\n\n| tool | family | status | "
                "errors | seconds |\n|---|---|---|---|---|\n")
        for r in results:
            f.write(f"| {r.get('tool', '-')} | {r.get('family', '-')} | {r['status']} | "
                    f"{r.get('errors')} | {r.get('seconds')} |\n")
    return 0 if results and all(r["status"] in ("clean", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
