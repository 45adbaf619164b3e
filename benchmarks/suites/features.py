"""features: what each feature costs through the public API, with the anchors' own costs.

    PYTHONPATH=src python3 benchmarks/suites/features.py [--parts costs,window,varlen]
        [--rounds 5] [--forward-only] [--out DIR]

bf16, head dim 128, 16 heads; forward under no_grad, backward as autograd.grad on a retained
graph (flash_attn_func / flash_attn_varlen_func, as a user calls them).
  costs    each feature against its plain case at seqlen 8k, batch 2: causal, a causal-sized
           window, ALiBi, softcap 30, sink, dropout 0.1, dropout + causal, everything at once.
           Anchors, each feature against its own plain case: SDPA cuDNN (full, causal, dropout),
           FA2 (full, dropout), FlexAttention compiled (full, softcap and ALiBi score_mods).
           Every case is timed once per round, --rounds rounds, and a cost is the median of its
           per-round ratios: the clock drifts by 5-9% between cases timed minutes apart, more
           than some features cost. A case an anchor refuses is recorded with the reason.
  window   causal sliding window of 1024 keys over 16k (batch 1): TFLOP/s over the visible
           pairs, against our causal call, cuDNN causal and FlexAttention with the same window.
  varlen   packed sequences (2 x 8k, 8 x 2k, and 16 ragged lengths of 1..8k), causal and full:
           tokens/s of flash_attn_varlen_func against flash_attn_func on the same tokens
           (padded to the longest when ragged) and cuDNN on the dense shape.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from common import (  # noqa: E402
    Result,
    add_out_argument,
    anchor_flex_compiled,
    bench,
    log,
    name_list,
    sdpa,
    table,
    tflops,
)

HEAD_DIM, NHEADS, DTYPE = 128, 16, torch.bfloat16
WINDOW, WINDOW_SEQLEN = 1024, 16384
PARTS = ("costs", "window", "varlen")
FORWARD_ONLY = False  # set by --forward-only


def randn(*shape):
    return torch.randn(*shape, dtype=DTYPE, device="cuda")


def feature_kwargs(name: str) -> dict:
    """flash_attn_func keywords of one feature case."""
    slopes = torch.rand(NHEADS, device="cuda") * 0.1
    sink = torch.randn(NHEADS, device="cuda")
    return {"full": {}, "causal": dict(causal=True), "window": dict(window_size=(8191, 0)),
            "alibi": dict(alibi_slopes=slopes), "softcap": dict(softcap=30.0),
            "sink": dict(sink=sink), "dropout": dict(dropout_p=0.1),
            "dropout_causal": dict(dropout_p=0.1, causal=True),
            "all_causal": dict(window_size=(8191, 0), softcap=30.0, alibi_slopes=slopes,
                               sink=sink, dropout_p=0.1)}[name]


# case -> the case its cost is taken against (None: a base)
COST_BASE = {"full": None, "causal": None, "window": "causal", "alibi": "full",
             "softcap": "full", "sink": "full", "dropout": "full", "dropout_causal": "causal",
             "all_causal": "causal", "cudnn_full": None, "cudnn_causal": None,
             "cudnn_dropout": "cudnn_full", "fa2_full": None, "fa2_dropout": "fa2_full",
             "flex_full": None, "flex_softcap": "flex_full", "flex_alibi": "flex_full"}
SDPA_CASES = {"cudnn_full": ("cudnn", False, 0.0), "cudnn_causal": ("cudnn", True, 0.0),
              "cudnn_dropout": ("cudnn", False, 0.1), "fa2_full": ("flash", False, 0.0),
              "fa2_dropout": ("flash", False, 0.1)}
PAIRS = (("full", "cudnn_full"), ("causal", "cudnn_causal"), ("full", "fa2_full"),
         ("full", "flex_full"))


def calls(run, q, k, v, dout):
    """(forward, backward or None) closures of run(q, k, v) -> out."""
    def fwd():
        with torch.no_grad():
            return run(q, k, v)
    if FORWARD_ONLY:
        return fwd, None
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = run(*leaves)
    return fwd, lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def measure(fns) -> tuple:
    fwd, bwd = fns
    return bench(fwd), bwd and bench(bwd)


def cost_calls(name):
    """The closures of one costs case on (2, 8k, 16, 128) inputs of its own."""
    import flashkit

    torch.manual_seed(0)
    q, k, v, dout = (randn(2, 8192, NHEADS, HEAD_DIM) for _ in range(4))
    if name in SDPA_CASES:
        backend, causal, p = SDPA_CASES[name]
        run = sdpa(backend)
        return calls(lambda *t: run(*t, causal, dropout_p=p),
                     *(x.transpose(1, 2).contiguous() for x in (q, k, v, dout)))
    if name.startswith("flex_"):
        flex, kw = anchor_flex_compiled(), feature_kwargs(name.removeprefix("flex_"))
        score_mod = None
        if "softcap" in kw:
            score_mod = lambda s, b, h, i, j: 30.0 * torch.tanh(s / 30.0)  # noqa: E731
        elif "alibi_slopes" in kw:
            slopes = kw["alibi_slopes"]
            score_mod = lambda s, b, h, i, j: s - slopes[h] * (i - j).abs()  # noqa: E731
        return calls(lambda *t: flex(*t, score_mod=score_mod),
                     *(x.transpose(1, 2).contiguous() for x in (q, k, v, dout)))
    kw = feature_kwargs(name)
    return calls(lambda *t: flashkit.flash_attn_func(*t, **kw), q, k, v, dout)


def checked(name):
    """cost_calls(name) run once, or for an anchor that refuses the case, why (the exception's
    and its warnings' first lines). Our own cases raise."""
    if name in SDPA_CASES or name.startswith("flex_"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fns = cost_calls(name)
                [f() for f in fns if f]
            except Exception as error:
                lines = [repr(error), *(str(w.message) for w in caught)]
                return "; ".join(dict.fromkeys(
                    line.strip().splitlines()[0] for line in lines if line.strip()))
        return fns
    fns = cost_calls(name)
    [f() for f in fns if f]
    return fns


def costs(rounds: int) -> dict:
    """Every case timed once per round; a cost is the median over rounds of case / base."""
    fns = {name: checked(name) for name in COST_BASE}
    unsupported = {n: f for n, f in fns.items() if isinstance(f, str)}
    runnable = {n: f for n, f in fns.items() if n not in unsupported}
    per_round = [{n: measure(f) for n, f in runnable.items()} for _ in range(rounds)]
    rows = []
    pairs = [(n, b) for n, b in COST_BASE.items() if b] + list(PAIRS)
    for name in runnable:
        row = {"case": name,
               "fwd_ms": statistics.median(r[name][0] for r in per_round),
               "bwd_ms": None if FORWARD_ONLY else statistics.median(
                   r[name][1] for r in per_round)}
        for case, base in pairs:
            if case == name and base in runnable:
                for i, d in enumerate(("fwd", "bwd")[:1 if FORWARD_ONLY else 2]):
                    row[f"{d}_over_{base}"] = statistics.median(
                        r[case][i] / r[base][i] for r in per_round)
        rows.append(row)
    return {"rows": rows, "unsupported": unsupported, "rounds": rounds}


def window() -> list[dict]:
    from torch.nn.attention.flex_attention import create_block_mask

    import flashkit

    n = WINDOW_SEQLEN
    q, k, v, dout = (randn(1, n, NHEADS, HEAD_DIM) for _ in range(4))
    qh, kh, vh, dh = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
    window_pairs = sum(min(i + 1, WINDOW) for i in range(n))
    causal_pairs = n * (n + 1) // 2
    mask = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j < WINDOW), None, None, n, n)
    flex = anchor_flex_compiled()
    cases = {
        "flashkit_window": (lambda *t: flashkit.flash_attn_func(
            *t, window_size=(WINDOW - 1, 0)), (q, k, v, dout), window_pairs),
        "flashkit_causal": (lambda *t: flashkit.flash_attn_func(*t, causal=True),
                            (q, k, v, dout), causal_pairs),
        "cudnn_causal": (lambda *t: sdpa("cudnn")(*t, True), (qh, kh, vh, dh), causal_pairs),
        "flex_window": (lambda *t: flex(*t, block_mask=mask), (qh, kh, vh, dh), window_pairs)}
    rows = []
    for name, (run, args, pairs) in cases.items():
        fwd, bwd = measure(calls(run, *args))
        f = 4 * pairs * NHEADS * HEAD_DIM
        rows.append(dict(case=name, pairs=pairs, fwd_ms=fwd, bwd_ms=bwd,
                         fwd_tflops=tflops(f, fwd), bwd_tflops=bwd and tflops(2.5 * f, bwd)))
    return rows


