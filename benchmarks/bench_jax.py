"""Speed of flashkit.jax against jax.nn.dot_product_attention (docs/design.md section 6).

    PYTHONPATH=src python3 benchmarks/bench_jax.py --out DIR [--seqlens 1024,4096,16384]
        [--head-dims 64,128] [--causal 0,1] [--sweep] [--budget SECONDS]

bf16, batch = 16k tokens / seqlen, nheads = 2048 / headdim, forward and backward, for
    pallas         flashkit's default: on Hopper the Mosaic GPU forward and backward where they
                   cover the problem, else the Triton-lowered kernels
    pallas_triton  the Triton-lowered forward and backward
    xla            flashkit's seed-003 vmap-over-query-blocks port (seqlen <= --port-max)
    fori           flashkit's seed-003 fori_loop port (seqlen <= --fori-max: the slow one)
and the anchors in the same run: jax.nn.dot_product_attention(implementation="cudnn") and
(implementation="xla", seqlen <= --port-max). "layout_ms" is the time of the transposes that a
forward in the folded (batch, nheads_k, rows, d) layout needs around it (q, k, v in, out back):
the HBM passes the Pallas forwards no longer make. TFLOP/s count 4 b h sq sk d over visible
pairs forward (exactly the causal triangle when causal) and 2.5x that backward; every number is
also a ratio to cuDNN.
--tokens (batch * seqlen) and --sweep-seqlen shrink a smoke test on a CPU.

Timing: the median of 7 samples, each a loop of calls sized to about 20 ms, closed by
block_until_ready, after a compile-and-warm-up call. Backward times the backward alone: the
jitted VJP function applied to dO, with the forward's residuals computed once beforehand.
--sweep first times the candidate tiles of flashkit.jax.pallas.TILES at seqlen 8k and runs the
main grid with the fastest. --mosaic-cells instead times, per cell, the Mosaic forward with every
tile of flashkit.jax.mosaic.CANDIDATES (each checked against cuDNN's output) beside cuDNN and XLA:
the data behind flashkit.jax.mosaic.TILES. --mosaic-bwd times, per cell and dtype (--dtypes),
the backward alone of every tile of flashkit.jax.mosaic_backward.CANDIDATES (Mosaic forward and
backward; dq/dk/dv checked against cuDNN's) beside cuDNN's, XLA's and the Triton-lowered
backward (implementation="pallas_triton"): the data behind mosaic_backward.TILES. --budget
stops starting new configs after that many seconds; the JSON is rewritten after every config,
so a run cut short still leaves its numbers.
--domain times the cells the Mosaic kernels took over from the Triton-lowered fallback (lengths
that are not multiples of 128, a causal sliding window over 16k, a length not a multiple of 8
that costs a padding copy) and a few aligned cells (regression check): forward and backward of
"pallas" (Mosaic) against "pallas_triton" (the previous fallback) and cuDNN through
jax.nn.dot_product_attention (local_window_size for the window; an error is recorded where
cuDNN refuses a cell), --cells picks them by label.
Results: DIR/jax_<date>.json with date, device, versions, tiles and config.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from flashkit.jax import _layout, flash_attention, pallas

WIDTH = 2048
DTYPE = jnp.bfloat16
# Candidate (block_q, block_k, num_warps, num_stages) for --sweep.
SWEEP = {
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 4)],
    "bwd": [(64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 3)],
}


def environment() -> dict:
    import jaxlib

    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": getattr(dev, "device_kind", str(dev)),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
    }


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


def layout_ms(q, k, v) -> float:
    """ms of the folded layout's transposes: q, k, v into it and out (q-shaped) back."""
    def passes(q, k, v):
        qf = _layout.fold_q(q, k.shape[2])
        return (_layout.unfold_q(qf, q.shape[1]), _layout.swap_seq_heads(k),
                _layout.swap_seq_heads(v))
    return time_ms(jax.jit(passes), q, k, v)


