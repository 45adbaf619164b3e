"""What each kernel feature costs on the Triton backend (issue 4), with anchors in the same run.

    PYTHONPATH=src python3 benchmarks/bench_features.py --out DIR [--compile-only] [--jobs N]
        [--parts costs,costs_ab,window,varlen,varlen_ab,ragged] [--forward-only]
        [--cases full,dropout] [--tag _name]

Six parts, bf16, head dim 128, times from triton.testing.do_bench medians (bench_triton.bench):
    costs    each feature against the plain kernel at seqlen 8k (batch 2, 16 heads), forward
             and backward: window (a causal-sized band through the HAS_LEFT path) against causal;
             ALiBi, softcap, sink, dropout 0.1 against full; dropout and every feature at once
             against causal. On sm_90 the plain case (and the features the Gluon kernels take)
             runs Gluon kernels; the *_triton cases force the Triton kernels (a tile override),
             so the Triton feature costs are also given against the plain Triton kernel; the
             *_atomic cases compute dQ inside the dK/dV kernel (dropout then draws its mask
             once in the backward, not twice). Anchors at the same shape, each feature against
             its own plain kernel: SDPA's cuDNN (full, causal, dropout 0.1) and FLASH (FA2: full,
             dropout 0.1) backends, FlexAttention compiled (full, softcap 30 and ALiBi
             score_mods). A case that cannot run (SDPA refusing cuDNN dropout) is recorded with
             the reason (exception and warnings, first lines), not timed.
    costs_ab the costs cases again, each round timing every case in turn (AB_ROUNDS rounds):
             a feature's ratio to its base is taken within a round, then the median, so the
             clock's drift between cases timed minutes apart (5-9% on the plain forward, more
             than some features cost) does not show as a cost.
    window   causal sliding window of 1024 keys over 16k (batch 1, 16 heads): TFLOP/s counted on
             the visible pairs, against our causal kernel and cuDNN causal (TFLOP/s on causal
             pairs, for scale) and FlexAttention compiled with the same sliding-window mask
             (block mask built once, outside the timing).
    varlen   equal lengths packed (2 x 8k, 8 x 2k, causal and full) against the dense call on
             the same tokens; also the Triton varlen kernels (varlen_triton: what varlen ran
             before the Gluon forward took it) and cuDNN (SDPA) dense on the same shape.
    varlen_ab  the equal-length cases' forwards again, dense and varlen timed in alternation
             (AB_ROUNDS rounds, medians): the clock drifts by more than 5% between cases run
             minutes apart, which a ratio of two cases timed in turn would show as a gap.
    ragged   16 causal sequences of 1..8k tokens: varlen tokens/s against the dense call on the
             batch padded to the longest (and the Triton varlen kernels, cuDNN padded).
Backward times the backward launcher alone on saved (out, lse), as bench_triton does.
--compile-only runs every case once, in --jobs processes (Triton's and Inductor's disk caches
then serve the timed run). Results: DIR/features_<date>.json with date, device, versions.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import os
import warnings
from statistics import median

import torch
from bench_triton import anchor_flex_compiled, bench, environment

from flashkit.ops.params import AttentionParams
from flashkit.ops.triton.backward import attention_backward
from flashkit.ops.triton.configs import tile_config
from flashkit.ops.triton.forward import attention_forward

HEAD_DIM, NHEADS, DTYPE = 128, 16, torch.bfloat16
SCALE = HEAD_DIM ** -0.5
WINDOW, WINDOW_SEQLEN = 1024, 16384
FORWARD_ONLY = False  # --forward-only: time and run forwards alone (bwd_ms None)
AB_ROUNDS = 5  # rounds of the parts timed in alternation
PARTS = ("costs", "costs_ab", "window", "varlen", "varlen_ab", "ragged")


def randn(*shape):
    return torch.randn(*shape, dtype=DTYPE, device="cuda")


def cu_seqlens(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")


def feature_params(name: str, batch: int) -> AttentionParams:
    causal = dict(window_left=None, window_right=0)
    return {
        "full": AttentionParams(SCALE),
        "causal": AttentionParams(SCALE, **causal),
        "window": AttentionParams(SCALE, window_left=8191, window_right=0),
        "alibi": AttentionParams(SCALE, alibi_slopes=torch.rand(NHEADS, device="cuda") * 0.1),
        "softcap": AttentionParams(SCALE, softcap=30.0),
        "sink": AttentionParams(SCALE, sink=torch.randn(NHEADS, device="cuda")),
        "dropout": AttentionParams(SCALE, dropout_p=0.1, dropout_seed=2**61 + 7),
        "dropout_causal": AttentionParams(SCALE, **causal, dropout_p=0.1, dropout_seed=2**61 + 7),
        "all_causal": AttentionParams(SCALE, window_left=8191, window_right=0, softcap=30.0,
                                      alibi_slopes=torch.rand(NHEADS, device="cuda") * 0.1,
                                      sink=torch.randn(NHEADS, device="cuda"), dropout_p=0.1,
                                      dropout_seed=2**61 + 7),
    }[name]


# The anchors' costs cases: name -> (SDPA backend, causal, dropout_p) ...
SDPA_CASES = {"cudnn_full": ("cudnn", False, 0.0), "cudnn_causal": ("cudnn", True, 0.0),
              "cudnn_dropout": ("cudnn", False, 0.1),
              "fa2_full": ("flash", False, 0.0), "fa2_dropout": ("flash", False, 0.1)}
# ... and name -> the feature of feature_params that FlexAttention's score_mod computes
FLEX_CASES = {"flex_full": "full", "flex_softcap": "softcap", "flex_alibi": "alibi"}
# every costs case (the keys; --cases picks among them) -> the case its cost is taken against
COST_BASE = {"full": None, "causal": None, "window": "causal", "alibi": "full",
             "softcap": "full", "sink": "full", "dropout": "full", "dropout_causal": "causal",
             "all_causal": "causal", "full_triton": None, "softcap_triton": "full_triton",
             "dropout_triton": "full_triton", "full_atomic": "full", "dropout_atomic": "full",
             "cudnn_full": None, "cudnn_causal": None, "cudnn_dropout": "cudnn_full",
             "fa2_full": None, "fa2_dropout": "fa2_full",
             "flex_full": None, "flex_softcap": "flex_full", "flex_alibi": "flex_full"}
# further ratios costs_ab reports (keyed name_over_base): atomic dropout against atomic plain,
# our plain kernels against the anchors' plain kernels
COST_PAIRS = (("dropout_atomic", "full_atomic"), ("full", "cudnn_full"),
              ("causal", "cudnn_causal"), ("full", "fa2_full"), ("full", "flex_full"))


def triton_tiles():
    """(forward tile, backward tiles) of configs.py: passing them keeps the Triton kernels."""
    return (tile_config("forward", HEAD_DIM, 2, False),
            {name: tile_config(name, HEAD_DIM, 2, False) for name in ("dkdv", "dq")})


def ours_calls(q, k, v, dout, params, triton_only=False, atomic_dq=None):
    """(forward, backward) closures of the launchers, the backward (None under --forward-only)
    on the forward's saved (out, lse); triton_only forces the Triton kernels where a Gluon
    kernel would run; atomic_dq as attention_backward's (None: configs.py's choice)."""
    tile, tiles = triton_tiles() if triton_only else (None, None)
    out, lse = attention_forward(q, k, v, params, tile=tile)
    fwd = lambda: attention_forward(q, k, v, params, tile=tile)  # noqa: E731
    if FORWARD_ONLY:
        return fwd, None
    return fwd, lambda: attention_backward(dout, q, k, v, out, lse, params, tiles=tiles,
                                           atomic_dq=atomic_dq)


def autograd_calls(run, q, k, v, dout):
    """(forward, backward) closures of an anchor `run(q, k, v) -> out` on (b, h, s, d) copies:
    the backward is autograd.grad on a retained graph (None under --forward-only)."""
    qh, kh, vh, douth = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
    fwd = lambda: run(qh, kh, vh)  # noqa: E731
    if FORWARD_ONLY:
        return fwd, None
    leaves = [x.requires_grad_() for x in (qh, kh, vh)]
    out = run(*leaves)
    return fwd, lambda: torch.autograd.grad(out, leaves, douth, retain_graph=True)


def sdpa_calls(q, k, v, dout, causal, backend="cudnn", dropout_p=0.0):
    """(forward, backward) closures of SDPA's `backend` alone; with dropout_p SDPA draws its own
    mask (a new one per call, the backward regenerating the forward's)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def run(*t):
        with sdpa_kernel(kind):
            return sdpa(*t, dropout_p=dropout_p, is_causal=causal)

    return autograd_calls(run, q, k, v, dout)


def flex_calls(q, k, v, dout, score_mod=None, block_mask=None):
    """(forward, backward) closures of FlexAttention compiled (bench_triton's, once per
    score_mod / mask), score_mod(score, b, h, q_idx, kv_idx) -> score."""
    from torch.nn.attention.flex_attention import flex_attention

    flex = anchor_flex_compiled(flex_attention)
    return autograd_calls(lambda *t: flex(*t, score_mod=score_mod, block_mask=block_mask),
                          q, k, v, dout)


def flex_score_mod(params):
    """FlexAttention's score_mod of feature_params' softcap or ALiBi (None for neither): the
    score comes scaled, as ours is before the softcap; ALiBi subtracts slope_h |i - j|
    (reference.alibi_distance, seqlen_q == seqlen_k)."""
    if params.softcap:
        cap = params.softcap
        return lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap)
    if params.alibi_slopes is not None:
        slopes = params.alibi_slopes  # (nheads,) fp32, captured by the compiled kernels
        return lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (q_idx - kv_idx).abs()
    return None