RAGGED = [int(x) for x in torch.randint(1, 8193, (16,),
                                        generator=torch.Generator().manual_seed(0))]
VARLEN_SETS = {"2x8k": [8192] * 2, "8x2k": [2048] * 8, "ragged16": RAGGED}


def varlen() -> list[dict]:
    import flashkit

    rows = []
    for label, lengths in VARLEN_SETS.items():
        longest, tokens = max(lengths), sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
        for causal in (False, True):
            packed = [randn(tokens, NHEADS, HEAD_DIM) for _ in range(4)]
            dense = [randn(len(lengths), longest, NHEADS, HEAD_DIM) for _ in range(4)]
            row = dict(set=label, causal=causal, tokens=tokens)
            varlen_call = functools.partial(flashkit.flash_attn_varlen_func, cu_seqlens_q=cu,
                                            cu_seqlens_k=cu, max_seqlen_q=longest,
                                            max_seqlen_k=longest, causal=causal)
            for name, run, args in (
                    ("varlen", varlen_call, packed),
                    ("dense", functools.partial(flashkit.flash_attn_func, causal=causal), dense),
                    ("cudnn_dense", functools.partial(sdpa("cudnn"), causal=causal),
                     [x.transpose(1, 2).contiguous() for x in dense])):
                fwd, bwd = measure(calls(run, *args))
                row[f"{name}_fwd_ms"], row[f"{name}_bwd_ms"] = fwd, bwd
                row[f"{name}_fwd_tokens_per_s"] = tokens / fwd * 1e3
            row["varlen_over_dense_fwd"] = row["varlen_fwd_ms"] / row["dense_fwd_ms"]
            rows.append(row)
            log(f"varlen {row}")
    return rows