def skipped(name, seqlen, args) -> bool:
    limit = {"fori": args.fori_max, "xla": args.port_max, "jax.nn/xla": args.port_max}
    return seqlen > limit.get(name, seqlen)


def inputs(seqlen, head_dim, tokens, dtype=DTYPE):
    batch, nheads = max(1, tokens // seqlen), WIDTH // head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    return [jax.random.normal(key, (batch, seqlen, nheads, head_dim), dtype) for key in keys]


def sweep(head_dims, tokens, seqlen):
    """Time every candidate tile per head dim and pass; install and return the fastest."""
    chosen, log = {"fwd": {}, "bwd": {}}, []
    for d in head_dims:
        q, k, v, dout = inputs(seqlen, d, tokens)
        for which in ("fwd", "bwd"):
            best = None
            for tile in SWEEP[which]:
                pallas.TILES[which][d] = tile
                fn = lambda q, k, v: flash_attention(q, k, v, implementation="pallas")
                try:
                    t = measure(fn, q, k, v, dout)[0 if which == "fwd" else 1]
                except Exception as err:  # a tile the compiler rejects (shared memory): skip it
                    print(f"sweep d{d} {which} {tile}: failed ({type(err).__name__})")
                    continue
                log.append({"head_dim": d, "pass": which, "tile": tile, "ms": t})
                print(f"sweep d{d} {which} {tile}: {t:.3f} ms", flush=True)
                if best is None or t < best[1]:
                    best = (tile, t)
            if best is None:
                raise RuntimeError(f"sweep: no candidate tile compiled for d{d} {which}")
            chosen[which][d] = pallas.TILES[which][d] = best[0]
    return chosen, log


def mosaic_cells(args, record, path):
    """Per cell of the grid, the Mosaic forward with every candidate tile of
    flashkit.jax.mosaic.CANDIDATES (each checked against cuDNN's output) against cuDNN and (seqlen
    <= --port-max) XLA, timed in the same process; the fastest tile goes into the row."""
    from flashkit.jax import mosaic

    record["mosaic_cells"] = []
    for seqlen, causal, d in grid(args):
        if time.time() - args.started > args.budget:
            print("budget spent: stopping", flush=True)
            break
        q, k, v, _ = inputs(seqlen, d, args.tokens)
        fl = flops(q.shape[0], q.shape[2], seqlen, d, causal)
        row = {"seqlen": seqlen, "head_dim": d, "causal": causal, "candidates": []}
        ref = None  # cuDNN's output, else XLA's (a CPU smoke test)
        for name in ("jax.nn/cudnn", "jax.nn/xla"):
            fn = jax.jit(attention_fns(causal)[name])
            try:
                row[name] = {"fwd_ms": time_ms(fn, q, k, v)} if not skipped(name, seqlen,
                                                                               args) else {}
                ref = fn(q, k, v).astype(jnp.float32) if ref is None else ref
            except Exception as err:  # an anchor this jax/GPU cannot run: say so
                row[name] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
        shipped = mosaic.TILES[d, causal]
        for tile in [None] if args.shipped else mosaic.CANDIDATES[d]:
            if tile is not None and tile.persistent and args.no_persistent:
                continue
            mosaic.TILES[d, causal] = shipped if tile is None else ((None, tile),)
            tile = tile or mosaic.table_tile(d, causal, seqlen)
            fn = jax.jit(lambda q, k, v, c=causal: flash_attention(
                q, k, v, causal=c, implementation="pallas_mosaic"))
            entry = {"tile": dataclasses.asdict(tile)}
            try:
                entry["fwd_ms"] = time_ms(fn, q, k, v)
                entry["max_abs_diff_vs_cudnn"] = float(jnp.max(jnp.abs(
                    fn(q, k, v).astype(jnp.float32) - ref)))
            except Exception as err:  # a tile that does not fit (shared memory, registers)
                entry["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            row["candidates"].append(entry)
        ok = [c for c in row["candidates"] if c.get("max_abs_diff_vs_cudnn", 1.0) < 0.05]
        if ok:
            best = min(ok, key=lambda c: c["fwd_ms"])
            row["best"] = {**best, "fwd_tflops": fl / best["fwd_ms"] / 1e9,
                           **{f"fwd_vs_{n[7:]}": row[n]["fwd_ms"] / best["fwd_ms"]
                              for n in ("jax.nn/cudnn", "jax.nn/xla")
                              if "fwd_ms" in row.get(n, {})}}
        mosaic.TILES[d, causal] = shipped
        record["mosaic_cells"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "candidates"}), flush=True)
        with open(path, "w") as f:
            json.dump(record, f, indent=1)


