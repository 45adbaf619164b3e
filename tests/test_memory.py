"""Peak memory: the tiled backend's extra memory grows linearly with the sequence length, the
materialised reference's quadratically.

Measured for real, in a fresh process: the kernel's peak resident set (VmHWM, reset through
/proc/self/clear_refs) above the resident set before the call. glibc's malloc is told to map
every block of 64 KiB or more on its own (MALLOC_MMAP_THRESHOLD_), so freed tensors go back to
the system at once and the high-water mark follows the live tensors; transparent huge pages are
turned off for the process so the resident set moves in 4 KiB pages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"),
                                reason="needs Linux /proc to reset the peak resident set")

SEQLENS = (1024, 2048)

MEASURE = r"""
import ctypes, gc, json, sys
import torch
import flashkit

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

def peak_extra(fn):
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    before = status("VmRSS:")
    fn()
    return status("VmHWM:") - before

def run(backend, seqlen, backward):
    q, k, v = (torch.randn(1, seqlen, 2, 64, requires_grad=backward) for _ in range(3))
    dout = torch.randn(1, seqlen, 2, 64)
    def call():
        out = flashkit.flash_attn_func(q, k, v, causal=True, backend=backend)
        if backward:
            out.backward(dout)
    return call

torch.set_num_threads(1)
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: no 2 MiB jumps in the RSS
result = {}
for backend in ("reference", "torch"):
    for backward in (False, True):
        run(backend, 256, backward)()  # warm-up: first-call allocations are not the kernel's
        for seqlen in json.loads(sys.argv[1]):
            key = f"{backend}/{'fwd+bwd' if backward else 'fwd'}/{seqlen}"
            result[key] = peak_extra(run(backend, seqlen, backward))
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def peaks():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(SEQLENS)], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
def test_tiled_is_linear_and_reference_quadratic(peaks, pass_):
    short, long = SEQLENS
    naive = peaks[f"reference/{pass_}/{long}"] / peaks[f"reference/{pass_}/{short}"]
    # Below 1 MiB the resident set's page and allocator granularity decide the ratio (the
    # tiled forward holds 0.3 MiB at 1024, 0.8 at 2048 on one machine): the ratio's base is at
    # least 1 MiB, where a quadratic tiled pass would hold ~27 MiB as the reference does.
    tiled = peaks[f"torch/{pass_}/{long}"] / max(peaks[f"torch/{pass_}/{short}"], 2**20)
    summary = {key: f"{value / 2**20:.1f} MiB" for key, value in peaks.items()}
    assert naive >= 3.5, f"reference: doubling seqlen grew peak memory {naive:.2f}x; {summary}"
    assert tiled <= 2.5, f"tiled: doubling seqlen grew peak memory {tiled:.2f}x; {summary}"
    # And in absolute terms: at 2048 the (b, h, s, s) float32 scores alone are 32 MiB.
    assert peaks[f"torch/{pass_}/{long}"] < peaks[f"reference/{pass_}/{long}"] / 10, summary