def main(argv=None) -> int:
    global FORWARD_ONLY
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the costs part")
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--tag", default="")
    add_out_argument(ap, "features")
    args = ap.parse_args(argv)
    parts = name_list(ap, "--parts", args.parts, PARTS)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    FORWARD_ONLY = args.forward_only
    result = Result("features", args.out, args.tag,
                    dict(dtype="bfloat16", head_dim=HEAD_DIM, nheads=NHEADS, parts=parts,
                         rounds=args.rounds, forward_only=FORWARD_ONLY))
    log(str(result.data["env"]))
    md = []
    if "costs" in parts:
        result.save("costs", costs(args.rounds))
        rows = result.data["costs"]["rows"]
        cols = sorted({c for r in rows for c in r if "_over_" in c})
        md.append("### costs (seqlen 8k, batch 2; ratios are medians over rounds)\n\n"
                  + table(rows, ["case", "fwd_ms", "bwd_ms", *cols]))
        log(md[-1])
    if "window" in parts:
        result.save("window", window())
        md.append("### window 1024 over 16k\n\n" + table(
            result.data["window"], ["case", "fwd_tflops", "bwd_tflops", "fwd_ms", "bwd_ms"]))
        log(md[-1])
    if "varlen" in parts:
        result.save("varlen", varlen())
        md.append("### varlen\n\n" + table(result.data["varlen"], [
            "set", "causal", "tokens", "varlen_fwd_ms", "dense_fwd_ms", "cudnn_dense_fwd_ms",
            "varlen_bwd_ms", "dense_bwd_ms", "varlen_over_dense_fwd"]))
    result.markdown("\n".join(md))
    log(f"wrote {result.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