def measure(calls, timed=True):
    """(fwd ms, bwd ms) of (forward, backward) closures; one run each when not timed
    (compiling)."""
    fwd, bwd = calls
    if not timed:
        fwd()
        if bwd:
            bwd()
        torch.cuda.synchronize()
        return None, None
    return bench(fwd), bwd and bench(bwd)


def time_ours(q, k, v, dout, params, timed=True, triton_only=False):
    return measure(ours_calls(q, k, v, dout, params, triton_only), timed)


def time_sdpa(q, k, v, dout, causal, backend="cudnn", timed=True):
    return measure(sdpa_calls(q, k, v, dout, causal, backend), timed)


def time_flex_window(q, k, v, dout, timed=True):
    """FlexAttention with the sliding-window block mask, built once outside the timing."""
    from torch.nn.attention.flex_attention import create_block_mask

    seqlen = q.shape[1]
    mask = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j < WINDOW), None, None, seqlen,
                             seqlen)
    return measure(flex_calls(q, k, v, dout, block_mask=mask), timed)


def flops(pairs, nheads=NHEADS, head_dim=HEAD_DIM):
    """(fwd, bwd) FLOPs over `pairs` visible (query, key) pairs per head (docs/design.md
    section 6)."""
    f = 4 * pairs * nheads * head_dim
    return f, 2.5 * f


