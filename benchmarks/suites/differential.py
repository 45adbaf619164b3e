"""differential: the Triton backend against the float64 oracle on 2,400 random cases (GPU).

    PYTHONPATH=src python3 benchmarks/run.py differential [--out DIR]          # GPU, < 5 min
    PYTHONPATH=src python3 benchmarks/suites/differential.py --cases 32 --out /tmp/diff
                                                   # CPU smoke run (the interpreter, tiny shapes)

Cases are drawn (seeded) from a fixed list of buckets. A bucket fixes everything a kernel
compiles on: the dtype, head dims, shapes and lengths (Triton specialises every integer argument
on == 1 and on divisibility by 16, so a length, stride or batch size that moves between those
classes is a new compile), the window kind and the flags (softcap, ALiBi, sink, dropout, varlen;
for the kv cache: paging, rotary, cache_batch_idx, leftpad, appended tokens, splits). Its cases
vary only what does not recompile: the data, the scale, the softcap value, slopes, sinks,
dropout seeds and rates, varlen sequence lengths (cu_seqlens is a tensor; total and longest
stay fixed), cache lengths and indices, and window widths drawn from one residue class mod 16
per side (never 0, 1 or a multiple of 16, always below the length so the side stays bounded).

Phase one warms every bucket with its first case (the compiles; timed apart, and counted from
Triton's jit_cache_hook on the GPU, from the interpreter's launches on the CPU). Phase two
draws the remaining cases round-robin over the buckets and reports any compile it still sees.
A case passes when, for every output and gradient,

    max|triton - oracle| <= factor * max|torch_in_t - oracle| + 1e-5

with factor 2 for out / lse (and the appended cache) and 3 for dq, dk, dv, dsink; the oracle is
flashkit.reference in float64, torch_in_t the same materialised math in the inputs' dtype, and
outputs of at most flashkit.testing.TINY elements (dsink: one per head) add flash-attn's
rounding term (docs/design.md section 5). Dropout cases hand the oracle the keep-mask the
kernels drew. Results: DIR/<date>_
<device>.json (buckets with compiles and seconds, counts per feature, every failure with its
case; common.Result) and .md. Exit status 1 when a case failed or fewer cases than --cases ran
(the time budget ran out; the log says so).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import random
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

if not torch.cuda.is_available():  # before any kernel is decorated: the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common import Result, add_out_argument, log, name_list, table  # noqa: E402

import flashkit
from flashkit import reference
from flashkit.api import draw_dropout_seed
from flashkit.testing import TINY, dropout_keep_mask, max_error, rounding_term

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def attention_bucket(kind, dtype, head_dims, shape, window, **flags) -> dict:
    """A dense bucket: shape (batch, seqlen_q, seqlen_k, nheads, nheads_k); varlen: shape
    (sequences, total_q, max_q, total_k, max_k, nheads, nheads_k)."""
    return dict(kind=kind, dtype=dtype, head_dims=head_dims, shape=shape, window=window,
                softcap=flags.get("softcap", False), alibi=flags.get("alibi", False),
                sink=flags.get("sink", False), dropout=flags.get("dropout", False))


def kv_bucket(dtype, shape, window, page, rotary, new, splits, **flags) -> dict:
    """shape (batch, seqlen_q, capacity, nheads, nheads_k, head_dim); rotary None (off), True
    (interleaved) or False, on half the head dim; page None (contiguous cache) or a page size."""
    return dict(kind="kvcache", dtype=dtype, shape=shape, window=window, page=page,
                rotary=rotary, seqlen_new=new, splits=splits,
                batch_idx=flags.get("batch_idx", False), leftpad=flags.get("leftpad", False),
                softcap=flags.get("softcap", False), alibi=flags.get("alibi", False),
                sink=flags.get("sink", False))


# Dense and varlen buckets: q != k lengths both ways, seqlen 1, MQA / GQA, sequences of length
# 0 and 1, head dims 16..256 (the plain fp16/bf16 ones at 64/128 take the Gluon kernels on sm_90).
# About 3-4 compiles each (forward, dQ, dK/dV, the dropout mask), 2-3 per kv
# bucket (append, decode, split combine): ~60 in all.
GPU_BUCKETS = (
    attention_bucket("dense", F16, (64, 64), (2, 113, 203, 4, 2), "none"),
    attention_bucket("dense", BF16, (128, 128), (2, 203, 113, 4, 4), "causal"),
    attention_bucket("dense", BF16, (128, 128), (1, 300, 300, 8, 1), "sliding", softcap=True,
                     alibi=True),
    attention_bucket("dense", F32, (40, 40), (3, 64, 64, 2, 2), "left", sink=True),
    attention_bucket("dense", F16, (96, 96), (1, 1, 300, 8, 1), "huge", softcap=True),
    attention_bucket("dense", BF16, (72, 40), (2, 17, 1, 4, 4), "causal", dropout=True),
    attention_bucket("dense", F16, (256, 256), (1, 259, 259, 2, 1), "causal", sink=True),
    attention_bucket("dense", BF16, (64, 64), (2, 113, 203, 4, 2), "sliding", dropout=True),
    attention_bucket("dense", F32, (80, 80), (1, 203, 113, 6, 6), "left_causal", alibi=True,
                     softcap=True),
    attention_bucket("varlen", BF16, (128, 128), (4, 151, 113, 189, 120, 4, 2), "causal",
                     alibi=True),
    attention_bucket("varlen", F16, (33, 33), (3, 82, 64, 221, 203, 2, 2), "left", softcap=True,
                     sink=True),
    attention_bucket("varlen", F32, (16, 16), (5, 5, 1, 382, 300, 8, 1), "none", dropout=True),
    kv_bucket(BF16, (3, 1, 256, 8, 2, 128), "none", None, True, 1, 0, batch_idx=True),
    kv_bucket(F16, (2, 4, 512, 4, 4, 64), "sliding", 16, False, 3, 3, alibi=True),
    kv_bucket(F32, (4, 1, 1024, 8, 1, 64), "left", None, None, 0, 1, leftpad=True, softcap=True,
              sink=True),
    kv_bucket(BF16, (2, 7, 256, 6, 2, 80), "causal", 64, None, 0, 0),
    attention_bucket("dense", F16, (128, 128), (2, 200, 200, 4, 2), "causal", sink=True),
)


def smoke_bucket(v: dict) -> dict:
    """The interpreter's tiny version of a bucket: the same kind, window and flags, float32."""
    v = dict(v, dtype=F32)
    if v["kind"] == "dense":
        v.update(shape=(1, 5, 7, 2, 1), head_dims=(16, 16))
    elif v["kind"] == "varlen":
        v.update(shape=(3, 5, 3, 9, 6, 2, 1), head_dims=(16, 16))
    else:
        v.update(shape=(2, 1, 64, 2, 1, 16), page=None if v["page"] is None else 16)
    return v


