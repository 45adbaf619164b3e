"""differential: the Triton backend against the float64 oracle on 2,400 random cases (GPU).

    PYTHONPATH=src python3 benchmarks/run.py differential [--out DIR]          # GPU, < 6 min
    PYTHONPATH=src python3 benchmarks/suites/differential.py --cases 12 --variants 12 \
        --out /tmp/diff                                      # CPU smoke run (the interpreter)

Cases are drawn (seeded) from a fixed set of variants, each a shape bucket with the flags the
kernels compile on (dtype, head dims, window kind, softcap, ALiBi, sink, dropout, varlen; for
the kv cache: paging, rotary, cache_batch_idx, leftpad, appends, splits). A variant compiles once;
its cases vary what does not recompile (the data, the scale, the softcap value, slopes, sinks,
window widths, dropout seeds and rates, cache lengths and indices). A case passes when, for every
output and gradient,

    max|triton - oracle| <= factor * max|torch_in_t - oracle| + 1e-5

with factor 2 for out / lse (and the appended cache) and 3 for dq, dk, dv, dsink; the oracle is
flashkit.reference in float64, torch_in_t the same materialised math in the inputs' dtype, and
problems with at most 256 output elements add flash-attn's rounding term (docs/design.md
section 5). Dropout cases hand the oracle the keep-mask the kernels drew. Results: DIR/<date>_
<device>.json (counts per feature, every failure with its case; common.Result) and .md.
"""

from __future__ import annotations

import argparse
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

from common import Result, add_out_argument, log, table  # noqa: E402

import flashkit
from flashkit import reference
from flashkit.api import draw_dropout_seed
from flashkit.testing import dropout_keep_mask, max_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (batch, seqlen_q, seqlen_k, nheads, nheads_k): q != k lengths both ways, seqlen 1, MQA / GQA
DENSE_BUCKETS = ((2, 113, 203, 4, 2), (1, 1, 300, 8, 1), (3, 64, 64, 2, 2), (1, 203, 113, 6, 6),
                 (2, 17, 1, 4, 4), (1, 1000, 1000, 2, 1))
# (lengths_q, lengths_k, nheads, nheads_k): sequences of length 0 and 1
VARLEN_BUCKETS = ((((0, 1, 37, 113), (5, 0, 64, 120)), 4, 2), (((17, 1, 64), (17, 203, 1)), 2, 2),
                  (((1, 1, 1, 1, 1), (300, 1, 0, 17, 64)), 8, 1))
HEAD_DIMS = ((64, 64), (128, 128), (40, 40), (96, 96), (33, 33), (80, 80), (256, 256), (16, 16),
             (72, 40))
# (batch, seqlen_q, capacity or pages x page_size, nheads, nheads_k, head_dim)
KV_BUCKETS = ((3, 1, 256, 8, 2, 128), (2, 4, 512, 4, 4, 64), (4, 1, 1024, 8, 1, 64),
              (2, 7, 256, 6, 2, 80))
WINDOWS = ("none", "causal", "sliding", "left", "huge")
SMALL_PROBLEM = 256  # output elements at most: add the rounding term


def window_for(kind: str, rng: random.Random) -> tuple[tuple[int, int], bool]:
    """(window_size, causal) of a window kind; widths vary per case."""
    if kind == "causal":
        return (-1, -1), True
    if kind == "sliding":
        return (rng.randint(0, 80), rng.randint(0, 40)), False
    if kind == "left":
        return (rng.randint(0, 120), -1), rng.random() < 0.5
    if kind == "huge":
        big = 2**31 - 1 - rng.randint(0, 8)
        return rng.choice([(-1, big), (big, big), (0, big), (big, 0)]), False
    return (-1, -1), False


def make_variants(rng: random.Random, count: int, smoke: bool) -> list[dict]:
    """The compiled configurations cases are drawn from."""
    variants = []
    for n in range(count):
        kind = ("dense", "dense", "varlen", "kvcache")[n % 4]
        dtype = DTYPES[n % 3] if not smoke else torch.float32
        v = dict(kind=kind, dtype=dtype, window=rng.choice(WINDOWS),
                 softcap=rng.random() < 0.3, alibi=rng.random() < 0.3, sink=rng.random() < 0.3)
        if kind == "kvcache":
            v.update(bucket=rng.choice(KV_BUCKETS), page=rng.choice([None, None, 16, 64, 256]),
                     rotary=rng.choice([None, None, True, False]),
                     batch_idx=rng.random() < 0.3, leftpad=rng.random() < 0.3,
                     seqlen_new=rng.choice([0, 1, 3]), splits=rng.choice([0, 1, 3]))
            if v["page"] is not None:
                v.update(batch_idx=False, leftpad=False)
        else:
            v.update(head_dims=rng.choice(HEAD_DIMS), dropout=rng.random() < 0.2,
                     bucket=rng.choice(DENSE_BUCKETS if kind == "dense" else VARLEN_BUCKETS))
        if smoke:  # interpreter: tiny shapes
            v["bucket"] = {"dense": (1, 5, 7, 2, 1), "varlen": (((0, 1, 3), (2, 0, 5)), 2, 1),
                           "kvcache": (2, 1, 64, 2, 1, 16)}[kind]
            v["head_dims"] = (16, 16)
            if kind == "kvcache" and v["page"] not in (None, 16):
                v["page"] = 16
        variants.append(v)
    return variants


def rounding_term(ref: torch.Tensor, dtype: torch.dtype) -> float:
    r = ref.to(dtype)
    return 2 * max_error((r + 0.3 - 0.3).double(), r.double())


