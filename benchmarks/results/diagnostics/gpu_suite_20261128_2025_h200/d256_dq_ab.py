"""Public-API backward at head dim 256 of two flashkit source trees, one process per tree,
alternating (bf16, batch 2, 4096 tokens, 8 heads; median of 15 calls timed with CUDA events):

    python3 d256_dq_ab.py OLD_SRC NEW_SRC    (each a directory holding flashkit/)
"""

import json
import subprocess
import sys


def worker(tree):
    sys.path.insert(0, tree)
    import torch

    import flashkit

    torch.manual_seed(0)
    out = {}
    for causal in (False, True):
        q, k, v = (torch.randn(2, 4096, 8, 256, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        o = flashkit.flash_attn_func(q, k, v, causal=causal)
        g = torch.randn_like(o)

        def backward(o=o, inputs=(q, k, v), g=g):
            torch.autograd.grad(o, inputs, g, retain_graph=True)
        for _ in range(3):
            backward()
        torch.cuda.synchronize()
        times = []
        for _ in range(15):
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            backward()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        out[f"bwd_{'causal' if causal else 'full'}_ms"] = times[len(times) // 2]
    print(json.dumps(out))


def main():
    if sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return
    old, new = sys.argv[1:3]
    for tree in (old, new, old, new):
        run = subprocess.run([sys.executable, __file__, "--worker", tree], capture_output=True,
                             text=True, timeout=60)
        print(tree, (run.stdout + run.stderr).strip().splitlines()[-1][:300], flush=True)


if __name__ == "__main__":
    main()