def backward_ms(fn, q, k, v, dout):
    """(ms of the backward alone, (dq, dk, dv) in float32) of one attention function."""
    _, vjp = jax.jit(lambda q, k, v: jax.vjp(fn, q, k, v))(q, k, v)
    bwd = jax.jit(lambda vjp, dout: vjp(dout))
    grads = [g.astype(jnp.float32) for g in bwd(vjp, dout)]
    return time_ms(bwd, vjp, dout), grads


def mosaic_bwd(args, record, path):
    """Per cell and dtype, the backward of every tile of flashkit.jax.mosaic_backward.CANDIDATES
    against cuDNN's, XLA's (seqlen <= --port-max) and the Triton-lowered one, timed in the same
    process; each tile's gradients are checked against cuDNN's (max |diff| over dq, dk, dv)."""
    from flashkit.jax import mosaic_backward

    record["mosaic_bwd_tiles"] = {f"d{d} {'causal' if c else 'full'}": dataclasses.asdict(t)
                                  for (d, c), t in mosaic_backward.TILES.items()}
    record["mosaic_bwd_cells"] = []
    for dtype in args.dtypes.split(","):
        for seqlen, causal, d in grid(args):
            if time.time() - args.started > args.budget:
                print("budget spent: stopping", flush=True)
                break
            q, k, v, dout = inputs(seqlen, d, args.tokens, getattr(jnp, dtype))
            fl = 2.5 * flops(q.shape[0], q.shape[2], seqlen, d, causal)
            row = {"seqlen": seqlen, "head_dim": d, "causal": causal, "dtype": dtype,
                   "candidates": []}
            ref = None  # cuDNN's gradients
            fns = attention_fns(causal)
            for name in ("jax.nn/cudnn", "jax.nn/xla", "pallas_triton"):
                if skipped(name, seqlen, args) or (name == "pallas_triton"
                                                   and not args.triton_bwd):
                    continue
                try:
                    row[name] = {"bwd_ms": None}
                    row[name]["bwd_ms"], grads = backward_ms(fns[name], q, k, v, dout)
                    ref = grads if ref is None else ref
                except Exception as err:  # an anchor this jax/GPU cannot run: say so
                    row[name] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
            shipped = mosaic_backward.TILES[d, causal]
            for tile in mosaic_backward.CANDIDATES[d]:
                mosaic_backward.TILES[d, causal] = tile
                entry = {"tile": dataclasses.asdict(tile)}
                try:
                    entry["bwd_ms"], grads = backward_ms(fns["pallas"], q, k, v, dout)
                    if ref is not None:
                        entry["max_abs_diff_vs_cudnn"] = max(
                            float(jnp.max(jnp.abs(a - b))) for a, b in zip(grads, ref, strict=True))
                except Exception as err:  # a tile that does not fit (shared memory, registers)
                    entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                row["candidates"].append(entry)
            mosaic_backward.TILES[d, causal] = shipped
            ok = [c for c in row["candidates"] if c.get("max_abs_diff_vs_cudnn", 1.0) < 0.05]
            if ok:
                best = min(ok, key=lambda c: c["bwd_ms"])
                row["best"] = {**best, "bwd_tflops": fl / best["bwd_ms"] / 1e9,
                               **{f"bwd_vs_{n.split('/')[-1]}": row[n]["bwd_ms"] / best["bwd_ms"]
                                  for n in ("jax.nn/cudnn", "jax.nn/xla", "pallas_triton")
                                  if row.get(n, {}).get("bwd_ms")}}
            record["mosaic_bwd_cells"].append(row)
            print(json.dumps(row), flush=True)
            with open(path, "w") as f:
                json.dump(record, f, indent=1)


