import torch, json
from triton.testing import do_bench
from flashkit import fp8
from flashkit.ops.params import AttentionParams
from flashkit.ops.triton import forward_fp8, forward_hopper
res = []
for d in (64, 128, 256):
    for causal in (False, True):
        h = 2048 // d; s = 16384
        def qz(): return fp8.quantize(torch.randn(1, s, h, d, device="cuda"), per_head=True, dtype=torch.float8_e4m3fn)
        (q8, qd), (k8, kd), (v8, vd) = qz(), qz(), qz()
        p = AttentionParams(softmax_scale=d ** -0.5, window_right=0 if causal else None)
        desc = forward_fp8.descale_pairs(q8, v8, qd, kd, vd)
        flops = 4 * s * s * h * d / (2 if causal else 1)
        tg = do_bench(lambda: forward_hopper.attention_forward_fp8(q8, k8, v8, p, desc), warmup=50, rep=300)
        tp = do_bench(lambda: forward_fp8.attention_forward(q8, k8, v8, p, qd, kd, vd), warmup=50, rep=300)
        r = dict(d=d, causal=causal, gluon_tflops=flops / tg / 1e9, portable_tflops=flops / tp / 1e9)
        print(json.dumps(r), flush=True); res.append(r)