def buckets(smoke: bool) -> list[dict]:
    """The buckets with their residue classes (mod 16) of the bounded window sides."""
    out = []
    for n, v in enumerate(GPU_BUCKETS):
        v = smoke_bucket(v) if smoke else dict(v)
        v.update(name=f"b{n:02d}", residues=(2 + (3 * n) % 14, 2 + (5 * n + 7) % 14))
        out.append(v)
    return out


def window_width(residue: int, bound: int, rng: random.Random) -> int:
    """A width in the residue class (mod 16) below bound - 1 (so the side stays bounded; Triton
    compiles a new kernel when an integer argument changes between 1, multiples of 16 and the
    rest). The tiny smoke shapes fall back to 2."""
    top = bound - 2
    if residue > top:
        return min(2, max(top, 0))
    return residue + 16 * rng.randint(0, (top - residue) // 16)


def window_for(v: dict, seqlen_q: int, seqlen_k: int, rng: random.Random):
    """(window_size, causal) of a case: the bucket's window kind, widths varying per case."""
    kind, (r_left, r_right) = v["window"], v["residues"]
    if kind == "causal":
        return (-1, -1), True
    if kind == "sliding":
        return (window_width(r_left, seqlen_k, rng), window_width(r_right, seqlen_q, rng)), False
    if kind in ("left", "left_causal"):
        return (window_width(r_left, seqlen_k, rng), -1), kind == "left_causal"
    if kind == "huge":  # both sides reach every key: passed as unbounded, whatever the spelling
        big = 2**31 - 1 - rng.randint(0, 8)
        return rng.choice([(-1, big), (big, big), (big, -1)]), False
    return (-1, -1), False


def varlen_lengths(count: int, total: int, longest: int, rng: random.Random) -> list[int]:
    """count lengths summing to total, the largest exactly longest (so max_seqlen, the packed
    shapes and the compile key stay fixed), zeros and ones allowed."""
    while True:
        cuts = sorted(rng.randint(0, total - longest) for _ in range(count - 2))
        rest = [b - a for a, b in zip([0, *cuts], [*cuts, total - longest], strict=True)]
        if max(rest) <= longest:
            lengths = [longest, *rest]
            rng.shuffle(lengths)
            return lengths


def compare(name, got, oracle, baseline, factor, dtype, failures):
    """docs/design.md section 5's rule, as flashkit.testing.assert_close_to_oracle applies it: a
    tensor of at most TINY elements (dsink has one per head) adds the rounding term, since its
    baseline can be exact by luck."""
    err, base = max_error(got, oracle), max_error(baseline, oracle)
    bound = factor * base + 1e-5 + (rounding_term(oracle, dtype) if got.numel() <= TINY else 0.0)
    if not (err <= bound):  # NaN counts as failure
        failures.append(f"{name}: max error {err:.3e} > bound {bound:.3e} (baseline {base:.3e})")


def attention_case(v: dict, rng: random.Random, case_seed: int) -> list[str]:
    """One dense or varlen case; returns its failures."""
    dtype = v["dtype"]
    d, dv = v["head_dims"]
    if v["kind"] == "dense":
        batch, sq, sk, h, hk = v["shape"]
        window, causal = window_for(v, sq, sk, rng)
        shapes = ((batch, sq, h, d), (batch, sk, hk, d), (batch, sk, hk, dv))
        varlen = {}
        mask_shape = (batch, h, sq, sk)
    else:
        count, total_q, max_q, total_k, max_k, h, hk = v["shape"]
        lq = varlen_lengths(count, total_q, max_q, rng)
        lk = varlen_lengths(count, total_k, max_k, rng)
        window, causal = window_for(v, max_q, max_k, rng)
        shapes = ((sum(lq), h, d), (sum(lk), hk, d), (sum(lk), hk, dv))
        cu = [torch.tensor([0, *itertools.accumulate(x)], dtype=torch.int32, device=DEVICE)
              for x in (lq, lk)]
        varlen = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
        mask_shape = (len(lq), h, max(lq), max(lk))
    scale = rng.choice([None, rng.uniform(0.05, 2.0)])
    kwargs = dict(softmax_scale=scale, causal=causal, window_size=window,
                  softcap=rng.uniform(1.0, 30.0) if v["softcap"] else 0.0)
    if v["alibi"]:
        kwargs["alibi_slopes"] = torch.rand(h, device=DEVICE) * 0.5
    torch.manual_seed(case_seed)
    q, k, val = (torch.randn(s, device=DEVICE).to(dtype) for s in shapes)
    dout = torch.randn(*shapes[0][:-1], dv, device=DEVICE).to(dtype)
    # in the tested dtype, as q, k, v: every run, the oracle's included, sees the same logits
    sink = torch.randn(h, device=DEVICE).to(dtype) if v["sink"] else None
    dropout_p = rng.choice([0.1, 0.3]) if v["dropout"] else 0.0

    def run(backend, cast, mask=None):
        ins = [t.to(cast).clone().requires_grad_() for t in (q, k, val)]
        s = None if sink is None else sink.to(cast).clone().requires_grad_()
        if backend == "triton":
            torch.manual_seed(case_seed)
            if v["kind"] == "dense":
                out, lse, _ = flashkit.flash_attn_func(
                    *ins, dropout_p=dropout_p, return_attn_probs=True, sink=s,
                    backend="triton", **kwargs)
            else:
                out, lse, _ = flashkit.flash_attn_varlen_func(
                    *ins, varlen["cu_seqlens_q"], varlen["cu_seqlens_k"], max(lq), max(lk),
                    dropout_p=dropout_p, return_attn_probs=True, sink=s, backend="triton",
                    **kwargs)
        else:
            out, lse = reference.attention(*ins, sink=s, dropout_p=dropout_p,
                                           dropout_mask=mask, **varlen, **kwargs)
        out.backward(dout.to(out.dtype))
        grads = [t.grad for t in ins] + ([s.grad] if s is not None else [])
        return [out.detach(), lse.detach()] + grads

    got = run("triton", dtype)
    mask = None
    if dropout_p > 0:
        torch.manual_seed(case_seed)
        mask = dropout_keep_mask(draw_dropout_seed(), *mask_shape, dropout_p, backend="triton",
                                 device=DEVICE)
    oracle = run("reference", torch.float64, mask)
    baseline = run("reference", dtype, mask)
    failures = []
    for name, g, o, b in zip(("out", "lse", "dq", "dk", "dv", "dsink"), got, oracle, baseline,
                             strict=False):
        compare(name, g, o, b, 2 if name in ("out", "lse") else 3, dtype, failures)
    return failures


def kvcache_case(v: dict, rng: random.Random, case_seed: int) -> list[str]:
    """One flash_attn_with_kvcache case (append, rotary, paging, indices); returns failures."""
    dtype = v["dtype"]
    batch, sq, capacity, h, hk, d = v["shape"]
    new = v["seqlen_new"]
    window, causal = window_for(v, sq, capacity, rng)
    torch.manual_seed(case_seed)
    page = v["page"]
    if page is None:
        batch_cache = batch + (2 if v["batch_idx"] else 0)
        cache_shape = (batch_cache, capacity, hk, d)
        table = None
    else:
        pages_per_seq = capacity // page
        cache_shape = (batch * pages_per_seq + 3, page, hk, d)
        table = torch.randperm(cache_shape[0], device=DEVICE)[:batch * pages_per_seq]
        table = table.view(batch, pages_per_seq).to(torch.int32)
    kc, vc = (torch.randn(cache_shape, device=DEVICE).to(dtype) for _ in range(2))
    seqlens = torch.randint(0, capacity - new + 1, (batch,), device=DEVICE, dtype=torch.int32)
    if rng.random() < 0.2:
        seqlens[0] = 0
    # the longest cache is full: the automatic split count and decode tile follow the longest
    # length, so it must not change between the bucket's cases
    seqlens[-1] = capacity - new
    kwargs = dict(cache_seqlens=seqlens, block_table=table, causal=causal, window_size=window,
                  softcap=rng.uniform(1.0, 30.0) if v["softcap"] else 0.0,
                  num_splits=v["splits"], return_softmax_lse=True)
    if v["batch_idx"]:
        kwargs["cache_batch_idx"] = torch.randperm(cache_shape[0], device=DEVICE)[:batch].to(
            torch.int32)
    if v["leftpad"]:
        kwargs["cache_leftpad"] = (torch.rand(batch, device=DEVICE) * seqlens).to(torch.int32)
        kwargs["cache_leftpad"][-1] = 0  # the full cache stays the longest (see seqlens)
    if v["alibi"]:
        kwargs["alibi_slopes"] = torch.rand(h, device=DEVICE) * 0.5
    q = torch.randn(batch, sq, h, d, device=DEVICE).to(dtype)
    k_new = v_new = None
    if new:
        k_new, v_new = (torch.randn(batch, new, hk, d, device=DEVICE).to(dtype) for _ in range(2))
    rotary = {}
    if v["rotary"] is not None and new:
        rot = d // 2 // 2 * 2  # fixed per bucket: the rotary width is a compile-time constant
        angles = torch.rand(capacity + sq, rot // 2, device=DEVICE) * 6.28
        rotary = dict(rotary_cos=angles.cos(), rotary_sin=angles.sin(),
                      rotary_interleaved=v["rotary"])
    sink = torch.randn(h, device=DEVICE).to(dtype) if v["sink"] else None

    def run(backend, cast):
        caches = [c.to(cast).clone() for c in (kc, vc)]
        news = [None if t is None else t.to(cast) for t in (k_new, v_new)]
        rot = {n: (t.to(cast) if isinstance(t, torch.Tensor) and cast == torch.float64 else t)
               for n, t in rotary.items()}
        with torch.no_grad():
            out, lse = flashkit.flash_attn_with_kvcache(
                q.to(cast), *caches, *news, sink=None if sink is None else sink.to(cast),
                backend=backend, **rot, **kwargs)
        return [out, lse, *caches]

    got = run("triton", dtype)
    oracle = run("reference", torch.float64)
    baseline = run("reference", dtype)
    failures = []
    for name, g, o, b in zip(("out", "lse", "k_cache", "v_cache"), got, oracle, baseline,
                             strict=True):
        compare(name, g, o, b, 2, dtype, failures)
    return failures


def describe(v: dict) -> dict:
    return {k: (str(x) if isinstance(x, torch.dtype) else x) for k, x in v.items()}


def features(v: dict) -> list[str]:
    tags = [v["kind"], str(v["dtype"]).replace("torch.", ""), f"window:{v['window']}"]
    tags += [f for f in ("softcap", "alibi", "sink", "dropout", "batch_idx", "leftpad")
             if v.get(f)]
    if v["kind"] == "kvcache":
        tags += [f"page:{v['page']}", f"rotary:{v['rotary']}", f"new:{v['seqlen_new']}",
                 f"splits:{v['splits']}"]
    else:
        tags.append(f"d:{v['head_dims'][0]}x{v['head_dims'][1]}")
    return tags


class CompileCounter:
    """Distinct (kernel, specialization) keys launched, per bucket. On the GPU: Triton's
    jit_cache_hook, called on every in-memory cache miss (each one a compile or a disk-cache
    load). In the interpreter nothing compiles, so the key Triton would use is rebuilt per
    launch: constexpr values, and per other argument its dtype, for integers whether it is 1
    or a multiple of 16 (the seeds and the dropout threshold are not specialised), for tensors
    whether the pointer is 16-byte aligned."""

    def __init__(self, interpreter: bool):
        self.seen: set = set()
        self.bucket = ""
        self.per_bucket: Counter = Counter()
        self.names: dict[str, list[str]] = {}
        if interpreter:
            from triton.runtime.interpreter import InterpretedFunction
            original = InterpretedFunction.run
            counter = self

            def run(fn, *args, grid, warmup, **kwargs):
                counter.note(fn.fn.__name__, counter.interpreter_key(fn, args, kwargs))
                return original(fn, *args, grid=grid, warmup=warmup, **kwargs)

            InterpretedFunction.run = run
        else:
            from triton import knobs

            def hook(*, key, fn, **_):
                self.note(fn.name, str(key))
                return False  # compile as usual

            knobs.runtime.jit_cache_hook = hook

    @staticmethod
    def interpreter_key(fn, args, kwargs) -> tuple:
        sig = inspect.signature(fn.fn)
        bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
        skip = set(fn.kwargs.get("do_not_specialize", ()) or ())
        key = []
        for name, param in sig.parameters.items():
            value = bound.arguments.get(name, param.default)
            if "constexpr" in str(param.annotation):
                key.append((name, value if not callable(value) else getattr(value, "__name__",
                                                                             str(value))))
            elif isinstance(value, bool) or value is None:
                key.append((name, value))
            elif isinstance(value, int):
                key.append((name, "int") if name in skip else (name, value == 1, value % 16 == 0))
            elif isinstance(value, float):
                key.append((name, "float"))
            elif isinstance(value, torch.Tensor):
                key.append((name, str(value.dtype), value.data_ptr() % 16 == 0))
            else:
                key.append((name, type(value).__name__))
        key += sorted((k, v) for k, v in kwargs.items() if k in ("num_warps", "num_stages"))
        return tuple(key)

    def note(self, kernel: str, key) -> None:
        if (kernel, key) not in self.seen:
            self.seen.add((kernel, key))
            self.per_bucket[self.bucket] += 1
            self.names.setdefault(self.bucket, []).append(kernel)


def case_seed_of(v: dict, n: int, seed: int) -> int:
    """The seed of case n of bucket v in a run of --seed seed (recorded with each failure:
    attention_case / kvcache_case(v, random.Random(s), s) repeats the case)."""
    return (seed * 1000 + int(v["name"][1:])) * 1_000_003 + n


def run_case(v: dict, case_seed: int) -> list[str]:
    """The case of bucket v drawn from case_seed; its failures (a crash is one, recorded with
    its bucket)."""
    try:
        return (kvcache_case if v["kind"] == "kvcache" else attention_case)(
            v, random.Random(case_seed), case_seed)
    except Exception as e:
        return [f"raised {type(e).__name__}: {str(e)[:300]}"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(parser, "differential")
    parser.add_argument("--cases", type=int, default=2400,
                        help="cases to draw, spread over the buckets (default 2400)")
    parser.add_argument("--budget", type=float, default=280.0,
                        help="stop drawing cases after this many seconds (default 280)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plan", action="store_true",
                        help="print the buckets and exit")
    parser.add_argument("--buckets", default="",
                        help="comma-separated bucket names (b00, b01, ...: see --plan) to draw "
                             "from; default all")
    args = parser.parse_args(argv)
    if args.cases < 1:
        parser.error("--cases must be at least 1")
    smoke = DEVICE == "cpu"
    plan = buckets(smoke)
    if args.buckets:
        wanted = name_list(parser, "--buckets", args.buckets, [v["name"] for v in plan])
        plan = [v for v in plan if v["name"] in wanted]
    if args.plan:
        for v in plan:
            log(f"{v['name']}: {' '.join(features(v))} shape {v['shape']} "
                f"window residues {v['residues']}")
        return 0
    counter = CompileCounter(interpreter=smoke)
    result = Result("differential", args.out, config=dict(
        cases=args.cases, buckets=len(plan), budget=args.budget, seed=args.seed,
        device="cuda" if not smoke else "cpu (interpreter, tiny shapes)"))
    counts, passed = Counter(), Counter()
    failures = []
    ran = Counter()
    seconds = Counter()

    def record(v, n, fails, took):
        ran[v["name"]] += 1
        seconds[v["name"]] += took
        for tag in features(v):
            counts[tag] += 1
            passed[tag] += not fails
        if fails:
            failures.append(dict(case=n, case_seed=case_seed_of(v, n, args.seed),
                                 bucket=v["name"], variant=describe(v), failures=fails))
            log(f"case {n} {v['name']} {features(v)}: {fails[0]}")

    start = time.perf_counter()
    warm = {}
    for v in plan:  # phase one: every bucket's first case, the compiles
        counter.bucket = v["name"]
        t = time.perf_counter()
        record(v, 0, run_case(v, case_seed_of(v, 0, args.seed)), 0.0)
        warm[v["name"]] = time.perf_counter() - t
        log(f"warm {v['name']}: {counter.per_bucket[v['name']]} compiles, "
            f"{warm[v['name']]:.1f} s")
    compile_seconds = time.perf_counter() - start
    compiles_warm = sum(counter.per_bucket.values())
    counter.bucket = "after warm-up"
    n, stopped = len(plan), None
    while n < args.cases:  # phase two: round-robin over the warm buckets
        if time.perf_counter() - start > args.budget:
            stopped = f"time budget of {args.budget:.0f} s spent"
            break
        v = plan[n % len(plan)]
        t = time.perf_counter()
        fails = run_case(v, case_seed_of(v, n, args.seed))
        record(v, n, fails, time.perf_counter() - t)
        n += 1
    total = sum(ran.values())
    elapsed = time.perf_counter() - start
    late = counter.per_bucket["after warm-up"]
    per_bucket = [dict(bucket=v["name"], features=" ".join(features(v)), shape=str(v["shape"]),
                       compiles=counter.per_bucket[v["name"]], warm_s=round(warm[v["name"]], 2),
                       cases=ran[v["name"]], check_s=round(seconds[v["name"]], 2))
                  for v in plan]
    per_feature = [dict(feature=t, cases=c, passed=passed[t]) for t, c in sorted(counts.items())]
    summary = dict(cases_run=total, failed=len(failures), seconds=round(elapsed, 1),
                   warm_up_seconds=round(compile_seconds, 1),
                   check_seconds=round(elapsed - compile_seconds, 1), buckets=len(plan),
                   compiles_warm_up=compiles_warm, compiles_after_warm_up=late,
                   late_compile_kernels=counter.names.get("after warm-up", [])[:20],
                   stopped_early=stopped)
    result.save("summary", summary)
    result.save("per_bucket", per_bucket)
    result.save("per_feature", per_feature)
    result.save("failures", failures[:200])
    head = (f"{total} cases in {elapsed:.0f} s ({compile_seconds:.0f} s warming {len(plan)} "
            f"buckets: {compiles_warm} compiles; {elapsed - compile_seconds:.0f} s checking, "
            f"{late} compiles after warm-up), {len(failures)} failed")
    result.markdown(f"# differential\n\n{head}\n\n"
                    + table(per_bucket, ["bucket", "features", "shape", "compiles", "warm_s",
                                         "cases", "check_s"])
                    + "\n" + table(per_feature, ["feature", "cases", "passed"]))
    log(f"differential: {head} -> {result.path}")
    if late:
        log(f"compiles after warm-up ({late}): {counter.names['after warm-up'][:20]}")
    if total < args.cases:
        log(f"only {total} of {args.cases} cases ran: {stopped}")
    return 0 if not failures and total >= args.cases else 1


if __name__ == "__main__":
    sys.exit(main())