def tflops(fl, ms):
    return None if ms is None else fl / ms / 1e9


# ---- the cases, each a function of `timed` (so --compile-only can run them in processes) -----

def cost_calls(name):
    """(forward, backward) closures of one costs case (a COST_BASE key) on inputs of its own:
    ours (feature_params' feature, *_triton: the Triton kernels, *_atomic: dQ by atomics in the
    dK/dV kernel), SDPA_CASES or FLEX_CASES."""
    batch, seqlen = 2, 8192
    torch.manual_seed(0)
    q, k, v, dout = (randn(batch, seqlen, NHEADS, HEAD_DIM) for _ in range(4))
    if name in SDPA_CASES:
        backend, causal, dropout_p = SDPA_CASES[name]
        return sdpa_calls(q, k, v, dout, causal, backend, dropout_p)
    if name in FLEX_CASES:
        return flex_calls(q, k, v, dout, flex_score_mod(feature_params(FLEX_CASES[name], batch)))
    feature = name.removesuffix("_triton").removesuffix("_atomic")
    return ours_calls(q, k, v, dout, feature_params(feature, batch),
                      triton_only=name.endswith("_triton"),
                      atomic_dq=True if name.endswith("_atomic") else None)


def checked_cost_calls(name):
    """cost_calls(name), run once, or why an anchor's case cannot run: the exception's first
    line and those of the warnings it raised (SDPA refusing a backend raises 'No available
    kernel' and warns the reasons; shown as usual when the case runs). Ours raise."""
    if name not in SDPA_CASES and name not in FLEX_CASES:
        calls = cost_calls(name)
        measure(calls, timed=False)
        return calls
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            calls = cost_calls(name)
            measure(calls, timed=False)
        except Exception as error:
            lines = [repr(error), *(str(w.message) for w in caught)]
            firsts = (line.strip().splitlines()[0].split(" (Triggered internally")[0]
                      for line in lines if line.strip())
            return "; ".join(dict.fromkeys(firsts))  # in order, each once
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return calls


