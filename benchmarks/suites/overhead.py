"""overhead: host time per call on a tiny problem, where the kernels take microseconds.

What a Python call costs before the GPU has anything to do.

    PYTHONPATH=src python3 benchmarks/suites/overhead.py --out DIR [--calls N]

Problems: b1, s128, h8, d64 bf16: the forward (no grad) and the training step (forward with
grad + backward) of flashkit.flash_attn_func, PyTorch SDPA (cuDNN, FA2, efficient) and compiled
FlexAttention; the same with a user's variant (a causal document mask as a block mask) against
FlexAttention's, SDPA cuDNN's plain causal call giving the scale; and an eager decoding step
of flashkit.flash_attn_with_kvcache (b1, 32 query / 4 kv heads, d128, one new token, 1k..16k
cached keys) against SDPA over the same cache (enable_gqa); transformers' decoding step through
flashkit.flash_attn_func (one query over a DynamicCache's keys: (1, heads_k, length, d)
contiguous seen through transpose(1, 2), one key longer every call, from 1024) against SDPA
on the same keys; and the tiny problem's tokens as 4
causal sequences of 32 through flashkit.flash_attn_varlen_func against SDPA cuDNN on the same
sequences as a batch. Two numbers per call:
  wall_us  wall time per call of a tight loop of N calls with one synchronisation at the end. On
           a problem this small the GPU finishes each kernel before the host has issued the
           next, so the loop is host-bound and this is what a user's loop pays per call.
  cpu_us   CPU time of the calling thread per call (time.thread_time over the same loop): the
           Python, dispatch and driver work alone. wall_us well above cpu_us means the host
           waited (a synchronisation, or a GPU slower than the host), or worked on another
           thread (autograd runs a CUDA backward on its own device thread).
Each is the median of --rounds loops, the implementations' loops interleaved.
Also a cProfile of flashkit's forward and step (the top functions by own time). Writes
DIR/<date>_<device>.json (profiles included) and .md.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from common import (  # noqa: E402
    Result,
    add_out_argument,
    anchor_call,
    anchor_flex_compiled,
    log,
    sdpa,
    table,
)

import flashkit  # noqa: E402

B, S, H, D = 1, 128, 8, 64
DECODE_Q_HEADS, DECODE_KV_HEADS, DECODE_D = 32, 4, 128
CACHED = (1024, 4096, 16384)
VARLEN_SEQUENCES = 4  # the varlen row: the tiny problem's 128 tokens as 4 sequences of 32


def per_call(fn, calls: int) -> dict:
    """{"wall_us", "cpu_us"} per call of fn over one tight loop of `calls` calls."""
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    cpu = time.thread_time() - cpu
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    return {"wall_us": 1e6 * wall / calls, "cpu_us": 1e6 * cpu / calls}


def interleaved(fns: dict, calls: int, rounds: int) -> dict:
    """name -> the median over `rounds` rounds of per_call, each round timing every fn in turn
    (this host's speed drifts by tens of percent within a run: interleaving puts the drift on
    every implementation alike), after a warm-up; None values for a fn that does not run here."""
    samples = {}
    for name, fn in fns.items():
        try:
            for _ in range(20):
                fn()
            samples[name] = []
        except Exception as e:  # an anchor that does not run here: recorded
            log(f"{name}: {type(e).__name__}: {e}")
    for _ in range(rounds):
        for name in samples:
            samples[name].append(per_call(fns[name], calls))
    rows = {name: {"wall_us": None, "cpu_us": None} for name in fns}
    for name, runs in samples.items():
        rows[name] = {key: statistics.median(run[key] for run in runs)
                      for key in ("wall_us", "cpu_us")}
    return rows


def profile(fn, calls: int, top: int = 20) -> str:
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def _pair(attention, plain, grads, grad_out) -> tuple:
    """(forward, step) callables of attention(q, k, v): the forward under no_grad on `plain`,
    the step its gradients with respect to `grads` under grad_out."""
    def forward():
        with torch.no_grad():
            return attention(*plain)

    def step():
        return torch.autograd.grad(attention(*grads), grads, grad_out)

    return forward, step


def _tiny_problem() -> tuple:
    """((q, k, v), leaves, dout) in flashkit's (b, s, h, d) layout and the same copied into
    SDPA's and Flex's (b, h, s, d)."""
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    qh, kh, vh, douth = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
    return (((q, k, v), [x.clone().requires_grad_() for x in (q, k, v)], dout),
            ((qh, kh, vh), [x.clone().requires_grad_() for x in (qh, kh, vh)], douth))


def tiny_calls(causal: bool) -> dict:
    """name -> (forward, step) callables on the tiny problem."""
    ours, theirs = _tiny_problem()
    calls = {"flashkit": _pair(lambda *t: flashkit.flash_attn_func(*t, causal=causal), *ours)}
    for name in ("cudnn", "flash", "efficient", "flex"):
        calls[name] = _pair(anchor_call(name, causal), *theirs)
    return calls


def variant_calls() -> dict:
    """name -> (forward, step) callables on the tiny problem with a user's variant: a causal
    document mask (documents of 48 tokens) as a block mask, flashkit's against compiled
    FlexAttention's, each built once outside the timing; and SDPA cuDNN's plain causal call,
    the scale of the other rows' wall_x_cudnn (it computes no document mask)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from flashkit import variants

    ours, theirs = _tiny_problem()
    doc = (torch.arange(S, device="cuda") // 48).to(torch.int32)
    our_mask = flashkit.create_block_mask(variants.document_mask(doc, causal=True), None, None,
                                          S, S)
    their_mask = create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i), None,
                                   None, S, S)
    flex = anchor_flex_compiled()
    return {"flashkit": _pair(lambda *t: flashkit.flash_attn_func(*t, block_mask=our_mask),
                              *ours),
            "flex": _pair(lambda *t: flex(*t, block_mask=their_mask), *theirs),
            "cudnn": _pair(anchor_call("cudnn", True), *theirs)}


