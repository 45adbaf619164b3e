"""Where results go and what they carry: every file records date, device and versions.

A measurement without the machine and software it came from cannot be compared with anything
later, so `environment()` is stored at the top of every JSON file the experiments write.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
from pathlib import Path

import torch

import flashkit


def environment(device: str) -> dict:
    """Date (UTC), device name, the versions of Python, torch, triton and flashkit, and the CPU's
    1-minute load average (None where the OS has none): CPU timings taken while other processes
    keep the cores busy are distorted, and the reports say so."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device, "device_name": name, "python": platform.python_version(),
        "torch": torch.__version__, "triton": triton_version, "flashkit": flashkit.__version__,
        "cpu_cores": os.cpu_count(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def busy_cpu_note(env: dict) -> str | None:
    """A warning when the CPU was busier than its cores when `env` was taken, else None."""
    load, cores = env.get("load_average"), env.get("cpu_cores")
    if load is None or not cores or load <= cores:
        return None
    return (f"the CPU was busy when this was measured (load average {load:.1f} on {cores} "
            "cores): CPU timings and speed-ups are distorted by other processes")


def stamp() -> str:
    """A UTC timestamp for file names: 20261121T0312Z."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%MZ")


def output_dir(path: str | os.PathLike) -> Path:
    """The folder results go to, created if missing."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_json(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    """One row per dict; the columns are the union of the keys, in first-seen order."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header: list[str], rows: list[list]) -> str:
    """A plain aligned table for the terminal."""
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
                     for row in cells)