# label -> (seqlen, head dim, causal, window (left, right)); batch = --tokens / seqlen
DOMAIN = {
    "1000 full d64": (1000, 64, False, (-1, -1)), "1000 full d128": (1000, 128, False, (-1, -1)),
    "1000 causal d64": (1000, 64, True, (-1, -1)),
    "1000 causal d128": (1000, 128, True, (-1, -1)),
    "4000 full d64": (4000, 64, False, (-1, -1)), "4000 full d128": (4000, 128, False, (-1, -1)),
    "4000 causal d64": (4000, 64, True, (-1, -1)),
    "4000 causal d128": (4000, 128, True, (-1, -1)),
    "16k window 1024 d64": (16384, 64, True, (1024, 0)),
    "16k window 1024 d128": (16384, 128, True, (1024, 0)),
    "4003 full d128 (pad copy)": (4003, 128, False, (-1, -1)),
    "aligned 1024 causal d64": (1024, 64, True, (-1, -1)),
    "aligned 4096 full d128": (4096, 128, False, (-1, -1)),
    "aligned 16384 causal d128": (16384, 128, True, (-1, -1)),
}


def visible_pairs(seqlen, left, right) -> int:
    """(query, key) pairs a bottom-right aligned window (left, right), -1 unbounded, lets
    through at seqlen_q = seqlen_k."""
    hi = seqlen - 1
    return sum(min(i + right if right >= 0 else hi, hi) - max(i - left if left >= 0 else 0, 0)
               + 1 for i in range(seqlen))


def domain_fns(causal, window):
    """name -> f(q, k, v): Mosaic, the Triton-lowered fallback and cuDNN for one cell."""
    fns = {impl: (lambda q, k, v, impl=impl: flash_attention(
        q, k, v, causal=causal, window_size=window, implementation=impl))
        for impl in ("pallas", "pallas_triton")}
    fns["jax.nn/cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn",
        local_window_size=None if window == (-1, -1) else window)
    return fns


def domain(args, record, path):
    """The --domain cells: Mosaic vs the Triton-lowered fallback vs cuDNN, fwd and bwd."""
    record["domain_cells"] = []
    labels = args.cells.split(";") if args.cells else list(DOMAIN)
    for label in labels:
        if time.time() - args.started > args.budget:
            print("budget spent: stopping", flush=True)
            break
        seqlen, d, causal, window = DOMAIN[label]
        q, k, v, dout = inputs(seqlen, d, args.tokens)
        left, right = window[0], 0 if causal else window[1]
        fl = 4 * q.shape[0] * q.shape[2] * d * visible_pairs(seqlen, left, right)
        row = {"cell": label, "seqlen": seqlen, "head_dim": d, "causal": causal,
               "window": window, "batch": q.shape[0], "nheads": q.shape[2]}
        for name, fn in domain_fns(causal, window).items():
            if name == "pallas_triton" and label.startswith("aligned"):
                continue  # the aligned cells ran Mosaic before too
            try:
                t_fwd, t_bwd = measure(fn, q, k, v, dout)
                row[name] = {"fwd_ms": t_fwd, "fwd_tflops": fl / t_fwd / 1e9, "bwd_ms": t_bwd,
                             "bwd_tflops": 2.5 * fl / t_bwd / 1e9}
            except Exception as err:  # cuDNN refuses some cells: say so
                row[name] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
        mine = row["pallas"]
        for name in ("pallas_triton", "jax.nn/cudnn"):
            if "fwd_ms" in mine and "fwd_ms" in row.get(name, {}):
                mine[f"fwd_speedup_vs_{name.split('/')[-1]}"] = row[name]["fwd_ms"] / mine[
                    "fwd_ms"]
                mine[f"bwd_speedup_vs_{name.split('/')[-1]}"] = row[name]["bwd_ms"] / mine[
                    "bwd_ms"]
        record["domain_cells"].append(row)
        print(json.dumps(row), flush=True)
        with open(path, "w") as f:
            json.dump(record, f, indent=1)


