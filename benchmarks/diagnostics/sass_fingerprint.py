"""Fingerprint the sm_90 SASS of the Triton backend's main kernel builds, offline (no GPU), so a
refactor can show that the machine code of every kernel it touched is unchanged.

    PYTHONPATH=src python3 benchmarks/diagnostics/sass_fingerprint.py --out A.json [--only gluon]
    PYTHONPATH=src python3 benchmarks/diagnostics/sass_fingerprint.py --compare A.json B.json

A stand-in driver answers "current target = cuda sm_90" and every launch becomes a compile-only
warm-up, so the host launchers run unchanged on CPU tensors (their shapes, strides and dtypes
are what Triton specialises on) and compile what they would launch on an H100/H200. Each build
is fingerprinted three ways, from strict to loose:
    sass      the whole disassembly (nvdisasm -c), the kernel's own name masked
    operands  the same with constant-bank offsets masked (a removed kernel parameter shifts the
              offsets of the ones after it, c[0x0][0x...], and nothing else)
    opcodes   the instruction sequence without operands (same schedule, other register names)
plus registers, spill stack and instruction count. Needs Triton's bundled ptxas and nvdisasm.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver as driver_config
from triton.runtime.jit import JITFunction

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class _Sm90Driver:
    """Just enough of CudaDriver for JITFunction.run(warmup=True)."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 128)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


COMPILED: list = []


def _install() -> None:
    """Compile-only launches for sm_90. Call before flashkit's Triton modules are imported (some
    read TRITON_INTERPRET at import time)."""
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the CPU interpreter
    driver_config.set_active(_Sm90Driver())
    original = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        COMPILED.append((self.__name__, kernel))
        return kernel

    JITFunction.run = compile_only
    from flashkit.ops.triton import forward_hopper, launch

    launch._hooked = lambda: True  # every launch through kernel[grid], i.e. compile_only
    forward_hopper.programs_per_device = lambda device, consumers: 132 * (
        2 if consumers == 1 else 1)


_OPCODE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", re.M)


DUMP_DIR = None  # --dump: write each build's SASS (kernel name masked) here, for diffs


def fingerprint(name: str, kernel, label: str = "") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "--dump-resource-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(TOOLS, "nvdisasm"), "-c", cubin],
                              capture_output=True, text=True, check=True).stdout
    instructions = [m.group(1).replace(name, "KERNEL") for m in _OPCODE.finditer(sass)]
    operands = [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][*]", i) for i in instructions]
    opcodes = [re.sub(r"^(@!?U?P\w+\s+)?(\S+).*$", r"\1\2", i) for i in instructions]
    if DUMP_DIR:
        stem = re.sub(r"[^\w]+", "_", f"{label} {name}").strip("_")
        with open(os.path.join(DUMP_DIR, stem + ".sass"), "w") as f:
            f.write("\n".join(operands) + "\n")
    ops = collections.Counter(o.split()[-1].split(".")[0] for o in opcodes)

    def digest(lines):
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]

    return {"kernel": name, "sass": digest(instructions), "operands": digest(operands),
            "opcodes": digest(opcodes), "instructions": len(instructions),
            "regs": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
            "smem": kernel.metadata.shared,
            "hgmma": ops["HGMMA"], "ex2": sum(1 for o in opcodes if "MUFU.EX2" in o)}


