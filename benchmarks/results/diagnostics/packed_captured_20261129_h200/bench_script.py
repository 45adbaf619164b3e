import json, os, sys
sys.path.insert(0, "benchmarks")
import torch
import flashkit
from flashkit import variants
from common import idle_start_ms
torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)
lengths, TOKENS = [], 16384
while sum(lengths) < TOKENS:
    lengths.append(min(int(torch.randint(100, 3001, (1,), generator=gen)), TOKENS - sum(lengths)))
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
longest = max(lengths)
q, k, v, dout = (torch.randn(TOKENS, 16, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4))
mask = flashkit.create_block_mask(variants.causal_mask(), None, None, TOKENS, TOKENS, device="cuda", cu_seqlens_q=cu, cu_seqlens_k=cu)
res = {"tree": flashkit.__file__}
for name, make, cap in (("relative_bias", variants.relative_bias, torch.randn(16, 65, device="cuda")),
                        ("alibi", variants.alibi, torch.rand(16, device="cuda") * 0.1)):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    cap = cap.requires_grad_()
    def step():
        out = flashkit.flash_attn_varlen_func(*leaves, cu, cu, longest, longest, block_mask=mask, score_mod=make(cap))
        torch.autograd.grad(out, [*leaves, cap], dout)
    res[name] = idle_start_ms(step)
print(json.dumps(res))