def grid(args):
    """(seqlen, causal, head dim) cells, seqlen outermost: a budget cut drops whole seqlens."""
    return [(seqlen, causal, d) for seqlen in (int(s) for s in args.seqlens.split(","))
            for causal in (bool(int(c)) for c in args.causal.split(","))
            for d in (int(x) for x in args.head_dims.split(","))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    ap.add_argument("--fori-max", type=int, default=2048)
    ap.add_argument("--port-max", type=int, default=4096)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--mosaic-cells", action="store_true")
    ap.add_argument("--no-persistent", action="store_true",
                    help="--mosaic-cells: leave out the persistent tiles")
    ap.add_argument("--shipped", action="store_true",
                    help="--mosaic-cells: only the tile flashkit.jax.mosaic.TILES picks")
    ap.add_argument("--mosaic-bwd", action="store_true")
    ap.add_argument("--dtypes", default="bfloat16", help="--mosaic-bwd: bfloat16,float16")
    ap.add_argument("--triton-bwd", action="store_true",
                    help="--mosaic-bwd: also time the Triton-lowered backward")
    ap.add_argument("--domain", action="store_true")
    ap.add_argument("--cells", default="", help="--domain: labels separated by ';'")
    ap.add_argument("--sweep-seqlen", type=int, default=8192)
    ap.add_argument("--budget", type=float, default=float("inf"))
    args = ap.parse_args()
    head_dims = [int(x) for x in args.head_dims.split(",")]
    args.started = time.time()
    record = {**environment(), "dtype": "bfloat16", "tokens": args.tokens, "width": WIDTH,
              "timing": "median of 7 x ~20 ms loops, block_until_ready; bwd = VJP alone",
              "results": []}
    if args.sweep:
        record["tiles"], record["sweep"] = sweep(head_dims, args.tokens, args.sweep_seqlen)
    record["tiles_used"] = {w: {str(d): pallas.TILES[w][d] for d in head_dims}
                            for w in ("fwd", "bwd")}
    try:
        from flashkit.jax import mosaic

        record["mosaic_tiles"] = {f"d{d} {'causal' if c else 'full'}": [
            (bound, dataclasses.asdict(t)) for bound, t in entries]
            for (d, c), entries in mosaic.TILES.items()}
        record["mosaic_forward"] = mosaic.is_hopper()
    except ImportError as err:
        record["mosaic_forward"] = f"unavailable: {err}"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"jax_{record['date'][:10]}.json")
    print(json.dumps({k: v for k, v in record.items() if k != "results"}), flush=True)
    if args.mosaic_bwd:
        path = path.replace(".json", "_mosaic_bwd.json")
        mosaic_bwd(args, record, path)
        print(f"wrote {path}")
        return
    if args.domain:
        path = path.replace(".json", f"_domain_{record['date'][11:16].replace(':', '')}.json")
        domain(args, record, path)
        print(f"wrote {path}")
        return
    if args.mosaic_cells:
        mosaic_cells(args, record, path)
        print(f"wrote {path}")
        return

    for seqlen, causal, d in grid(args):
        if time.time() - args.started > args.budget:
            print("budget spent: stopping", flush=True)
            break
        q, k, v, dout = inputs(seqlen, d, args.tokens)
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
                if "bwd_ms" in r:
                    r["bwd_vs_cudnn"] = ref["bwd_ms"] / r["bwd_ms"]
        if "fwd_ms" in row.get("fori", {}) and "fwd_ms" in row.get("xla", {}):
            row["vmap_speedup_over_fori"] = {
                w: row["fori"][f"{w}_ms"] / row["xla"][f"{w}_ms"] for w in ("fwd", "bwd")}
        record["results"].append(row)
        print(json.dumps(row), flush=True)
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
