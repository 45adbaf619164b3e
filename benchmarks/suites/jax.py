"""jax: flashkit.jax against jax.nn.dot_product_attention, forward and backward TFLOP/s.

    PYTHONPATH=src python3 benchmarks/suites/jax.py [--seqlens 1024,4096,16384]
        [--head-dims 64,128] [--causal 0,1] [--tokens 16384] [--budget SECONDS] [--out DIR]
    PYTHONPATH=src python3 benchmarks/suites/jax.py --baselines [--seqlens ...] [--out DIR]

bf16, batch = --tokens / seqlen, nheads = 2048 / head_dim, for flashkit.jax.flash_attention's
implementations
    pallas         the default: on Hopper the Mosaic GPU kernels where they cover the problem,
                   else the Triton-lowered ones
    pallas_triton  the Triton-lowered forward and backward
    xla            the vmap-over-query-blocks port (seqlen <= --port-max)
    fori           the fori_loop port (seqlen <= --fori-max: the slow one)
and the anchors in the same run: jax.nn.dot_product_attention(implementation="cudnn") and
(implementation="xla", seqlen <= --port-max). "layout_ms" is the time of the transposes a
forward in the folded (batch, nheads_k, rows, d) layout would need around it: the HBM passes
the Pallas forwards do not make. TFLOP/s count 4 b h sq sk d over visible pairs forward (the
exact causal triangle) and 2.5x that backward; every number is also a ratio to cuDNN.
--baselines instead runs the nojit / unfused / fused / fori / vmap baselines of the JAX-on-TPU
write-up (flashkit.experiments.jax_baselines) at --seqlens, beside its ratios.

Timing: the median of 7 samples, each a loop of calls sized to about 20 ms, closed by
block_until_ready, after a compile-and-warm-up call. Backward times the backward alone: the
jitted VJP function applied to dO, with the forward's residuals computed once beforehand.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

# This file's folder must not shadow the jax package: benchmarks/ replaces it on the path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
from common import add_out_argument, default_out, table  # noqa: E402

WIDTH = 2048


def environment() -> dict:
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": getattr(dev, "device_kind", str(dev)), "backend": jax.default_backend(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "python": platform.python_version()}


def time_ms(fn, *args) -> float:
    """Median ms of fn(*args) over 7 samples of ~20 ms each, after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    iters = max(1, min(200, int(0.02 / max(time.perf_counter() - start, 1e-6))))
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(samples)


def flops(batch, nheads, seqlen, head_dim, causal) -> float:
    pairs = seqlen * (seqlen + 1) / 2 if causal else seqlen * seqlen
    return 4 * batch * nheads * pairs * head_dim


def attention_fns(causal):
    """name -> f(q, k, v) for every implementation and anchor, (b, s, h, d) layout."""
    fns = {impl: (lambda q, k, v, impl=impl:
                  flash_attention(q, k, v, causal=causal, implementation=impl))
           for impl in ("pallas", "pallas_triton", "xla", "fori")}
    for impl in ("cudnn", "xla"):
        fns[f"jax.nn/{impl}"] = (lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=impl))
    return fns


def measure(fn, q, k, v, dout):
    """(fwd ms, bwd ms) of one attention function."""
    fwd = jax.jit(fn)
    t_fwd = time_ms(fwd, q, k, v)
    _, vjp = jax.jit(lambda q, k, v: jax.vjp(fn, q, k, v))(q, k, v)
    t_bwd = time_ms(jax.jit(lambda vjp, dout: vjp(dout)), vjp, dout)
    return t_fwd, t_bwd


def skipped(name, seqlen, args) -> bool:
    limit = {"fori": args.fori_max, "xla": args.port_max, "jax.nn/xla": args.port_max}
    return seqlen > limit.get(name, seqlen)