def case_cost(name, timed=True):
    calls = checked_cost_calls(name)
    if isinstance(calls, str):
        return dict(part="costs", case=name, fwd_ms=None, bwd_ms=None, unsupported=calls)
    fwd, bwd = measure(calls) if timed else (None, None)  # (checked_cost_calls ran it once)
    return dict(part="costs", case=name, fwd_ms=fwd, bwd_ms=bwd)


def case_costs_ab(names, timed=True):
    """Every costs case of `names` timed in turn, AB_ROUNDS rounds: summarize takes a feature's
    ratio to its base within each round, so the clock's drift between cases minutes apart
    (5-9% on the plain forward) cancels. Cases that cannot run go to `unsupported`."""
    calls = {name: checked_cost_calls(name) for name in names}
    if not timed:
        return {}
    unsupported = {name: c for name, c in calls.items() if isinstance(c, str)}
    runnable = {name: c for name, c in calls.items() if name not in unsupported}
    rounds = [{name: measure(c) for name, c in runnable.items()} for _ in range(AB_ROUNDS)]
    return dict(part="costs_ab", case="rounds", rounds=rounds, unsupported=unsupported)


def case_window(impl, timed=True):
    seqlen = WINDOW_SEQLEN
    q, k, v, dout = (randn(1, seqlen, NHEADS, HEAD_DIM) for _ in range(4))
    window_pairs = sum(min(i + 1, WINDOW) for i in range(seqlen))
    causal_pairs = seqlen * (seqlen + 1) // 2
    if impl == "ours_window":
        params, pairs = AttentionParams(SCALE, window_left=WINDOW - 1, window_right=0), window_pairs
        fwd, bwd = time_ours(q, k, v, dout, params, timed)
    elif impl == "ours_causal":
        params, pairs = AttentionParams(SCALE, window_right=0), causal_pairs
        fwd, bwd = time_ours(q, k, v, dout, params, timed)
    elif impl == "flex_window":
        (fwd, bwd), pairs = time_flex_window(q, k, v, dout, timed), window_pairs
    else:  # cudnn_causal / flash_causal
        (fwd, bwd), pairs = time_sdpa(q, k, v, dout, True, impl.split("_")[0], timed), \
            causal_pairs
    f_fwd, f_bwd = flops(pairs)
    return dict(part="window", case=impl, pairs=pairs, fwd_ms=fwd, bwd_ms=bwd,
                fwd_tflops=tflops(f_fwd, fwd), bwd_tflops=tflops(f_bwd, bwd))


def case_varlen(layout, lengths, causal, padded=False, timed=True):
    """Dense (batch, max, h, d) or varlen packed tokens of `lengths`; dense with unequal
    lengths means padding every sequence to the longest. Layouts: dense, cudnn (SDPA on the
    dense shape), varlen, varlen_triton (the Triton kernels forced by a tile override)."""
    longest, tokens = max(lengths), sum(lengths)
    window = dict(window_right=0) if causal else {}
    if layout in ("dense", "cudnn"):
        q, k, v, dout = (randn(len(lengths), longest, NHEADS, HEAD_DIM) for _ in range(4))
        params = AttentionParams(SCALE, **window)
    else:
        q, k, v, dout = (randn(tokens, NHEADS, HEAD_DIM) for _ in range(4))
        cu = cu_seqlens(lengths)
        params = AttentionParams(SCALE, **window, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                 max_seqlen_q=longest, max_seqlen_k=longest)
    if layout == "cudnn":
        fwd, bwd = time_sdpa(q, k, v, dout, causal, timed=timed)
    else:
        fwd, bwd = time_ours(q, k, v, dout, params, timed,
                             triton_only=layout == "varlen_triton")
    row = dict(layout=layout, lengths=list(lengths), causal=causal, tokens=tokens, fwd_ms=fwd,
               bwd_ms=bwd)
    if timed:
        row.update(fwd_tokens_per_s=tokens / fwd * 1e3,
                   bwd_tokens_per_s=bwd and tokens / bwd * 1e3)
    return row



