"""A transformers Llama's attention on one GPU: the attention step alone at the model's shape
(batch 2, 4096 tokens, 16 query / 4 kv heads, d128, causal, bf16) for flashkit and SDPA's
backends, and with --profile the kernels of the model's training step with flashkit and with
sdpa (torch.profiler), the layout and the dispatch choice of the tensors transformers hands
flashkit.

    PYTHONPATH=src python3 <this file> [--profile]    # from the repository root

01_llama_step_profile.txt and 03_attention_alone_llama_shape.txt were made by this script's
two parts (the first run's attention cases also included SDPA FA2 and the efficient backend).
"""

import argparse
import logging
import sys
import time

import torch

sys.path[:0] = ["benchmarks", "benchmarks/suites"]
from common import idle_start_ms, sdpa  # noqa: E402

import flashkit  # noqa: E402
from integrations import FULL, build_model  # noqa: E402

B, S, H, HK, D = 2, 4096, 16, 4, 128


def attention_alone():
    def leaf(*shape, sdpa_layout=False):
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        return (x.transpose(1, 2).contiguous().transpose(1, 2) if sdpa_layout
                else x).requires_grad_()

    q, k, v = leaf(B, S, H, D), leaf(B, S, HK, D), leaf(B, S, HK, D)
    qs, ks, vs = (leaf(*x.shape, sdpa_layout=True) for x in (q, k, v))
    kr, vr = (x.detach().repeat_interleave(H // HK, 2).requires_grad_() for x in (k, v))
    dout = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    heads_first = [x.detach().transpose(1, 2).contiguous().requires_grad_()
                   for x in (q, k, v, kr, vr)]
    dout_h = dout.transpose(1, 2).contiguous()

    def ours(*t):
        return flashkit.flash_attn_func(*t, causal=True)
    cases = {"flashkit gqa, sdpa layout": (ours, (qs, ks, vs), dout),
             "flashkit gqa": (ours, (q, k, v), dout),
             "flashkit mha (kv repeated)": (ours, (q, kr, vr), dout)}
    cudnn = sdpa("cudnn")
    cases["cudnn gqa"] = (lambda a, b, c: cudnn(a, b, c, True, enable_gqa=True),
                          heads_first[:3], dout_h)
    cases["cudnn mha"] = (lambda a, b, c: cudnn(a, b, c, True),
                          [heads_first[0], *heads_first[3:]], dout_h)
    for name, (fn, args, grad) in cases.items():
        def forward(fn=fn, args=args):
            with torch.no_grad():
                fn(*args)

        def step(fn=fn, args=args, grad=grad):
            torch.autograd.grad(fn(*args), args, grad)
        print(name, dict(fwd_ms=idle_start_ms(forward, 20, 3),
                         step_ms=idle_start_ms(step, 20, 3)), flush=True)


def model_profile():
    from torch.profiler import ProfilerActivity, profile

    import flashkit.integrations.transformers as hf

    seen = set()

    def spy(q, k, v, **kwargs):  # the layouts transformers hands flashkit, once each
        key = (q.stride(), k.stride(), v.stride())
        if key not in seen:
            seen.add(key)
            print("strides of q, k, v", tuple(q.shape), key, flush=True)
        return flashkit.flash_attn_func(q, k, v, **kwargs)
    hf.flashkit = type("Spy", (), {"flash_attn_func": staticmethod(spy),
                                   "flash_attn_varlen_func": flashkit.flash_attn_varlen_func})
    choices = set()
    log = logging.getLogger("flashkit.dispatch")
    log.setLevel(logging.DEBUG)
    log.addHandler(type("Once", (logging.Handler,), {"emit": lambda self, record: (
        record.getMessage() in choices or print("dispatch:", record.getMessage(), flush=True),
        choices.add(record.getMessage()))})())
    model = build_model(FULL, "cuda").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, FULL["vocab"], (B, S), device="cuda")

    def train_step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for impl in (hf.register(), "sdpa"):
        model.set_attn_implementation(impl)
        for _ in range(3):
            train_step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            train_step()
        torch.cuda.synchronize()
        print(impl, "step ms", (time.perf_counter() - start) / 5 * 1e3, flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                train_step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                        max_name_column_width=70), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="store_true")
    attention_alone()
    if ap.parse_args().profile:
        model_profile()
