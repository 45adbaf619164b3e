"""FP8 attention forward on the GPU: speed against flashkit's bf16 forward and cuDNN, and
accuracy per head dim with and without the Hadamard rotation.

    PYTHONPATH=src python3 benchmarks/suites/fp8.py --out DIR [--no-sweep]

Speed (16k tokens: batch 1, seqlen 16384, nheads = 2048 / head_dim; head dims 64, 128, 256;
causal and not), forward only, the public API as a user calls it, triton.testing.do_bench
medians, TFLOP/s from 4 b h s^2 d (causal halves it):
  - flashkit fp8 e4m3 and e5m2 (flash_attn_func with per-head descales; v in the flash-attn
    layout, so each call includes the key-major copy of V), and e4m3 with v quantised
    key-major (fp8.quantize(v, key_major=True): no copy);
  - flashkit bf16 (flash_attn_func), cuDNN SDPA bf16;
  - cuDNN FP8 SDPA: scaled_dot_product_attention on float8_e4m3fn under the CUDNN backend, timed
    if this torch runs it, else SDPA's refusal (error and warnings) is recorded. The private
    aten op is never called on fp8 (it bypasses the dtype checks and crashes the context).
With the sweep (default), d64 and d128 also time the alternative tiles of the FP8 kernel in
SWEEP_TILES (V already key-major), about a minute.

Accuracy (batch 2, seqlen 1024, 8 heads, causal): the FP8 kernel's output against the float64
oracle on the unquantised inputs, max and RMS error, for standard normal q/k/v and for q/k with 4
outlier channels 10x the rest, with and without the Hadamard rotation of q and k; the bf16
kernel on the same inputs for comparison; and the testing rule's bound for out and lse (2 x the
error of fp8.rounded_reference + 1e-5, against the oracle on the dequantised inputs) with the
kernel's error beside it.

Writes DIR/fp8_<date>.json and DIR/fp8_<date>.md (date, device, versions, config).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import warnings

import torch
import triton
from triton.testing import do_bench

import flashkit
from flashkit import fp8
from flashkit.ops.params import AttentionParams
from flashkit.ops.triton import forward_fp8
from flashkit.reference import attention_with_params

TOKENS, WIDTH = 16384, 2048
HEAD_DIMS = (64, 128, 256)
# Alternative FP8 tiles per head dim, (BLOCK_M, BLOCK_N, num_warps, num_stages), with their
# registers per thread and CTAs per SM from an offline sm_90 compile (64K registers per SM).
SWEEP_TILES = {
    64: [(128, 128, 8, 3),  # 185 registers: 1 CTA (the first run's default)
         (128, 64, 8, 3),  # 104 (122 causal): 2 CTAs
         (128, 64, 8, 4),  # the same with a deeper K/V pipeline
         (64, 64, 4, 4),  # 117: 4 CTAs of one warpgroup
         (64, 128, 4, 3)],  # 168: 3 CTAs of one warpgroup (the default)
    128: [(128, 128, 8, 3),  # 211: 1 CTA (the default; best in the first run)
          (128, 64, 4, 3),  # 255: 1 CTA
          (64, 128, 4, 3),
          (64, 64, 4, 3),  # 155 (158 causal): 3 CTAs of one warpgroup
          (64, 64, 4, 4)],  # 160 (167 causal): 3 CTAs
}


def environment() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
    }


def bench(fn) -> float:
    """Median milliseconds."""
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def tflops(ms, batch, nheads, seqlen, head_dim, causal) -> float:
    return 4 * batch * nheads * seqlen ** 2 * head_dim * (0.5 if causal else 1.0) / ms * 1e-9


def quantized(q, k, v, dtype, hadamard=False):
    """(q8, k8, v8, descales as flash_attn_func keywords)."""
    (q8, qd), (k8, kd) = (fp8.quantize(x, hadamard=hadamard, dtype=dtype) for x in (q, k))
    v8, vd = fp8.quantize(v, dtype=dtype)
    return q8, k8, v8, dict(q_descale=qd, k_descale=kd, v_descale=vd)


def cudnn_fp8(q8, k8, v8, causal):
    """(callable, how) running cuDNN's FP8 attention through this torch's public SDPA, or
    (None, why not): the error and the warnings SDPA gave when it refused.

    Only the public entry point is tried: it checks dtypes before any launch. Calling the
    private aten._scaled_dot_product_cudnn_attention on fp8 tensors bypasses those checks, and
    in torch 2.11 (cuDNN 9.19) it ends in an illegal memory access that poisons the CUDA
    context for the rest of the process.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q8, k8, v8))

    def public():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            public()
            torch.cuda.synchronize()
            return public, "scaled_dot_product_attention under SDPBackend.CUDNN_ATTENTION"
        except RuntimeError as e:  # SDPA's refusal: this torch has no FP8 cuDNN attention
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    said = "; ".join(dict.fromkeys(str(w.message).splitlines()[0][:300] for w in caught))
    return None, f"scaled_dot_product_attention refused float8 inputs ({error}); warnings: {said}"


