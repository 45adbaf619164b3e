"""Why the Llama training step is slower with flashkit than sdpa: the attention step alone at
the model's shape (GQA 16/4, d128, 2 x 4096, causal) and a kernel profile of the model step."""
import os, sys, time, statistics, json
import torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "benchmarks/suites")
import flashkit
from common import sdpa
from integrations import build_model, FULL
from torch.nn.functional import scaled_dot_product_attention as SDPA

def bench(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts)

B, S, H, HK, D = 2, 4096, 16, 4, 128
dt = torch.bfloat16
q = torch.randn(B, S, H, D, device="cuda", dtype=dt, requires_grad=True)
k = torch.randn(B, S, HK, D, device="cuda", dtype=dt, requires_grad=True)
v = torch.randn(B, S, HK, D, device="cuda", dtype=dt, requires_grad=True)
do = torch.randn(B, S, H, D, device="cuda", dtype=dt)
kr = k.detach().repeat_interleave(H // HK, 2).requires_grad_()
vr = v.detach().repeat_interleave(H // HK, 2).requires_grad_()
qh, kh, vh, krh, vrh = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v, kr, vr))
doh = do.transpose(1, 2).contiguous()
res = {}
def step(f, args, dout):
    def run():
        out = f(*args)
        torch.autograd.grad(out, args, dout)
    return run
def fwd(f, args):
    def run():
        with torch.no_grad(): f(*args)
    return run
cases = {
  "flashkit gqa": (lambda a, b, c: flashkit.flash_attn_func(a, b, c, causal=True), (q, k, v), do),
  "flashkit mha (kv repeated)": (lambda a, b, c: flashkit.flash_attn_func(a, b, c, causal=True), (q, kr, vr), do),
}
for name in ("cudnn", "flash", "efficient"):
    run = sdpa(name)
    cases[f"{name} gqa"] = (lambda a, b, c, run=run: run(a, b, c, True, enable_gqa=True), (qh, kh, vh), doh)
    cases[f"{name} mha"] = (lambda a, b, c, run=run: run(a, b, c, True), (qh, krh, vrh), doh)
cases["sdpa default gqa"] = (lambda a, b, c: SDPA(a, b, c, is_causal=True, enable_gqa=True), (qh, kh, vh), doh)
for name, (f, args, dout) in cases.items():
    try:
        res[name] = dict(fwd_ms=bench(fwd(f, args)), step_ms=bench(step(f, args, dout)))
    except Exception as e:
        res[name] = repr(e)[:200]
    print(name, res[name], flush=True)

# kernel profile of the model's training step, flashkit against sdpa
from flashkit.integrations.transformers import register
from torch.profiler import profile, ProfilerActivity
model = build_model(FULL, "cuda").train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
ids = torch.randint(0, FULL["vocab"], (2, 4096), device="cuda")
def tstep():
    model(input_ids=ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
import logging, flashkit.integrations.transformers as fkt
seen = set()
orig = fkt.flashkit.flash_attn_func
def spy(q, k, v, **kw):
    key = (q.stride(), k.stride(), v.stride())
    if key not in seen:
        seen.add(key); print("hf call strides", q.shape, key, q.is_contiguous(), k.is_contiguous(), v.is_contiguous(), flush=True)
    return orig(q, k, v, **kw)
fkt.flashkit = type("M", (), {"flash_attn_func": staticmethod(spy), "flash_attn_varlen_func": staticmethod(flashkit.flash_attn_varlen_func)})
lg = logging.getLogger("flashkit.dispatch"); lg.setLevel(logging.DEBUG)
class Once(logging.Handler):
    def __init__(self): super().__init__(); self.seen = set()
    def emit(self, r):
        m = r.getMessage()
        if m not in self.seen: self.seen.add(m); print("dispatch:", m, flush=True)
lg.addHandler(Once())
for impl in (register(), "sdpa"):
    model.set_attn_implementation(impl)
    for _ in range(3): tstep()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5): tstep()
    torch.cuda.synchronize()
    print(impl, "step ms", (time.perf_counter() - t) / 5 * 1e3, flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3): tstep()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70), flush=True)
