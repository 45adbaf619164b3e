"""Does compute-sanitizer's racecheck report Triton's own gl.warp_specialize code? (GPU, sm_90)

    PYTHONPATH=src python3 benchmarks/diagnostics/racecheck_warp_specialize.py

Runs three bare Gluon kernels, each under `compute-sanitizer --tool racecheck`, and prints each
report. Every kernel splits into the Gluon forward's roles (4 default warps, workers of 1 and 4
warps with 24 and 240 registers) and only stores to global memory:
  1  nothing else
  2  two mbarriers initialised before the split and invalidated after it
  3  as 2, with the workers arriving on and the default warps waiting for them
flashkit's Gluon forward has the shape of 3. A hazard in 2 or 3 and none in 1 places the one
racecheck reports for the forward (kernel start against the split and the invalidation) in the
code Triton generates around the split, not in flashkit's kernels.

    PYTHONPATH=src python3 benchmarks/diagnostics/racecheck_warp_specialize.py --sass [VARIANT]

Without a GPU: compiles a variant for sm_90 (sm90_probe's fake driver) and prints its shared
memory accesses and barriers in program order. In 1 and 2 alike, the default warps write the
workers' state table (STS) before a barrier of the whole block (BAR.SYNC 0x1) and the workers
read it (LDS) after one, and the exit state is written after the partition's closing block
barrier: the accesses racecheck reports are ordered by those barriers. What 2 adds is the
mbarriers' init and invalidation (SYNCS), each behind a barrier of the 128 default threads
alone on barrier 0 (BAR.SYNC 0x0, 0x80), which suggests racecheck mistracks that partial
barrier rather than a race in the generated code.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def _role(x_ptr, bars, ROLE: gl.constexpr, SYNC: gl.constexpr):
    """Each role stores its own slice of x; with SYNC, role 0 waits for role 1's arrival."""
    if ROLE == 0:
        offs = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
        if SYNC:
            mbarrier.wait(bars.index(0), 0)
        gl.store(x_ptr + offs, offs.to(gl.float32))
    elif ROLE == 1:
        offs = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
        gl.store(x_ptr + 128 + offs, offs.to(gl.float32))
        if SYNC:
            mbarrier.arrive(bars.index(0), count=1)
    else:
        offs = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
        if SYNC:
            mbarrier.arrive(bars.index(1), count=1)
        gl.store(x_ptr + 160 + offs, offs.to(gl.float32))


@gluon.jit
def _split_kernel(x_ptr, BARS: gl.constexpr, SYNC: gl.constexpr):
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if BARS:
        mbarrier.init(bars.index(0), count=1)
        mbarrier.init(bars.index(1), count=1)
    gl.warp_specialize([(_role, (x_ptr, bars, 0, SYNC)), (_role, (x_ptr, bars, 1, SYNC)),
                        (_role, (x_ptr, bars, 2, SYNC))], [1, 4], [24, 240])
    if BARS:
        mbarrier.invalidate(bars.index(0))
        mbarrier.invalidate(bars.index(1))


def run(variant: int) -> None:
    x = torch.zeros(288, device="cuda")
    _split_kernel[(4,)](x, BARS=variant >= 2, SYNC=variant >= 3, num_warps=4)
    torch.cuda.synchronize()


def sass_listing(variant: int) -> list[str]:
    """The shared memory accesses, barriers and branches of the variant's sm_90 SASS."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import sm90_probe as probe

    probe.install_fake_driver()
    _split_kernel[(4,)](torch.zeros(288), BARS=variant >= 2, SYNC=variant >= 3, num_warps=4)
    kernel = probe.COMPILED[-1][2]
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(probe.TOOLS, "nvdisasm"), "-c", cubin],
                              capture_output=True, text=True, check=True).stdout
    wanted = re.compile(r"\b(BAR|STS|LDS|SYNCS|BRX|EXIT|USETMAXREG)\b")
    return [line.strip() for line in sass.splitlines() if wanted.search(line)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", type=int, choices=(1, 2, 3),
                        help="(internal) run one kernel, under the sanitizer")
    parser.add_argument("--sass", type=int, choices=(1, 2, 3), nargs="?", const=2,
                        help="print a variant's shared memory accesses and barriers (no GPU)")
    args = parser.parse_args(argv)
    if args.sass:
        print("\n".join(sass_listing(args.sass)))
        return 0
    if args.variant:
        run(args.variant)
        return 0
    tool = shutil.which("compute-sanitizer") or (
        sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer")) or [None])[-1]
    if tool is None:
        print("compute-sanitizer not found")
        return 1
    for variant in (1, 2, 3):
        done = subprocess.run([tool, "--tool", "racecheck", sys.executable, __file__,
                               "--variant", str(variant)], capture_output=True, text=True,
                              timeout=120)
        print(f"== variant {variant}")
        print("\n".join(line for line in done.stdout.splitlines() if line.startswith("=====")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