def inputs(seqlen, head_dim, tokens, dtype=None):
    batch, nheads = max(1, tokens // seqlen), WIDTH // head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    return [jax.random.normal(key, (batch, seqlen, nheads, head_dim), dtype) for key in keys]


def grid(args):
    """(seqlen, causal, head dim) cells, seqlen outermost: a budget cut drops whole seqlens."""
    return [(seqlen, causal, d) for seqlen in (int(s) for s in args.seqlens.split(","))
            for causal in (bool(int(c)) for c in args.causal.split(","))
            for d in (int(x) for x in args.head_dims.split(","))]

def layout_ms(q, k, v) -> float:
    """ms of a folded layout's transposes: q (b, s, h, d) into (b, hk, group * s, d) and back,
    k and v into (b, hk, s, d)."""
    def passes(q, k, v):
        b, s, h, d = q.shape
        hk = k.shape[2]
        qf = q.reshape(b, s, hk, h // hk, d).transpose(0, 2, 3, 1, 4).reshape(b, hk, -1, d)
        back = qf.reshape(b, hk, h // hk, s, d).transpose(0, 3, 1, 2, 4).reshape(b, s, h, d)
        return back, k.swapaxes(1, 2), v.swapaxes(1, 2)
    return time_ms(jax.jit(passes), q, k, v)


def main(argv=None) -> int:
    global jax, jnp, flash_attention
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    ap.add_argument("--fori-max", type=int, default=2048)
    ap.add_argument("--port-max", type=int, default=4096)
    ap.add_argument("--baselines", action="store_true",
                    help="the JAX-on-TPU write-up's nojit/unfused/fused/fori/vmap baselines")
    ap.add_argument("--budget", type=float, default=float("inf"))
    add_out_argument(ap, "jax")
    args = ap.parse_args(argv)
    out = args.out or default_out("jax")
    import jax
    import jax.numpy as jnp

    from flashkit.jax import flash_attention
    if args.baselines:
        from flashkit.experiments import jax_baselines
        jax_baselines.run([int(n) for n in args.seqlens.split(",")], out)
        return 0
    started = time.time()
    record = {"suite": "jax", "env": environment(),
              "config": {"dtype": "bfloat16", "tokens": args.tokens, "width": WIDTH,
                         "timing": "median of 7 x ~20 ms loops, block_until_ready; "
                                   "bwd = VJP alone"},
              "rows": []}
    os.makedirs(out, exist_ok=True)
    device = "".join(c for c in record["env"]["device"].lower() if c.isalnum())[:12]
    path = os.path.join(out, f"{time.strftime('%Y%m%d_%H%M', time.gmtime())}_{device}.json")
    print(json.dumps(record["env"]), flush=True)
    for seqlen, causal, d in grid(args):
        if time.time() - started > args.budget:
            print("budget spent: stopping", flush=True)
            break
        q, k, v, dout = inputs(seqlen, d, args.tokens, jnp.bfloat16)
        batch, nheads = q.shape[0], q.shape[2]
        fl = flops(batch, nheads, seqlen, d, causal)
        row = {"seqlen": seqlen, "head_dim": d, "causal": causal, "batch": batch,
               "nheads": nheads, "layout_ms": layout_ms(q, k, v)}
        for name, fn in attention_fns(causal).items():
            if skipped(name, seqlen, args):
                continue
            try:
                t_fwd, t_bwd = measure(fn, q, k, v, dout)
            except Exception as err:  # an anchor this jax/GPU cannot run: say so
                row[name] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
                continue
            row[name] = {"fwd_ms": t_fwd, "fwd_tflops": fl / t_fwd / 1e9, "bwd_ms": t_bwd,
                         "bwd_tflops": 2.5 * fl / t_bwd / 1e9}
        ref = row.get("jax.nn/cudnn", {})
        for r in row.values():
            if isinstance(r, dict) and "fwd_ms" in r and "fwd_ms" in ref:
                r["fwd_vs_cudnn"] = ref["fwd_ms"] / r["fwd_ms"]
                r["bwd_vs_cudnn"] = ref["bwd_ms"] / r["bwd_ms"]
        record["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
    flat = [{"seqlen": r["seqlen"], "d": r["head_dim"], "causal": r["causal"],
             **{f"{n} fwd/bwd": f"{v['fwd_tflops']:.0f}/{v['bwd_tflops']:.0f}"
                for n, v in r.items() if isinstance(v, dict) and "fwd_tflops" in v}}
            for r in record["rows"]]
    names = sorted({c for r in flat for c in r if c.endswith("fwd/bwd")})
    with open(path.replace(".json", ".md"), "w") as f:
        f.write("TFLOP/s forward/backward\n\n"
                + table(flat, ["seqlen", "d", "causal", *names]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