def _qkv(batch, seqlen, nheads, head_dim, nheads_k=None, seqlen_k=None, dtype=torch.bfloat16):
    nheads_k = nheads_k or nheads
    seqlen_k = seqlen_k or seqlen
    q = torch.empty(batch, seqlen, nheads, head_dim, dtype=dtype)
    k = torch.empty(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    v = torch.empty(batch, seqlen_k, nheads_k, head_dim, dtype=dtype)
    return q, k, v


def _params(head_dim, causal, features=False, nheads=16, **kw):
    from flashkit.ops.params import AttentionParams

    params = AttentionParams(head_dim ** -0.5, None, 0 if causal else None, **kw)
    if features:  # softcap, ALiBi, sink, a left window, dropout
        import dataclasses

        params = dataclasses.replace(
            params, softcap=30.0, alibi_slopes=torch.rand(nheads, dtype=torch.float32),
            sink=torch.zeros(nheads, dtype=torch.float32), window_left=256,
            dropout_p=0.1, dropout_seed=1234)
    return params


def _varlen(head_dim, causal, nheads=16, seqlens=(1000, 3000)):
    import dataclasses

    starts = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(starts[-1])
    q = torch.empty(total, nheads, head_dim, dtype=torch.bfloat16)
    params = dataclasses.replace(_params(head_dim, causal), cu_seqlens_q=starts,
                                 cu_seqlens_k=starts, max_seqlen_q=max(seqlens),
                                 max_seqlen_k=max(seqlens))
    return q, q.clone(), q.clone(), params


def builds():
    """(label, thunk) of every build fingerprinted; each thunk calls one host launcher."""
    import importlib

    backward, backward_hopper, decode, forward, forward_hopper = (
        importlib.import_module(f"flashkit.ops.triton.{name}")
        for name in ("backward", "backward_hopper", "decode", "forward", "forward_hopper"))

    from flashkit.ops.params import lse_shape

    def lse_of(q, params):
        return torch.empty(lse_shape(q, params), dtype=torch.float32)

    def problem(head_dim, causal, features, varlen, seqlen=4096):
        """q, k, v, params: two packed sequences (varlen), else one of seqlen tokens, h x d =
        2048."""
        if varlen:
            return _varlen(head_dim, causal)
        q, k, v = _qkv(1, seqlen, 2048 // head_dim, head_dim)
        return q, k, v, _params(head_dim, causal, features, nheads=q.shape[2])

    def portable_fwd(head_dim, causal, features=False, varlen=False):
        q, k, v, params = problem(head_dim, causal, features, varlen)
        return lambda: forward.attention_forward(q, k, v, params)

    def portable_bwd(head_dim, causal, features=False, varlen=False):
        q, k, v, params = problem(head_dim, causal, features, varlen)
        return lambda: backward.attention_backward(q, q, k, v, q, lse_of(q, params), params)

    def gluon_fwd(head_dim, causal, seqlen=4096, features=False, varlen=False):
        q, k, v, params = problem(head_dim, causal, features, varlen, seqlen)
        return lambda: forward_hopper.attention_forward(q, k, v, params)

    def gluon_paged(head_dim):
        import dataclasses

        batch, nheads, page, pages = 2, 8, 16, 64
        q = torch.empty(batch * 512, nheads, head_dim, dtype=torch.bfloat16)
        k = torch.empty(batch * pages, page, nheads, head_dim, dtype=torch.bfloat16)
        starts = torch.arange(batch + 1, dtype=torch.int32) * 512
        params = dataclasses.replace(_params(head_dim, True), cu_seqlens_q=starts,
                                     cu_seqlens_k=starts, max_seqlen_q=512,
                                     max_seqlen_k=pages * page)
        table = torch.zeros(batch, pages, dtype=torch.int32)
        used = torch.full((batch,), pages * page, dtype=torch.int32)
        return lambda: forward_hopper.attention_forward(q, k, k.clone(), params, seqused_k=used,
                                                        block_table=table)

    def hopper_bwd(head_dim, causal, features=False, varlen=False):
        q, k, v, params = problem(head_dim, causal, features, varlen)
        lse = lse_of(q, params)

        def run():
            delta = torch.empty_like(lse)
            backward_hopper.attention_backward_dq(q, q, k, v, q, lse, delta, None, params,
                                                  torch.empty_like(q))
            backward_hopper.attention_backward_dkdv(q, q, k, v, lse, delta, params,
                                                    torch.empty_like(k), torch.empty_like(v))
        return run

    def decode_fwd(head_dim, paged=False, splits=4, features=False, group=8):
        batch, nheads_k, capacity = 4, 4, 8192
        q = torch.empty(batch, 1, nheads_k * group, head_dim, dtype=torch.bfloat16)
        if paged:
            page = 256
            k = torch.empty(batch * capacity // page, page, nheads_k, head_dim,
                            dtype=torch.bfloat16)
            table = torch.zeros(batch, capacity // page, dtype=torch.int32)
        else:
            k = torch.empty(batch, capacity, nheads_k, head_dim, dtype=torch.bfloat16)
            table = None
        seqlens = torch.full((batch,), capacity, dtype=torch.int32)
        params = _params(head_dim, True, features, nheads=q.shape[2])
        if features:
            import dataclasses

            params = dataclasses.replace(params, dropout_p=0.0)
        return lambda: decode.forward(q, k, k.clone(), seqlens, None, None, table, params,
                                      splits, capacity)

    out = []
    for d in (64, 128):
        for causal in (False, True):
            tag = "causal" if causal else "full"
            out.append((f"portable_fwd d{d} {tag}", portable_fwd(d, causal)))
            out.append((f"portable_bwd d{d} {tag}", portable_bwd(d, causal)))
    out.append(("portable_fwd d128 features", portable_fwd(128, True, features=True)))
    out.append(("portable_fwd d128 varlen", portable_fwd(128, True, varlen=True)))
    out.append(("portable_bwd d128 features", portable_bwd(128, True, features=True)))
    out.append(("portable_bwd d128 varlen", portable_bwd(128, True, varlen=True)))
    for d in (64, 128, 256):
        for causal in (False, True):
            tag = "causal" if causal else "full"
            out.append((f"gluon_fwd d{d} {tag} 4k", gluon_fwd(d, causal)))
    out.append(("gluon_fwd d64 full 1k", gluon_fwd(64, False, seqlen=1024)))
    out.append(("gluon_fwd d128 full 1k (persistent)", gluon_fwd(128, False, seqlen=1024)))
    out.append(("gluon_fwd d128 causal 1k", gluon_fwd(128, True, seqlen=1024)))
    out.append(("gluon_fwd d128 features", gluon_fwd(128, True, features=True)))
    out.append(("gluon_fwd d128 varlen", gluon_fwd(128, True, varlen=True)))
    out.append(("gluon_fwd d128 paged", gluon_paged(128)))
    for d in (64, 128, 256):
        for causal in (False, True):
            tag = "causal" if causal else "full"
            out.append((f"hopper_bwd d{d} {tag}", hopper_bwd(d, causal)))
    out.append(("hopper_bwd d128 features", hopper_bwd(128, True, features=True)))
    out.append(("hopper_bwd d256 features", hopper_bwd(256, True, features=True)))
    out.append(("hopper_bwd d128 varlen", hopper_bwd(128, True, varlen=True)))
    out.append(("hopper_bwd d256 varlen", hopper_bwd(256, True, varlen=True)))
    out.append(("decode d128 split", decode_fwd(128)))
    out.append(("decode d128 paged split", decode_fwd(128, paged=True)))
    out.append(("decode d64 one split", decode_fwd(64, splits=1)))
    out.append(("decode d128 features", decode_fwd(128, features=True)))
    return out


def run(only: str | None) -> dict:
    _install()
    results = {}
    for label, thunk in builds():
        if only and not any(word in label for word in only.split(",")):
            continue
        COMPILED.clear()
        try:
            thunk()
        except Exception as exc:  # report, keep going: one failure must not hide the rest
            results[label] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"{label}: ERROR {results[label]['error']}", flush=True)
            continue
        seen = collections.Counter()
        entries = {}
        for name, kernel in COMPILED:
            seen[name] += 1
            key = name if seen[name] == 1 else f"{name}#{seen[name]}"
            entries[key] = fingerprint(name, kernel, f"{label} {key}")
        results[label] = entries
        print(label, {k: (v["sass"], v["regs"], v["instructions"]) for k, v in entries.items()},
              flush=True)
    return results


def compare(before: dict, after: dict) -> int:
    """Print, per build and kernel, the strictest level at which before and after agree."""
    differ = 0
    for label in sorted(set(before) | set(after)):
        a, b = before.get(label), after.get(label)
        if a is None or b is None or "error" in a or "error" in b:
            print(f"{label}: only one side ({'error' if a and 'error' in a else ''}"
                  f"{'error' if b and 'error' in b else ''})")
            differ += 1
            continue
        for kernel in sorted(set(a) | set(b)):
            x, y = a.get(kernel), b.get(kernel)
            if x is None or y is None:
                print(f"{label} {kernel}: only {'after' if x is None else 'before'}")
                differ += 1
                continue
            level = next((lvl for lvl in ("sass", "operands", "opcodes") if x[lvl] == y[lvl]),
                         None)
            facts = {k: (x[k], y[k]) for k in ("regs", "stack", "instructions", "smem")
                     if x[k] != y[k]}
            verdict = ("identical" if level == "sass" else
                       f"same {level} only" if level else "DIFFERENT")
            differ += level != "sass"
            print(f"{label} {kernel}: {verdict} {facts or ''}")
    print(f"{differ} kernel builds not byte-identical")
    return differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the fingerprints as JSON here")
    ap.add_argument("--only", help="comma-separated words; only builds whose label has one")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--dump", help="write each build's SASS here (constant offsets masked)")
    args = ap.parse_args()
    if args.dump:
        global DUMP_DIR
        DUMP_DIR = args.dump
        os.makedirs(DUMP_DIR, exist_ok=True)
    if args.compare:
        with open(args.compare[0]) as f, open(args.compare[1]) as g:
            sys.exit(1 if compare(json.load(f), json.load(g)) else 0)
    results = run(args.only)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
