"""Time the public API of two flashkit source trees in one run on one GPU: the check that a
refactor whose sm_90 machine code changed a little (sass_fingerprint.py) did not change speed.

    git archive OLD src/flashkit | tar -x -C /tmp/old --strip-components=1
    PYTHONPATH=src python3 benchmarks/diagnostics/tree_ab.py /tmp/old src [--rounds 4] [--out DIR]
        [--cases features|backward|layout|decode]

Each round runs one process per tree (imports differ, so a process holds one tree), the order
alternating from round to round: with a fixed order the tree run second came out 2-18% slower
in most cases on an H200, the byte-identical Gluon forward included. Cases, bf16, 16 heads,
batch 2 at 8k tokens: a causal ALiBi call at head dim 128 and one with every score feature and
dropout at 256 (forward without grad, and the step: forward with grad + backward), and a
decoding call (batch 32, 32 query / 8 kv heads, 16k cached keys) plain and with softcap and
ALiBi. --cases backward times the backward alone (autograd.grad of a kept forward) on causal
calls of 16k tokens, 2048 = heads x head dim, at d64 and d128 over 1k, 4k and 16k tokens per
sequence, full attention at 4k, d256 at 4k, and a transformers Llama's GQA call (batch 2, 4096
tokens, 16 query / 4 kv heads, d128). --cases layout: forward (no grad) and step of causal
GQA calls (16 / 4 heads, d128) on SDPA-layout q, k, v seen in flash-attn's layout
(q.transpose(1, 2), as a transformers model passes them), 4096 tokens as 1 to 32 sequences of
4096 to 128 (8192 as 2 x 4096), and a decoding call (one query row over 4096 keys), each next to
the same call on contiguous tensors and on q, k, v unbound from one packed qkv (MHA). --cases
decode: flash_attn_func without grad on one or
four query rows over 256 to 64k keys (32 query / 8 kv heads, d128, causal), batch 1 and 8,
the keys contiguous or in SDPA's layout: decoding through flash_attn_func. Each time is the
median of 15 calls timed with CUDA events, the GPU idle at each start (so host time counts
where it exceeds the GPU's); the reported time per tree is the median over rounds.
FLASHKIT_LOG_DISPATCH=1 makes a worker call each case once and log which kernels ran.
Writes DIR/tree_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def _worker(tree: str, which: str) -> None:
    sys.path.insert(0, tree)
    import torch

    import flashkit

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from common import idle_start_ms

    torch.manual_seed(0)

    def cases():
        """(name, callable) pairs; each callable binds its own tensors and arguments."""
        batch, seqlen, nheads = 2, 8192, 16
        slopes = torch.rand(nheads, device="cuda")
        for head_dim, name, kwargs in (
                (128, "alibi", dict(causal=True, alibi_slopes=slopes)),
                (256, "all", dict(window_size=(2048, 0), softcap=30.0, alibi_slopes=slopes,
                                  dropout_p=0.1))):
            q, k, v, dout = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda",
                                         dtype=torch.bfloat16) for _ in range(4))
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]

            def forward(q=q, k=k, v=v, kwargs=kwargs):
                with torch.no_grad():
                    flashkit.flash_attn_func(q, k, v, **kwargs)

            def step(leaves=leaves, dout=dout, kwargs=kwargs):
                flashkit.flash_attn_func(*leaves, **kwargs).backward(dout)
            yield f"d{head_dim} {name} forward", forward
            yield f"d{head_dim} {name} step", step
        q = torch.randn(32, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        k_cache = torch.randn(32, 16384, 8, 128, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        lengths = torch.full((32,), 16384, device="cuda", dtype=torch.int32)
        for name, kwargs in (("plain", {}), ("softcap+alibi", dict(
                softcap=30.0, alibi_slopes=torch.rand(32, device="cuda")))):
            def decode(kwargs=kwargs):
                flashkit.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                 causal=True, **kwargs)
            yield f"decode b32 16k {name}", decode

    def backward_cases():
        """(name, callable) pairs: the backward of one causal (or full) call."""
        shapes = [(16384 // seqlen, seqlen, 2048 // d, 2048 // d, d, True)
                  for d in (64, 128) for seqlen in (1024, 4096, 16384)]
        shapes += [(4, 4096, 16, 16, 128, False), (4, 4096, 8, 8, 256, True),
                   (2, 4096, 16, 4, 128, True)]
        for batch, seqlen, nheads, nheads_k, head_dim, causal in shapes:
            leaves = [torch.randn(batch, seqlen, h, head_dim, device="cuda",
                                  dtype=torch.bfloat16, requires_grad=True)
                      for h in (nheads, nheads_k, nheads_k)]
            out = flashkit.flash_attn_func(*leaves, causal=causal)
            dout = torch.randn_like(out)

            def backward(out=out, leaves=leaves, dout=dout):
                torch.autograd.grad(out, leaves, dout, retain_graph=True)
            yield (f"d{head_dim} {seqlen} {'causal' if causal else 'full'} {nheads}/{nheads_k}"
                   " heads backward", backward)

    def layout_cases():
        """(name, callable) pairs: forward and step on SDPA-layout q, k, v (dout contiguous,
        as a model's output gradient is), each tree with its own dispatch; the same calls on
        contiguous q, k, v, the reference; and q, k, v unbound from one packed qkv (k and v
        repeated to q's heads: flash_attn_qkvpacked_func's MHA)."""
        def sdpa_layout(batch, seqlen, heads):
            return torch.randn(batch, heads, seqlen, 128, device="cuda",
                               dtype=torch.bfloat16).transpose(1, 2)
        for batch, seqlen_q, seqlen_k in ((32, 128, 128), (16, 256, 256), (8, 512, 512),
                                          (4, 1024, 1024), (2, 4096, 4096), (8, 1, 4096)):
            dout = torch.randn(batch, seqlen_q, 16, 128, device="cuda", dtype=torch.bfloat16)
            q = sdpa_layout(batch, seqlen_q, 16)
            k, v = sdpa_layout(batch, seqlen_k, 4), sdpa_layout(batch, seqlen_k, 4)
            layouts = [("sdpa layout", (q, k, v)),
                       ("contiguous", [x.contiguous() for x in (q, k, v)])]
            if seqlen_q == seqlen_k:  # (b, s, 3, 16, d): MHA
                layouts.append(("qkv packed", torch.stack(
                    [x if x is q else x.repeat_interleave(4, dim=2) for x in (q, k, v)],
                    dim=2).unbind(2)))
            for layout, tensors in layouts:
                leaves = [x.detach().requires_grad_() for x in tensors]

                def forward(tensors=tensors):
                    with torch.no_grad():
                        flashkit.flash_attn_func(*tensors, causal=True)

                def step(leaves=leaves, dout=dout):
                    flashkit.flash_attn_func(*leaves, causal=True).backward(dout)
                name = f"b{batch} {seqlen_q} x {seqlen_k} {layout}"
                yield f"{name} forward", forward
                if seqlen_q > 1:
                    yield f"{name} step", step

    def decode_cases():
        """(name, callable) pairs: few query rows over many keys, without grad."""
        for batch, seqlen_q, seqlen_k, sdpa_layout in (
                (1, 1, 256, False), (1, 1, 512, False), (1, 1, 1024, False), (1, 1, 4096, False),
                (1, 1, 16384, False), (1, 1, 65536, False), (8, 1, 4096, False),
                (8, 1, 16384, False), (1, 4, 16384, False), (1, 1, 4096, True),
                (8, 1, 16384, True)):
            q = torch.randn(batch, seqlen_q, 32, 128, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(batch, 8, seqlen_k, 128, device="cuda",
                                dtype=torch.bfloat16).transpose(1, 2) if sdpa_layout else
                    torch.randn(batch, seqlen_k, 8, 128, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))

            def forward(q=q, k=k, v=v):
                with torch.no_grad():
                    flashkit.flash_attn_func(q, k, v, causal=True)
            yield (f"b{batch} {seqlen_q} x {seqlen_k}{' sdpa layout' if sdpa_layout else ''}"
                   " forward", forward)

    cases = {"backward": backward_cases, "layout": layout_cases,
             "decode": decode_cases}.get(which, cases)
    if os.environ.get("FLASHKIT_LOG_DISPATCH"):
        for name, fn in cases():
            print(name, file=sys.stderr)
            fn()
        return
    print(json.dumps({name: idle_start_ms(fn) for name, fn in cases()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", choices=["features", "backward", "layout", "decode"],
                    default="features")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.cases)
        return
    trees = {"old": args.old, "new": args.new}
    runs = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            done = subprocess.run([sys.executable, __file__, args.old, args.new, "--cases",
                                   args.cases, "--worker", trees[name]], capture_output=True,
                                  text=True, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = []
    for case in runs["new"][0]:
        old, new = (statistics.median(run[case] for run in runs[n]) for n in ("old", "new"))
        rows.append(dict(case=case, old_ms=old, new_ms=new, new_over_old=new / old))
        print(f"{case:44s} old {old:8.3f} ms  new {new:8.3f} ms  new/old {new / old:.3f}")
    with open(os.path.join(args.out, "tree_ab.json"), "w") as f:
        json.dump({"trees": trees, "runs": runs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