def speed(head_dim, causal, sweep) -> dict:
    seqlen, batch, nheads = TOKENS, 1, WIDTH // head_dim
    q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    row = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch,
           "nheads": nheads, "ms": {}, "tflops": {}, "notes": {}}

    def record(name, fn):
        ms = bench(fn)
        row["ms"][name] = ms
        row["tflops"][name] = tflops(ms, batch, nheads, seqlen, head_dim, causal)

    record("flashkit_bf16", lambda: flashkit.flash_attn_func(q, k, v, causal=causal))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def cudnn_bf16():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    record("cudnn_bf16", cudnn_bf16)
    for dtype, tag in ((torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2, "e5m2")):
        q8, k8, v8, descales = quantized(q, k, v, dtype)
        record(f"flashkit_fp8_{tag}", lambda q8=q8, k8=k8, v8=v8, d=descales:
               flashkit.flash_attn_func(q8, k8, v8, causal=causal, **d))
        if tag == "e4m3":
            v_kmajor, _ = fp8.quantize(v, dtype=dtype, key_major=True)
            record("flashkit_fp8_e4m3_v_key_major", lambda q8=q8, k8=k8, vk=v_kmajor, d=descales:
                   flashkit.flash_attn_func(q8, k8, vk, causal=causal, **d))
            if sweep:
                params = AttentionParams(head_dim ** -0.5, None, 0 if causal else None)
                for tile in SWEEP_TILES[head_dim]:
                    name = "tile_" + "_".join(map(str, tile))
                    try:
                        record(name, lambda tile=tile, q8=q8, k8=k8, vk=v_kmajor, p=params,
                               d=descales:
                               forward_fp8.attention_forward(q8, k8, vk, p,
                                                             d["q_descale"], d["k_descale"],
                                                             d["v_descale"], tile=tile))
                    except Exception as e:  # noqa: BLE001 - a tile may not fit shared memory
                        row["notes"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return row


def add_cudnn_fp8(row) -> None:
    """Time cuDNN's FP8 SDPA on the row's problem where this torch runs it, else note why not.
    Run after everything else: an unsupported fp8 path must not take the other numbers down."""
    q, k, v = (torch.randn(row["batch"], row["seqlen"], row["nheads"], row["head_dim"],
                           device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
    fn, how = cudnn_fp8(q, k, v, row["causal"])
    if fn is None:
        row["notes"]["cudnn_fp8"] = f"not available in torch {torch.__version__}: {how}"
        return
    ms = bench(fn)
    row["ms"]["cudnn_fp8"] = ms
    row["tflops"]["cudnn_fp8"] = tflops(ms, row["batch"], row["nheads"], row["seqlen"],
                                        row["head_dim"], row["causal"])
    row["notes"]["cudnn_fp8"] = f"through {how} (unit scales)"


def add_speedups(row) -> None:
    base = row["ms"]["flashkit_bf16"]
    row["speedup_vs_flashkit_bf16"] = {n: base / ms for n, ms in row["ms"].items()}


def accuracy(head_dim, seqlen=1024, causal=True, device="cuda") -> list[dict]:
    rows = []
    params = AttentionParams(head_dim ** -0.5, None, 0 if causal else None)
    for inputs in ("normal", "outliers"):
        q, k, v = (torch.randn(2, seqlen, 8, head_dim, device=device) for _ in range(3))
        if inputs == "outliers":
            scale = torch.ones(8, head_dim, device=device)
            scale[:, torch.randperm(head_dim)[:4]] = 10.0
            q, k = q * scale, k * scale
        oracle, _ = attention_with_params(q.double(), k.double(), v.double(), params)
        out = flashkit.flash_attn_func(*(x.bfloat16() for x in (q, k, v)), causal=causal,
                                       backend="triton")
        diff = out.double() - oracle
        rows.append({"head_dim": head_dim, "inputs": inputs, "format": "bf16",
                     "hadamard": False, "max_err": float(diff.abs().max()),
                     "rms_err": float(diff.pow(2).mean().sqrt())})
        for dtype, tag in ((torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2, "e5m2")):
            for hadamard in (False, True):
                q8, k8, v8, d = quantized(q, k, v, dtype, hadamard)
                out, lse = forward_fp8.attention_forward(q8, k8, v8, params, d["q_descale"],
                                                         d["k_descale"], d["v_descale"])
                diff = out.double() - oracle
                wide = [fp8.dequantize(x, d[f"{n}_descale"], torch.float64)
                        for x, n in zip((q8, k8, v8), "qkv", strict=True)]
                deq_out, deq_lse = attention_with_params(*wide, params)
                base_out, base_lse = fp8.rounded_reference(q8, k8, v8, params, **d)
                rows.append({
                    "head_dim": head_dim, "inputs": inputs, "format": tag, "hadamard": hadamard,
                    "max_err": float(diff.abs().max()),
                    "rms_err": float(diff.pow(2).mean().sqrt()),
                    "err_vs_dequantised_oracle": float((out.double() - deq_out).abs().max()),
                    "rule_bound": 2 * float((base_out.double() - deq_out).abs().max()) + 1e-5,
                    "lse_err_vs_dequantised_oracle": float((lse.double() - deq_lse).abs().max()),
                    "lse_rule_bound": 2 * float((base_lse.double() - deq_lse).abs().max()) + 1e-5,
                })
    return rows


def markdown(env, speed_rows, acc_rows) -> str:
    lines = [f"# FP8 forward, {env['device']}, {env['date']}", "",
             f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, cuDNN "
             f"{env['cudnn']}. Forward, 16k tokens, TFLOP/s (do_bench median); x = speed-up "
             "over flashkit bf16.", ""]
    names = sorted({n for r in speed_rows for n in r["ms"]},
                   key=lambda n: (n.startswith("tile_"), n))
    lines += ["| d | causal | " + " | ".join(names) + " |",
              "|---|---|" + "---|" * len(names)]
    for r in speed_rows:
        cells = [f"{r['tflops'][n]:.0f} ({r['speedup_vs_flashkit_bf16'][n]:.2f}x)"
                 if n in r["ms"] else "-" for n in names]
        lines.append(f"| {r['head_dim']} | {r['causal']} | " + " | ".join(cells) + " |")
    notes = {n for r in speed_rows for n in r["notes"].items()}
    lines += [""] + [f"- {n}: {t}" for n, t in sorted(notes)]
    lines += ["", "Accuracy: batch 2, seqlen 1024, 8 heads, causal; error of out against the "
              "float64 oracle on the unquantised inputs; bound = 2 x rounded baseline + 1e-5 "
              "against the oracle on the dequantised inputs (the tests' rule).", "",
              "| d | inputs | format | hadamard | max err | RMS err | err (dequantised) | "
              "bound | lse err (dequantised) | lse bound |", "|---" * 10 + "|"]
    for r in acc_rows:
        lines.append(f"| {r['head_dim']} | {r['inputs']} | {r['format']} | {r['hadamard']} | "
                     f"{r['max_err']:.2e} | {r['rms_err']:.2e} | "
                     f"{r.get('err_vs_dequantised_oracle', float('nan')):.2e} | "
                     f"{r.get('rule_bound', float('nan')):.2e} | "
                     f"{r.get('lse_err_vs_dequantised_oracle', float('nan')):.2e} | "
                     f"{r.get('lse_rule_bound', float('nan')):.2e} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/fp8"),
                    help="directory for the JSON and markdown results")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false",
                    help="skip the d64/d128 tile sweep of the FP8 kernel")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/suites/fp8.py needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d_%H%M")
    path = os.path.join(args.out, f"fp8_{stamp}")
    speed_rows, acc_rows = [], []

    def save():  # after every phase, so a failure later keeps what was measured
        with open(path + ".json", "w") as f:
            json.dump({"env": env, "speed": speed_rows, "accuracy": acc_rows}, f, indent=1)

    torch.manual_seed(0)
    with torch.no_grad():
        for head_dim in HEAD_DIMS:
            for causal in (False, True):
                speed_rows.append(speed(head_dim, causal, args.sweep and head_dim in SWEEP_TILES))
                add_speedups(speed_rows[-1])
                print(f"d{head_dim} causal={causal} " + ", ".join(
                    f"{n} {t:.0f}" for n, t in speed_rows[-1]["tflops"].items()), flush=True)
        save()
        for head_dim in HEAD_DIMS:
            acc_rows += accuracy(head_dim)
        save()
        for row in speed_rows:
            add_cudnn_fp8(row)
            add_speedups(row)
    save()
    text = markdown(env, speed_rows, acc_rows)
    with open(path + ".md", "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {path}.json and {path}.md")


if __name__ == "__main__":
    main()