def case_varlen_ab(lengths, causal, timed=True):
    """Forward ms of dense and varlen on the same tokens, timed in alternation."""
    longest, tokens = max(lengths), sum(lengths)
    window = dict(window_right=0) if causal else {}
    cu = cu_seqlens(lengths)
    calls = {"dense": ((randn(len(lengths), longest, NHEADS, HEAD_DIM) for _ in range(3)),
                       AttentionParams(SCALE, **window)),
             "varlen": ((randn(tokens, NHEADS, HEAD_DIM) for _ in range(3)),
                        AttentionParams(SCALE, **window, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                        max_seqlen_q=longest, max_seqlen_k=longest))}
    fns = {name: (lambda qkv=tuple(qkv), p=p: attention_forward(*qkv, p))
           for name, (qkv, p) in calls.items()}
    times = {name: [] for name in fns}
    for _ in range(AB_ROUNDS if timed else 1):
        for name, fn in fns.items():
            if timed:
                times[name].append(bench(fn))
            else:
                fn()
    if not timed:
        return {}
    med = {name: median(t) for name, t in times.items()}
    return dict(part="varlen_ab", lengths=list(lengths), causal=causal, tokens=tokens,
                dense_fwd_ms=med["dense"], varlen_fwd_ms=med["varlen"],
                varlen_over_dense=med["varlen"] / med["dense"], rounds=times)


RAGGED = [int(x) for x in torch.randint(1, 8193, (16,),
                                        generator=torch.Generator().manual_seed(0))]
EQUAL = {"2x8k": [8192] * 2, "8x2k": [2048] * 8}
VARLEN_LAYOUTS = ("dense", "varlen", "varlen_triton", "cudnn")


def ratio(ms, base_ms):
    """ms / base_ms, None where either was not timed (--forward-only leaves bwd_ms None)."""
    return None if ms is None or base_ms is None else ms / base_ms


def cases(parts=PARTS, names=None):
    """(label, function, args) of every measurement of `parts`, in the order they are timed;
    names (a set of COST_BASE keys) keeps only those costs cases."""
    cost_names = [n for n in COST_BASE if names is None or n in names]
    out = {"costs": [(f"costs {n}", case_cost, (n,)) for n in cost_names],
           "costs_ab": [("costs_ab", case_costs_ab, (tuple(cost_names),))],
           "window": [(f"window {i}", case_window, (i,)) for i in
                      ("ours_window", "ours_causal", "flex_window", "cudnn_causal",
                       "flash_causal")],
           "varlen": [(f"varlen {label} causal={causal} {layout}", case_varlen,
                       (layout, lengths, causal)) for label, lengths in EQUAL.items()
                      for causal in (False, True) for layout in VARLEN_LAYOUTS],
           "varlen_ab": [(f"varlen_ab {label} causal={causal}", case_varlen_ab, (lengths, causal))
                         for label, lengths in EQUAL.items() for causal in (False, True)],
           "ragged": [(f"ragged {layout}", case_varlen, (layout, RAGGED, True))
                      for layout in VARLEN_LAYOUTS]}
    return [case for part in PARTS if part in parts for case in out[part]]


def _compile(i, parts, forward_only, names):
    global FORWARD_ONLY
    FORWARD_ONLY = forward_only
    label, fn, args = cases(parts, names)[i]
    row = fn(*args, timed=False)
    return label + (f" UNSUPPORTED {row['unsupported']}" if "unsupported" in row else "")


