"""The JAX/TPU write-up's baselines, timed here, with its TPU ratios set beside ours.

The write-up (a port of FlashAttention to JAX on a TPU v5e, float32, one causal head (n, 64))
times five ways to compute attention:

    nojit     every op its own eager dispatch, block_until_ready between them
    unfused   three jitted steps (scores, softmax, output), block_until_ready between them, so
              the (n, n) scores and weights go to memory and back
    fused     the whole softmax(q k^T / sqrt(d)) v under one jax.jit: XLA fuses what it can
    fori      the write-up's first flash attention: a fori_loop over query tiles
    vmap      its fix: the same tiles under vmap (flashkit.jax implementation="xla")

and finds, on the TPU, fusion worth 6-15x, the fori flash 35x slower than fused at 4k, the vmap
flash 14x faster than fori at 4k and ahead of fused once the scores outgrow VMEM (8k).

Why a GPU gives other ratios: a TPU's 128 MB of VMEM holds the whole float32 score matrix up
to n = 4096, so a fused XLA program keeps it on chip; a GPU SM has 228 KiB, so on a GPU XLA's
"fused" attention still runs the two matmuls as separate GEMMs with the scores and weights in
HBM (only the softmax is fused), and fusion buys much less. Per-op dispatch also costs a GPU
tens of microseconds, not the TPU's ~0.3 ms, so nojit hurts less at small n. The flash ports
are XLA loops over tiles, not fused kernels, on either machine.

    PYTHONPATH=src python3 benchmarks/run.py jax --baselines --out DIR
    flashkit bench --jax-baselines --seqlens 512,1k,2k,4k,8k,16k
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from flashkit.experiments import results

METHODS = ("nojit", "unfused", "fused", "fori", "vmap")

# The write-up's TPU v5e figures (ms): n -> method -> ms (None: out of memory).
PAPER_MS = {
    512: {"nojit": 1.390, "unfused": 0.475, "fused": 0.076, "fori": 0.082, "vmap": 0.065},
    1024: {"nojit": 1.504, "unfused": 0.497, "fused": 0.055, "fori": 0.133, "vmap": 0.079},
    2048: {"nojit": 1.737, "unfused": 0.651, "fused": 0.067, "fori": 0.522, "vmap": 0.083},
    4096: {"nojit": 3.016, "unfused": 1.038, "fused": 0.072, "fori": 2.509, "vmap": 0.178},
    8192: {"nojit": 7.385, "unfused": 2.834, "fused": 1.189, "fori": 14.052, "vmap": 0.587},
    16384: {"nojit": 25.576, "unfused": 10.110, "fused": 4.445, "fori": 89.567, "vmap": 1.997},
    32768: {"nojit": None, "unfused": None, "fused": 17.123, "fori": 103.016, "vmap": None},
}
RATIOS = (("unfused", "fused"), ("nojit", "fused"), ("fori", "fused"), ("vmap", "fused"),
          ("fori", "vmap"))


def implementations():
    """name -> f(q, k, v) on one head (n, d), causal, float32 like the write-up."""
    import jax
    import jax.numpy as jnp

    from flashkit.jax import flash_attention

    def mask(n):
        return jnp.triu(jnp.ones((n, n), dtype=bool), k=1)  # True above the diagonal: hidden

    def scores(q, k):
        s = (q @ k.T) * (1.0 / math.sqrt(q.shape[-1]))
        return jnp.where(mask(q.shape[0]), -jnp.inf, s)

    def softmax(s):
        return jax.nn.softmax(s, axis=-1)

    def output(w, v):
        return w @ v

    steps = [jax.jit(f) for f in (scores, softmax, output)]

    def nojit(q, k, v):
        s = (q @ k.T).block_until_ready()
        s = (s * (1.0 / math.sqrt(q.shape[-1]))).block_until_ready()
        s = jnp.where(mask(q.shape[0]), -jnp.inf, s).block_until_ready()
        w = softmax(s).block_until_ready()
        return output(w, v)

    def unfused(q, k, v):
        s = steps[0](q, k).block_until_ready()
        w = steps[1](s).block_until_ready()
        return steps[2](w, v)

    fused = jax.jit(lambda q, k, v: output(softmax(scores(q, k)), v))

    def flash(implementation):
        def call(q, k, v):
            out = flash_attention(q[None, :, None], k[None, :, None], v[None, :, None],
                                  causal=True, implementation=implementation)
            return out[0, :, 0]
        return jax.jit(call)

    return {"nojit": nojit, "unfused": unfused, "fused": fused, "fori": flash("fori"),
            "vmap": flash("xla")}


def time_ms(fn, *args, rounds: int = 5) -> float:
    """Min over rounds of the mean of enough calls to fill ~20 ms, after a warm-up (compile)."""
    import jax
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = max(1, min(100, int(0.02 / max(time.perf_counter() - start, 1e-6))))
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) * 1e3 / calls)
    return min(samples)


def measure(seqlens, d: int = 64, fori_max: int = 8192, rounds: int = 5) -> dict:
    """n -> method -> ms (None where skipped or out of memory), plus the largest output error
    of each method against float64 materialised attention at the smallest n."""
    import jax
    import numpy as np

    fns = implementations()
    times, errors = {}, {}
    for n in seqlens:
        rng = np.random.default_rng(n)
        q, k, v = (jax.numpy.asarray(rng.normal(size=(n, d)), dtype=jax.numpy.float32)
                   for _ in range(3))
        times[n] = {}
        for name, fn in fns.items():
            if name == "fori" and n > fori_max:
                times[n][name] = None
                continue
            try:
                times[n][name] = time_ms(fn, q, k, v, rounds=rounds)
            except Exception as error:  # noqa: BLE001 - running out of memory is a result
                if "RESOURCE_EXHAUSTED" not in str(error) and "out of memory" not in str(error):
                    raise
                times[n][name] = None
            if n == min(seqlens):
                errors[name] = _error(np.asarray(fn(q, k, v)), *(np.asarray(t) for t in (q, k, v)))
    return {"ms": times, "max_error_at_smallest_n": errors}


def _error(out, q, k, v) -> float:
    import numpy as np
    n = q.shape[0]
    s = (q.astype(np.float64) @ k.T.astype(np.float64)) / math.sqrt(q.shape[1])
    s[np.triu(np.ones((n, n), dtype=bool), 1)] = -np.inf
    w = np.exp(s - s.max(1, keepdims=True))
    expected = (w / w.sum(1, keepdims=True)) @ v.astype(np.float64)
    return float(np.abs(out - expected).max())


def _ratio(ms: dict, a: str, b: str) -> str:
    if ms.get(a) is None or ms.get(b) is None:
        return "-"
    return f"{ms[a] / ms[b]:.1f}x"


def table(times: dict) -> tuple[list[str], list[list]]:
    """Ours in ms, then each ratio as the write-up's TPU / ours."""
    header = ["n", *(f"{m} ms" for m in METHODS),
              *(f"{a}/{b} TPU / ours" for a, b in RATIOS)]
    rows = []
    for n, ms in times.items():
        paper = PAPER_MS.get(n, {})
        rows.append([n, *(f"{ms[m]:.3f}" if ms.get(m) is not None else "-" for m in METHODS),
                     *(f"{_ratio(paper, a, b)} / {_ratio(ms, a, b)}" for a, b in RATIOS)])
    return header, rows


