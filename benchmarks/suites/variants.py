"""variants: user score_mod / mask_mod / block_mask against FlexAttention, on the GPU.

    PYTHONPATH=src python3 benchmarks/run.py variants [--out DIR] [--lengths 4096]
        [--parts first_call,examples,packed,captured,builtins,per_head]   (configs: by name)

bf16, head dim 128, 16 heads, batch = 16k tokens / seqlen, public APIs as users call them:
flashkit.flash_attn_func with the modifiers against torch.compile(flex_attention) with the same
modifiers written as FlexAttention functions, both in the (batch, seqlen, heads, d) /
(batch, heads, seqlen, d) layout they take. Times are triton.testing.do_bench medians:
forward under no_grad, backward as autograd.grad on a retained graph (q, k, v gradients, and
the captured tensor's in `captured`), step = forward with grad + that backward.
Block masks are built once, outside the timing, by each library's create_block_mask.
The default run takes about 3 minutes on one H200.

Parts:
    examples    the six built-in examples (document, prefix_lm, alibi, softcap,
                relative_bias, window_globals), flashkit vs Flex, forward, backward and step;
                speedup = Flex ms / flashkit ms (the target is >= 1.2)
    packed      causal documents of 100-3000 tokens packed without padding into 16k tokens:
                flash_attn_varlen_func with a block mask over the packed tokens against
                Flex's document mask over the same tokens
    captured    score modifiers whose captured tensor learns (a relative-position bias table,
                ALiBi slopes, a per-token bias), flashkit vs Flex, backward and step with the
                captured tensor's gradient
    per_head    the document example's block mask shared by the heads and built per head
                (the same mask in every head): the cost of walking each head's own block
                lists, each against Flex's mask of the same kind
    builtins    the built-in features written as modifiers against the built-in arguments of
                flash_attn_func: ALiBi (alibi_slopes=), softcap (softcap=30; the modifier as
                written, which takes the GPU's tanh for bf16 as the built-in does, and with
                approx=False the exact tanh), causal and a causal window of 1024 (block masks
                against causal=True / window_size=(1024, 0));
                ratio = modifier ms / built-in ms (the target is <= 1.05)
    configs     each example under candidate tile sets of the portable kernels for variant
                calls (CANDIDATES: forward, dK/dV and dQ tiles at head dim 128, swapped into
                configs.VARIANT together for the run), forward, backward and step
    first_call  time to the first forward, then to the first backward, of a variant never
                seen before, each in a new process: with a cold disk cache (Triton's and
                Inductor's, fresh folders: every compile, the launchers' C builds included),
                then a second process on the same, now warm, cache (what a user's next run
                pays), then a third with a new variant on that warm cache (what a user who has
                run the library before pays for a variant they just wrote: its kernels
                compile, the launchers' C modules are cached); torch's own lazy imports at a
                first autograd.grad are paid before timing; and in each process the kernels
                built or loaded at a new length of the same divisibility class (the target:
                none) and at an odd length, with contiguous inputs at those lengths
Results: DIR/<date>_<device>.json and .md (common.Result: rewritten after every case, so an
interrupted run keeps what it measured), with date, device and versions.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from common import (  # noqa: E402
    Result,
    add_out_argument,
    anchor_flex_compiled,
    bench,
    log,
    name_list,
    table,
)

import flashkit  # noqa: E402
from flashkit import variants  # noqa: E402
from flashkit.ops.triton import configs  # noqa: E402

HEAD_DIM, NHEADS, TOKENS, DTYPE = 128, 16, 16384, torch.bfloat16
FIRST_CALL_LENGTH = 4096
WINDOW, CAP = 1024, 30.0
EXAMPLES = ("document", "prefix_lm", "alibi", "softcap", "relative_bias", "window_globals")


def problem(seqlen: int) -> dict:
    """Inputs and every example's captured tensors for one length."""
    batch = max(1, TOKENS // seqlen)
    dev = "cuda"
    q, k, v, dout = (torch.randn(batch, seqlen, NHEADS, HEAD_DIM, dtype=DTYPE, device=dev)
                     for _ in range(4))
    doc = (torch.arange(seqlen, device=dev) // 1000).to(torch.int32)  # documents of 1000
    doc = doc.expand(batch, seqlen).contiguous()
    prefix = torch.randint(seqlen // 4, seqlen // 2, (batch,), dtype=torch.int32, device=dev)
    slopes = torch.rand(NHEADS, device=dev) * 0.1
    table = torch.randn(NHEADS, 2 * 128 + 1, device=dev)
    bias = torch.randn(batch, seqlen, device=dev)
    return dict(q=q, k=k, v=v, dout=dout, doc=doc, prefix=prefix, slopes=slopes, table=table,
                bias=bias, batch=batch, seqlen=seqlen)


def ours_mods(name: str, p: dict, heads: int | None = None) -> dict:
    """flash_attn_func keyword arguments of an example (block masks for the masks, shared by
    the heads, or built per head with `heads`)."""
    b, s = p["batch"], p["seqlen"]

    def block(mod):
        return dict(block_mask=flashkit.create_block_mask(mod, b, heads, s, s, device="cuda"))
    return {
        "document": lambda: block(variants.document_mask(p["doc"], causal=True)),
        "prefix_lm": lambda: block(variants.prefix_lm(p["prefix"])),
        "alibi": lambda: dict(score_mod=variants.alibi(p["slopes"])),
        "softcap": lambda: dict(score_mod=variants.softcap(CAP)),
        "relative_bias": lambda: dict(score_mod=variants.relative_bias(p["table"])),
        "token_bias": lambda: dict(score_mod=variants.token_bias(p["bias"])),
        "window_globals": lambda: block(variants.sliding_window_with_globals(WINDOW // 2, 64)),
        "causal": lambda: block(variants.causal_mask()),
        "window": lambda: block(variants.causal_window(WINDOW)),
    }[name]()


def flex_mods(name: str, p: dict, heads: int | None = None) -> dict:
    """The same example as FlexAttention modifiers (score_mod, block_mask; heads as in
    ours_mods)."""
    from torch.nn.attention.flex_attention import create_block_mask
    b, s = p["batch"], p["seqlen"]
    doc, prefix, slopes, table, bias = p["doc"], p["prefix"], p["slopes"], p["table"], p["bias"]

    def block(mask_mod):
        return dict(block_mask=create_block_mask(mask_mod, b, heads, s, s, device="cuda"))

    def document(bi, h, qi, ki):
        return (doc[bi, qi] == doc[bi, ki]) & (qi >= ki)

    def prefix_lm(bi, h, qi, ki):
        return (ki <= qi) | (ki < prefix[bi])

    def window_globals(bi, h, qi, ki):
        return ((qi - ki).abs() <= WINDOW // 2) | (qi < 64) | (ki < 64)

    def alibi(score, bi, h, qi, ki):
        return score - slopes[h] * (qi - ki).abs()

    def softcap(score, bi, h, qi, ki):
        return CAP * torch.tanh(score / CAP)

    def relative_bias(score, bi, h, qi, ki):
        return score + table[h, (ki - qi).clamp(-128, 128) + 128]

    def token_bias(score, bi, h, qi, ki):
        return score + bias[bi, ki]

    return {"document": lambda: block(document), "prefix_lm": lambda: block(prefix_lm),
            "window_globals": lambda: block(window_globals),
            "alibi": lambda: dict(score_mod=alibi), "softcap": lambda: dict(score_mod=softcap),
            "relative_bias": lambda: dict(score_mod=relative_bias),
            "token_bias": lambda: dict(score_mod=token_bias)}[name]()


def timed(run, q, k, v, dout, learned=()) -> tuple[float, float, float]:
    """(forward ms, backward ms, step ms) of run(q, k, v) -> out; the backward and the step
    differentiate q, k, v and the `learned` tensors (which require grad)."""
    with torch.no_grad():
        fwd = bench(lambda: run(q, k, v))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = run(*leaves)
    wrt = [*leaves, *learned]
    bwd = bench(lambda: torch.autograd.grad(out, wrt, dout, retain_graph=True))
    step = bench(lambda: torch.autograd.grad(run(*leaves), wrt, dout))
    return fwd, bwd, step


def time_ours(p: dict, learned=(), **kwargs) -> tuple[float, float, float]:
    return timed(lambda q, k, v: flashkit.flash_attn_func(q, k, v, **kwargs),
                 p["q"], p["k"], p["v"], p["dout"], learned)


def time_flex(p: dict, compiled, learned=(), **mods) -> tuple[float, float, float]:
    heads_first = [p[n].transpose(1, 2).contiguous() for n in ("q", "k", "v", "dout")]
    return timed(lambda q, k, v: compiled(q, k, v, **mods), *heads_first, learned=learned)


def comparison(ours, theirs) -> dict:
    """A row's times and speedups (Flex ms / flashkit ms), forward, backward and step."""
    row = {}
    for n, what in enumerate(("fwd", "bwd", "step")):
        row.update({f"flashkit_{what}_ms": ours[n], f"flex_{what}_ms": theirs[n],
                    f"speedup_{what}": theirs[n] / ours[n]})
    return row


def part_examples(p: dict, compiled, record) -> None:
    for name in EXAMPLES:
        ours = time_ours(p, **ours_mods(name, p))
        theirs = time_flex(p, compiled, **flex_mods(name, p))
        record("examples", dict(example=name, seqlen=p["seqlen"], batch=p["batch"],
                                **comparison(ours, theirs)))


def part_per_head(p: dict, compiled, record) -> None:
    """The document example's block mask shared by the heads and built per head (the same
    mask in each of the NHEADS heads): what walking each head's own block lists costs, each
    against Flex's mask of the same kind."""
    for heads in (None, NHEADS):
        ours = time_ours(p, **ours_mods("document", p, heads))
        theirs = time_flex(p, compiled, **flex_mods("document", p, heads))
        record("per_head", dict(example="document", mask="per head" if heads else "shared",
                                seqlen=p["seqlen"], **comparison(ours, theirs)))


def packed_documents() -> tuple[list, torch.Tensor]:
    """(lengths, cu_seqlens on the GPU) of documents of 100-3000 tokens packed into TOKENS, the
    last one cut to fit (a fixed seed: the same documents every run)."""
    gen = torch.Generator().manual_seed(0)
    lengths = []
    while sum(lengths) < TOKENS:
        lengths.append(min(int(torch.randint(100, 3001, (1,), generator=gen)),
                           TOKENS - sum(lengths)))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    return lengths, cu


def part_packed(compiled, record) -> None:
    """Causal documents packed without padding into TOKENS tokens (varlen, one block mask over
    the packed tokens), flashkit's flash_attn_varlen_func against Flex's document mask over the
    same packed tokens (B = 1)."""
    from torch.nn.attention.flex_attention import create_block_mask

    lengths, cu = packed_documents()
    longest = max(lengths)
    q, k, v, dout = (torch.randn(TOKENS, NHEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
                     for _ in range(4))
    ours_mask = flashkit.create_block_mask(variants.causal_mask(), None, None, TOKENS, TOKENS,
                                           device="cuda", cu_seqlens_q=cu, cu_seqlens_k=cu)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"),
                                  torch.tensor(lengths, device="cuda"))

    def document(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)
    theirs_mask = create_block_mask(document, None, None, TOKENS, TOKENS, device="cuda")
    ours = timed(lambda q, k, v: flashkit.flash_attn_varlen_func(
        q, k, v, cu, cu, longest, longest, block_mask=ours_mask), q, k, v, dout)
    heads_first = [x.transpose(0, 1)[None].contiguous() for x in (q, k, v, dout)]
    theirs = timed(lambda q, k, v: compiled(q, k, v, block_mask=theirs_mask), *heads_first)
    record("packed", dict(example="causal documents", tokens=TOKENS, sequences=len(lengths),
                          **comparison(ours, theirs)))


CAPTURED = {"relative_bias": "table", "alibi": "slopes", "token_bias": "bias"}


def part_captured(p: dict, compiled, record) -> None:
    """Score modifiers whose captured tensor requires grad: its gradient joins q, k, v's."""
    for name, tensor in CAPTURED.items():
        learned = dict(p, **{tensor: p[tensor].detach().clone().requires_grad_()})
        ours = time_ours(learned, [learned[tensor]], **ours_mods(name, learned))
        failed = {}
        try:
            theirs = time_flex(learned, compiled, [learned[tensor]], **flex_mods(name, learned))
        except Exception as error:  # Flex's compile can fail (shared memory): say so, go on
            theirs, failed = (float("nan"),) * 3, dict(flex_error=str(error).splitlines()[-1])
        record("captured", dict(example=name, learned=tensor, seqlen=p["seqlen"],
                                batch=p["batch"], **comparison(ours, theirs), **failed))


# Candidate d128 tile sets of the variant kernels, each (forward, dK/dV, dQ) as (BLOCK_M, BLOCK_N,
# num_warps, num_stages), swapped into configs.VARIANT whole (the kernels share the backward's
# time). "sm90" (the plain kernels' tiles) overflows shared memory with relative_bias's table;
# "flex_sm90" is FlexAttention's own sm_90 bf16 d128 default (torch's template heuristics:
# forward 128 x 64, dK/dV 64 x 128, dQ 128 x 64, each 3 stages and 8 warps).
CANDIDATES = {
    "spill_free": ((128, 64, 8, 2), (32, 128, 8, 2), (128, 32, 8, 2)),
    "sm90": ((128, 128, 8, 3), (64, 128, 8, 3), (128, 32, 8, 3)),
    "wide2": ((128, 128, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2)),
    "flexlike": ((128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3)),
    "flex_sm90": ((128, 64, 8, 3), (64, 128, 8, 3), (128, 64, 8, 3)),
}
_KERNELS = ("forward", "dkdv", "dq")


def part_configs(p: dict, record) -> None:
    """Each candidate set swapped into configs.VARIANT at d128, every example timed (forward,
    backward, step); a set that fails to launch for an example is a result too."""
    defaults = {kernel: configs.VARIANT[kernel][HEAD_DIM] for kernel in _KERNELS}
    for name, tiles in CANDIDATES.items():
        for kernel, tile in zip(_KERNELS, tiles, strict=True):
            configs.VARIANT[kernel][HEAD_DIM] = tile
        try:
            for example in EXAMPLES:
                row = dict(tiles=name, example=example, seqlen=p["seqlen"])
                try:
                    fwd, bwd, step = time_ours(p, **ours_mods(example, p))
                    record("configs", dict(row, fwd_ms=fwd, bwd_ms=bwd, step_ms=step))
                except Exception as err:
                    record("configs", dict(row, fwd_ms=float("nan"), bwd_ms=float("nan"),
                                           step_ms=float("nan"), error=repr(err)[:200]))
        finally:
            for kernel, tile in defaults.items():
                configs.VARIANT[kernel][HEAD_DIM] = tile


def part_builtins(p: dict, record) -> None:
    cases = {"alibi": (dict(alibi_slopes=p["slopes"]), dict(score_mod=variants.alibi(p["slopes"]))),
             "softcap": (dict(softcap=CAP), dict(score_mod=variants.softcap(CAP))),
             "softcap, exact tanh": (dict(softcap=CAP),
                                     dict(score_mod=variants.softcap(CAP, approx=False))),
             "causal": (dict(causal=True), ours_mods("causal", p)),
             "window": (dict(window_size=(WINDOW, 0)), ours_mods("window", p))}
    for name, (builtin, modded) in cases.items():
        base, mod = time_ours(p, **builtin)[:2], time_ours(p, **modded)[:2]
        record("builtins", dict(feature=name, seqlen=p["seqlen"], batch=p["batch"],
                                builtin_fwd_ms=base[0], builtin_bwd_ms=base[1],
                                mod_fwd_ms=mod[0], mod_bwd_ms=mod[1],
                                ratio_fwd=mod[0] / base[0], ratio_bwd=mod[1] / base[1]))


_NEW_VARIANT = '''
import triton
import triton.language as tl

@triton.jit
def score_mod(score, b, h, q_idx, kv_idx):
    return score - {c} * tl.abs(q_idx - kv_idx).to(tl.float32)

@triton.jit
def score_grad(score, b, h, q_idx, kv_idx):
    return 1.0
'''


def first_call_child(library: str, c: str) -> dict:
    """In a new process: seconds to the first forward and to its backward of the variant with
    constant c, at FIRST_CALL_LENGTH; then (flashkit) the kernels built or loaded at a new length
    of the same divisibility class and at an odd length."""
    p = problem(FIRST_CALL_LENGTH)
    if library == "flex":
        from torch.nn.attention.flex_attention import flex_attention
        compiled = torch.compile(flex_attention, dynamic=False)
        slope = float(c)
        heads_first = [p[n].transpose(1, 2).contiguous() for n in ("q", "k", "v", "dout")]
        leaves = [x.requires_grad_() for x in heads_first[:3]]
        def score_mod(s, b, h, qi, ki):
            return s - slope * (qi - ki).abs()
        fwd, bwd = first_forward_backward(lambda: compiled(*leaves, score_mod=score_mod),
                                          leaves, heads_first[3])
        return dict(fwd_s=fwd, bwd_s=bwd)
    path = os.path.join(tempfile.gettempdir(), f"flashkit_first_call_{c}.py")
    with open(path, "w") as f:  # triton.jit reads a function's source from its file
        f.write(_NEW_VARIANT.format(c=c))
    namespace = {}
    exec(compile(open(path).read(), path, "exec"), namespace)
    mod = variants.ScoreMod(namespace["score_mod"], grad=namespace["score_grad"])

    def call(q, k, v):
        return flashkit.flash_attn_func(q, k, v, score_mod=mod)
    leaves = [p[n].detach().requires_grad_() for n in ("q", "k", "v")]
    fwd, bwd = first_forward_backward(lambda: call(*leaves), leaves, p["dout"])
    # Triton compiles (or loads from its disk cache) in _do_compile, on an in-memory miss. (Its
    # post-compile hook cannot count here: it serialises the constexprs, the user's
    # score_mod among them, to JSON.)
    from triton.runtime.jit import JITFunction
    do_compile, built = JITFunction._do_compile, []

    def counted(self, *args, **kwargs):
        built.append(self.__name__)
        return do_compile(self, *args, **kwargs)

    JITFunction._do_compile = counted
    counts = {}
    try:
        for label, seqlen in (("new_length_kernels", FIRST_CALL_LENGTH - 128),
                              ("odd_length_kernels", FIRST_CALL_LENGTH - 127)):
            built.clear()
            # contiguous, as a user's tensors at that length (a slice of the longer ones has
            # another batch stride, which the TMA kernels decline: other kernels would run)
            x = [p[n][:, :seqlen].contiguous().requires_grad_() for n in ("q", "k", "v")]
            torch.autograd.grad(call(*x), x, p["dout"][:, :seqlen].contiguous())
            torch.cuda.synchronize()
            counts[label] = len(built)
    finally:
        JITFunction._do_compile = do_compile
    return dict(fwd_s=fwd, bwd_s=bwd, **counts)


def part_first_call(record) -> None:
    """Each library's first call in new processes: a cold disk cache, then the same cache warm,
    then a new variant (another constant) on that warm cache: what a user who ran the library
    before pays for a variant they have just written."""
    import json
    import subprocess

    seed = time.time_ns() % 997
    variant = {"cold": f"{seed / 1e4 + 1e-3:.6f}"}  # a variant no cache has seen
    variant["warm"] = variant["cold"]
    variant["new variant"] = f"{seed / 1e4 + 2e-3:.6f}"
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache, "triton"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))
        for library in ("flashkit", "flex"):
            for disk_cache, c in variant.items():
                done = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--first-call-child", library,
                     c], env=env, capture_output=True, text=True, timeout=300)
                if done.returncode != 0:
                    log(done.stderr[-2000:])
                    raise RuntimeError(f"first-call child ({library}, {disk_cache}) failed")
                row = json.loads(done.stdout.strip().splitlines()[-1])
                record("first_call", dict(library=library, disk_cache=disk_cache,
                                          seqlen=FIRST_CALL_LENGTH, total_s=row["fwd_s"] +
                                          row["bwd_s"], **row))


def first_forward_backward(run, leaves, dout) -> tuple[float, float]:
    """(seconds to the first forward's result, then seconds to its gradients). torch's own
    first `autograd.grad` with a gradient argument imports its symbolic-shapes module (sympy
    with it: 3.0 s on the benchmark machine, whose site-packages keep no bytecode), whatever
    the library; that happens before the clock starts, for every library alike."""
    probe = torch.ones(2, requires_grad=True)
    torch.autograd.grad(probe * 2, probe, torch.ones(2))
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = run()
    torch.cuda.synchronize()
    forward = time.perf_counter() - start
    torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    return forward, time.perf_counter() - start - forward


_COMPARED = ["flashkit_fwd_ms", "flex_fwd_ms", "speedup_fwd", "flashkit_bwd_ms", "flex_bwd_ms",
             "speedup_bwd", "flashkit_step_ms", "flex_step_ms", "speedup_step"]
COLUMNS = {
    "examples": ["example", "seqlen", *_COMPARED],
    "captured": ["example", "learned", "seqlen", *_COMPARED, "flex_error"],
    "packed": ["example", "tokens", "sequences", *_COMPARED],
    "per_head": ["example", "mask", "seqlen", *_COMPARED],
    "builtins": ["feature", "seqlen", "builtin_fwd_ms", "mod_fwd_ms", "ratio_fwd",
                 "builtin_bwd_ms", "mod_bwd_ms", "ratio_bwd"],
    "configs": ["tiles", "example", "seqlen", "fwd_ms", "bwd_ms", "step_ms"],
    "first_call": ["library", "disk_cache", "seqlen", "fwd_s", "bwd_s", "total_s",
                   "new_length_kernels", "odd_length_kernels"],
}


# The parts a run may measure, each on its own (--parts); benchmarks/make_readme.py shows each
# part from the newest run that measured it.
PARTS = ("first_call", "examples", "packed", "captured", "builtins", "configs", "per_head")


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--first-call-child":
        import json
        print(json.dumps(first_call_child(sys.argv[2], sys.argv[3])))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out_argument(ap, "variants")
    ap.add_argument("--lengths", default="4096", help="comma-separated sequence lengths")
    ap.add_argument("--parts", default="first_call,examples,packed,captured,builtins,per_head",
                    help="comma-separated: first_call, examples, packed, captured, builtins, "
                    "per_head, configs")
    args = ap.parse_args()
    parts = name_list(ap, "--parts", args.parts, PARTS)
    result = Result("variants", args.out, config=dict(head_dim=HEAD_DIM, nheads=NHEADS,
                                                      tokens=TOKENS, dtype=str(DTYPE)))
    rows = {part: [] for part in parts}

    def record(part: str, row: dict) -> None:
        rows[part].append(row)
        log(f"{part} {row}")
        result.save(part, rows[part])
        result.markdown("\n".join(f"## {name}\n\n" + table(r, COLUMNS[name])
                                  for name, r in rows.items() if r))

    lengths = [int(s) for s in args.lengths.split(",")]
    if "first_call" in parts:  # new processes, before this one holds the GPU's memory
        part_first_call(record)
    compiled = anchor_flex_compiled()
    if "packed" in parts:
        part_packed(compiled, record)
    for seqlen in lengths:
        p = problem(seqlen)
        if "examples" in parts:
            part_examples(p, compiled, record)
        if "captured" in parts:
            part_captured(p, compiled, record)
        if "per_head" in parts:
            part_per_head(p, compiled, record)
        if "configs" in parts and seqlen == lengths[0]:  # the tile sweep at one length
            part_configs(p, record)
        if "builtins" in parts:
            part_builtins(p, record)


if __name__ == "__main__":
    main()