def compare(name, got, oracle, baseline, factor, dtype, failures, small):
    err, base = max_error(got, oracle), max_error(baseline, oracle)
    bound = factor * base + 1e-5 + (rounding_term(oracle, dtype) if small else 0.0)
    if not (err <= bound):  # NaN counts as failure
        failures.append(f"{name}: max error {err:.3e} > bound {bound:.3e} (baseline {base:.3e})")


def attention_case(v: dict, rng: random.Random, case_seed: int) -> list[str]:
    """One dense or varlen case; returns its failures."""
    dtype = v["dtype"]
    d, dv = v["head_dims"]
    window, causal = window_for(v["window"], rng)
    if v["kind"] == "dense":
        batch, sq, sk, h, hk = v["bucket"]
        shapes = ((batch, sq, h, d), (batch, sk, hk, d), (batch, sk, hk, dv))
        varlen = {}
        mask_shape = (batch, h, sq, sk)
    else:
        (lq, lk), h, hk = v["bucket"]
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
    sink = torch.randn(h, device=DEVICE) if v["sink"] else None
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
    small = got[0].numel() <= SMALL_PROBLEM
    for name, g, o, b in zip(("out", "lse", "dq", "dk", "dv", "dsink"), got, oracle, baseline,
                             strict=False):
        compare(name, g, o, b, 2 if name in ("out", "lse") else 3, dtype, failures, small)
    return failures


def kvcache_case(v: dict, rng: random.Random, case_seed: int) -> list[str]:
    """One flash_attn_with_kvcache case (append, rotary, paging, indices); returns failures."""
    dtype = v["dtype"]
    batch, sq, capacity, h, hk, d = v["bucket"]
    new = v["seqlen_new"]
    window, causal = window_for(v["window"], rng)
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
    kwargs = dict(cache_seqlens=seqlens, block_table=table, causal=causal, window_size=window,
                  softcap=rng.uniform(1.0, 30.0) if v["softcap"] else 0.0,
                  num_splits=v["splits"], return_softmax_lse=True)
    if v["batch_idx"]:
        kwargs["cache_batch_idx"] = torch.randperm(cache_shape[0], device=DEVICE)[:batch].to(
            torch.int32)
    if v["leftpad"]:
        kwargs["cache_leftpad"] = (torch.rand(batch, device=DEVICE) * seqlens).to(torch.int32)
    if v["alibi"]:
        kwargs["alibi_slopes"] = torch.rand(h, device=DEVICE) * 0.5
    q = torch.randn(batch, sq, h, d, device=DEVICE).to(dtype)
    k_new = v_new = None
    if new:
        k_new, v_new = (torch.randn(batch, new, hk, d, device=DEVICE).to(dtype) for _ in range(2))
    rotary = {}
    if v["rotary"] is not None and new:
        rot = rng.choice([d // 2, d]) // 2 * 2
        angles = torch.rand(capacity + sq, rot // 2, device=DEVICE) * 6.28
        rotary = dict(rotary_cos=angles.cos(), rotary_sin=angles.sin(),
                      rotary_interleaved=v["rotary"])
    sink = torch.randn(h, device=DEVICE) if v["sink"] else None

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
    small = got[0].numel() <= SMALL_PROBLEM
    for name, g, o, b in zip(("out", "lse", "k_cache", "v_cache"), got, oracle, baseline,
                             strict=True):
        compare(name, g, o, b, 2, dtype, failures, small)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(parser, "differential")
    parser.add_argument("--cases", type=int, default=2400, help="cases to draw (default 2400)")
    parser.add_argument("--variants", type=int, default=32,
                        help="compiled configurations the cases share (default 32)")
    parser.add_argument("--budget", type=float, default=330.0,
                        help="stop drawing cases after this many seconds (default 330)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    smoke = DEVICE == "cpu"
    rng = random.Random(args.seed)
    variants = make_variants(rng, args.variants, smoke)
    result = Result("differential", args.out, config=dict(
        cases=args.cases, variants=args.variants, budget=args.budget, seed=args.seed,
        device="cuda" if not smoke else "cpu (interpreter)"))
    counts, passed = Counter(), Counter()
    failures = []
    start = time.perf_counter()
    ran = 0
    for n in range(args.cases):
        if time.perf_counter() - start > args.budget:
            break
        v = variants[n % len(variants)]
        case_seed = args.seed * 1_000_003 + n
        try:
            fails = (kvcache_case if v["kind"] == "kvcache" else attention_case)(
                v, random.Random(case_seed), case_seed)
        except Exception as e:  # a crash is a failure of the case, recorded with its variant
            fails = [f"raised {type(e).__name__}: {str(e)[:300]}"]
        ran += 1
        for tag in features(v):
            counts[tag] += 1
            passed[tag] += not fails
        if fails:
            failures.append(dict(case=n, seed=case_seed, variant=describe(v), failures=fails))
            log(f"case {n} {features(v)}: {fails[0]}")
    elapsed = time.perf_counter() - start
    per_feature = [dict(feature=t, cases=c, passed=passed[t]) for t, c in sorted(counts.items())]
    result.save("summary", dict(cases_run=ran, failed=len(failures), seconds=round(elapsed, 1),
                                variants=len(variants)))
    result.save("per_feature", per_feature)
    result.save("failures", failures[:200])
    result.markdown(f"# differential\n\n{ran} cases in {elapsed:.0f} s, {len(failures)} "
                    f"failed\n\n" + table(per_feature, ["feature", "cases", "passed"]))
    log(f"differential: {ran} cases in {elapsed:.0f} s, {len(failures)} failed -> "
        f"{result.path}")
    return 0 if not failures and ran >= min(args.cases, 2000) else 1


if __name__ == "__main__":
    sys.exit(main())
