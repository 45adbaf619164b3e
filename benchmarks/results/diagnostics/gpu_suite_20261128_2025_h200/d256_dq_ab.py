"""Public-API backward at head dim 256 of two flashkit source trees, one process per tree,
alternating: python d256_dq_ab.py OLD_SRC NEW_SRC (each a directory holding flashkit/)."""
import json
import subprocess
import sys

def worker(tree):
    sys.path.insert(0, tree)
    import torch, flashkit
    torch.manual_seed(0)
    out = {}
    for causal in (False, True):
        q, k, v = (torch.randn(2, 4096, 8, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        o = flashkit.flash_attn_func(q, k, v, causal=causal); g = torch.randn_like(o)
        def bwd():
            torch.autograd.grad(o, (q, k, v), g, retain_graph=True)
        for _ in range(3): bwd()
        torch.cuda.synchronize()
        ts = []
        for _ in range(15):
            a, b = torch.cuda.Event(True), torch.cuda.Event(True)
            a.record(); bwd(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
        ts.sort(); out[f"bwd_{'causal' if causal else 'full'}_ms"] = ts[len(ts)//2]
    print(json.dumps(out))
if sys.argv[1] == "--worker":
    worker(sys.argv[2]); sys.exit()
old, new = sys.argv[1:3]
for tree in (old, new, old, new):
    r = subprocess.run([sys.executable, __file__, "--worker", tree], capture_output=True, text=True, timeout=60)
    print(tree, (r.stdout + r.stderr).strip().splitlines()[-1][:300], flush=True)