def summarize(rows):
    """Ratios: each feature against its base, varlen against dense, window against anchors."""
    by = {(r["part"], r["case"]): r for r in rows if "case" in r}
    costs = {}
    for name, base in COST_BASE.items():
        if base and ("costs", name) in by and ("costs", base) in by:
            r, b = by[("costs", name)], by[("costs", base)]
            if "unsupported" in r:
                costs[name] = dict(vs=base, unsupported=r["unsupported"])
                continue
            costs[name] = dict(vs=base, fwd=ratio(r["fwd_ms"], b["fwd_ms"]),
                               bwd=ratio(r["bwd_ms"], b["bwd_ms"]))
            anchor = by.get(("costs", "cudnn_" + ("causal" if "causal" in base else "full")))
            if anchor:  # time against cuDNN's plain kernel of the same mask (no such feature)
                costs[name].update(fwd_over_cudnn=ratio(r["fwd_ms"], anchor["fwd_ms"]),
                                   bwd_over_cudnn=ratio(r["bwd_ms"], anchor["bwd_ms"]))
    for name in ("full", "causal"):
        if ("costs", name) in by and ("costs", "cudnn_" + name) in by:
            r, a = by[("costs", name)], by[("costs", "cudnn_" + name)]
            costs[f"plain_{name}_vs_cudnn"] = dict(fwd=ratio(a["fwd_ms"], r["fwd_ms"]),
                                                   bwd=ratio(a["bwd_ms"], r["bwd_ms"]))
    alternated = {}
    ab = next((r for r in rows if r.get("part") == "costs_ab"), dict(rounds=[]))
    rounds, unsupported = ab["rounds"], ab.get("unsupported", {})
    pairs = [(name, base, name) for name, base in COST_BASE.items() if base]
    for name, base, key in (*pairs, *((n, b, f"{n}_over_{b}") for n, b in COST_PAIRS)):
        if name in unsupported or base in unsupported:
            reason = unsupported.get(name) or unsupported[base]
            alternated[key] = dict(vs=base, unsupported=reason)
        elif rounds and base in rounds[0] and name in rounds[0]:
            alternated[key] = dict(vs=base, **{
                way: median([ratio(r[name][i], r[base][i]) for r in rounds])
                for i, way in enumerate(("fwd", "bwd")) if rounds[0][name][i] is not None})
    varlen = {}
    dense = {(tuple(r["lengths"]), r["causal"]): r for r in rows if r.get("layout") == "dense"}
    for r in rows:
        layout = r.get("layout")
        if layout in VARLEN_LAYOUTS and layout != "dense":
            d = dense.get((tuple(r["lengths"]), r["causal"]))
            if d:
                key = f"{layout} {len(r['lengths'])}seq causal={r['causal']}"
                varlen[key] = dict(fwd=ratio(r["fwd_ms"], d["fwd_ms"]),
                                   bwd=ratio(r["bwd_ms"], d["bwd_ms"]))
    alternating = {f"{len(r['lengths'])}seq causal={r['causal']}": r["varlen_over_dense"]
                   for r in rows if r.get("part") == "varlen_ab"}
    return dict(cost_ratios=costs, cost_ratios_alternating=alternated,
                time_over_dense_ours=varlen,
                varlen_over_dense_fwd_alternating=alternating)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--cases", default=None,
                    help="comma list: only these costs cases (COST_BASE keys)")
    ap.add_argument("--tag", default="", help="appended to the result file's name")
    args = ap.parse_args()
    names = set(args.cases.split(",")) if args.cases else None
    if names and names - set(COST_BASE):
        ap.error(f"unknown --cases {sorted(names - set(COST_BASE))}; known: {list(COST_BASE)}")
    global FORWARD_ONLY
    FORWARD_ONLY = args.forward_only
    parts = tuple(args.parts.split(","))
    if args.compile_only:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            futures = {pool.submit(_compile, i, parts, args.forward_only, names): label
                       for i, (label, _, _) in enumerate(cases(parts, names))}
            for future in concurrent.futures.as_completed(futures):
                error = future.exception()
                print("compiled" if error is None else f"FAILED {error!r:.300}", futures[future],
                      flush=True)
        return
    env = environment()
    rows = []
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M")
    path = os.path.join(args.out, f"features_{stamp}{'_fwd' if FORWARD_ONLY else ''}"
                                  f"{args.tag}.json")
    for label, fn, fn_args in cases(parts, names):
        try:
            row = fn(*fn_args)
        except Exception as error:  # one broken case must not cost the rest of the run
            print(label, "FAILED", repr(error)[:300], flush=True)
            continue
        rows.append(row)
        print(label, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                      if k.endswith(("ms", "tflops", "per_s", "over_dense", "unsupported"))},
              flush=True)
        json.dump({"env": env, "config": dict(head_dim=HEAD_DIM, nheads=NHEADS, dtype=str(DTYPE)),
                   "rows": rows, "summary": summarize(rows)}, open(path, "w"), indent=1)
    print(json.dumps(summarize(rows), indent=1))


if __name__ == "__main__":
    main()