def run(seqlens, out: Path, d: int = 64, fori_max: int = 8192) -> dict:
    """Time the baselines, print them beside the write-up's ratios, write jax_baselines.json."""
    import jax

    out = results.output_dir(out)
    measured = measure(seqlens, d, fori_max)
    header, rows = table(measured["ms"])
    device = jax.devices()[0]
    print(f"\nOne causal head (n, {d}), float32, on {getattr(device, 'device_kind', device)}; ms "
          "(min over 5 rounds), then each ratio as the TPU v5e write-up's / ours:")
    print(results.text_table(header, rows))
    print("max |error| vs float64 at n = "
          f"{min(seqlens)}: " + ", ".join(f"{m} {e:.1e}" for m, e in
                                         measured["max_error_at_smallest_n"].items()))
    print("\nWhy a GPU gives other ratios: " + __doc__.split("Why a GPU gives other ratios: ")[1]
          .split("\n\n")[0].replace("\n", " "))
    data = {"environment": {**results.environment("cpu"), "jax": jax.__version__,
                            "jax_device": str(getattr(device, "device_kind", device)),
                            "jax_backend": jax.default_backend()},
            "config": {"seqlens": list(seqlens), "d": d, "dtype": "float32", "causal": True,
                       "fori_max": fori_max},
            "paper_ms": PAPER_MS, **measured}
    path = results.write_json(out / "jax_baselines.json", data)
    return {**data, "files": [path], "markdown": results.markdown_table(header, rows)}
