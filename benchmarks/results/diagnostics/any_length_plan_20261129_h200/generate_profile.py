"""Greedy generate at batch 1 on the integrations suite's model, flashkit against sdpa: timed
twice each, then once each under cProfile (run from the repository root, src on PYTHONPATH)."""
import cProfile
import io
import pstats
import sys
import time

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/suites")
import torch  # noqa: E402

import integrations as it  # noqa: E402
from flashkit.integrations.transformers import register  # noqa: E402

size = dict(it.FULL)
name = register()
model = it.build_model(size, "cuda").eval()
ids = torch.randint(1, size["vocab"], (1, 128), generator=torch.Generator().manual_seed(0)).cuda()
kw = dict(max_new_tokens=128, min_new_tokens=128, do_sample=False)


def generate():
    with torch.no_grad():
        model.generate(input_ids=ids, **kw)
    torch.cuda.synchronize()


for impl in (name, "sdpa", name, "sdpa"):
    model.set_attn_implementation(impl)
    generate()
    start = time.perf_counter()
    generate()
    print(impl, "tok/s", 128 / (time.perf_counter() - start), flush=True)
for impl in (name, "sdpa"):
    model.set_attn_implementation(impl)
    profile = cProfile.Profile()
    profile.runcall(generate)
    for order, lines, chars in (("cumulative", 60, 9000), ("tottime", 25, 5000)):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(lines)
        print("=====", impl, order)
        print(text.getvalue()[:chars])