def varlen_calls() -> dict:
    """name -> (forward, step) callables: the tiny problem's tokens as VARLEN_SEQUENCES causal
    sequences packed without padding, flashkit.flash_attn_varlen_func (its cu_seqlens checked
    on the device every call) against SDPA cuDNN's causal call on the same sequences as a
    batch (what the padded layout costs a user when the sequences happen to be equal)."""
    length = S // VARLEN_SEQUENCES
    cu = torch.arange(0, S + 1, length, dtype=torch.int32, device="cuda")
    (q, k, v), leaves, dout = _tiny_problem()[0]

    def ours(*t):
        return flashkit.flash_attn_varlen_func(*t, cu, cu, length, length, causal=True)
    packed = [x.reshape(S, H, D) for x in (q, k, v)]
    grads = [x.detach().reshape(S, H, D).requires_grad_() for x in leaves]
    batched = [x.reshape(VARLEN_SEQUENCES, length, H, D).transpose(1, 2).contiguous()
               for x in (q, k, v, dout)]
    return {"flashkit": _pair(ours, packed, grads, dout.reshape(S, H, D)),
            "cudnn": _pair(anchor_call("cudnn", True), batched[:3],
                           [x.clone().requires_grad_() for x in batched[:3]], batched[3])}


def decode_calls(cached: int) -> dict:
    """name -> decoding-step callable: one new token over `cached` keys."""
    shape_q = (1, 1, DECODE_Q_HEADS, DECODE_D)
    cache_shape = (1, cached + 64, DECODE_KV_HEADS, DECODE_D)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(cache_shape, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    k_new, v_new = (torch.randn(1, 1, DECODE_KV_HEADS, DECODE_D, device="cuda",
                                dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((1,), cached, dtype=torch.int32, device="cuda")

    def ours():
        return flashkit.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                cache_seqlens=lens, causal=True)

    qh = q.transpose(1, 2)
    kh, vh = (c[:, :cached + 1].transpose(1, 2) for c in (k_cache, v_cache))
    calls = {"flashkit": ours}
    for name in ("cudnn", "flash", "efficient"):
        attention = sdpa(name)
        calls[name] = lambda attention=attention: attention(qh, kh, vh, enable_gqa=True)
    return calls


def growing_cache_calls(calls: int) -> dict:
    """name -> decoding-step callable over a DynamicCache-like cache one key longer every call
    (each implementation counts its own lengths from 1024: flashkit sees a new key count every
    call, as transformers' decoding hands it one)."""
    q = torch.randn(1, DECODE_Q_HEADS, 1, DECODE_D, device="cuda", dtype=torch.bfloat16)
    room = DECODE_KV_HEADS * (1024 + calls + 64) * DECODE_D
    cache = torch.randn(2, room, device="cuda", dtype=torch.bfloat16)

    def keys(length):  # (1, heads_k, length, d) contiguous, as torch.cat leaves a DynamicCache
        return (cache[i, :DECODE_KV_HEADS * length * DECODE_D].view(
            1, DECODE_KV_HEADS, length, DECODE_D) for i in range(2))

    def counted(step):
        lengths = iter(range(1024, 1024 + calls + 64))
        return lambda: step(next(lengths))

    def ours(length):
        k, v = keys(length)
        return flashkit.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                        causal=True)

    calls_by_name = {"flashkit": counted(ours)}
    for name in ("cudnn", "flash", "efficient"):
        attention = sdpa(name)

        def theirs(length, attention=attention):
            return attention(q, *keys(length), enable_gqa=True)
        calls_by_name[name] = counted(theirs)
    return calls_by_name


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300, help="calls per timed loop")
    ap.add_argument("--rounds", type=int, default=7,
                    help="timed loops per call, interleaved with the other implementations'")
    add_out_argument(ap, "overhead")
    args = ap.parse_args(argv)
    result = Result("overhead", args.out, config={"calls": args.calls, "rounds": args.rounds})
    log(str(result.data["env"]))
    rows, profiles = [], {}

    def add(problem: str, kind: str, fns: dict) -> None:
        timed = interleaved(fns, args.calls, args.rounds)
        cudnn = timed.get("cudnn", {}).get("wall_us")
        for name, row in timed.items():
            ratio = None if cudnn is None or row["wall_us"] is None else row["wall_us"] / cudnn
            rows.append({"problem": problem, "call": kind, "impl": name, **row,
                         "wall_x_cudnn": ratio})

    with torch.inference_mode(False):
        for causal in (False, True):
            problem = f"b{B} s{S} h{H} d{D}" + (" causal" if causal else "")
            calls = tiny_calls(causal)
            for index, kind in enumerate(("forward", "step")):
                add(problem, kind, {name: pair[index] for name, pair in calls.items()})
                profiles[f"{kind}{' causal' if causal else ''}"] = profile(
                    calls["flashkit"][index], 200)
        calls = variant_calls()
        for index, kind in enumerate(("forward", "step")):
            add(f"b{B} s{S} h{H} d{D} document block mask", kind,
                {name: pair[index] for name, pair in calls.items()})
            profiles[f"{kind} document block mask"] = profile(calls["flashkit"][index], 200)
        calls = varlen_calls()
        for index, kind in enumerate(("forward", "step")):
            add(f"varlen {VARLEN_SEQUENCES} x {S // VARLEN_SEQUENCES} tokens h{H} d{D} causal",
                kind, {name: pair[index] for name, pair in calls.items()})
        with torch.no_grad():
            for cached in CACHED:
                add(f"decode b1 {DECODE_Q_HEADS}/{DECODE_KV_HEADS} heads d{DECODE_D} {cached} "
                    "keys", "decode", decode_calls(cached))
            add(f"decode b1 {DECODE_Q_HEADS}/{DECODE_KV_HEADS} heads d{DECODE_D} over a growing "
                "DynamicCache (flash_attn_func)", "decode",
                growing_cache_calls(args.calls * (args.rounds + 1)))
    notes = ("wall_us: wall time per call of a tight loop with one synchronisation at the end "
             "(host-bound here, so the host time a loop pays per call); cpu_us: the calling "
             "thread's CPU time per call (Python, dispatch and driver work alone); medians of "
             f"{args.rounds} loops of {args.calls} calls, the implementations interleaved; "
             "wall_x_cudnn: wall_us over SDPA cuDNN's (lower is faster).")
    result.save("notes", notes)
    result.save("rows", rows)
    result.save("profiles", profiles)
    result.markdown(f"# overhead\n\n{notes}\n\n"
                    + table(rows, ["problem", "call", "impl", "wall_us", "cpu_us",
                                   "wall_x_cudnn"]))
    log(f"wrote {result.path}")


if __name__ == "__main__":
    main()
