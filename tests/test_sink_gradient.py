"""The sink's gradient with 16-bit inputs, through the public API, against the float64 oracle
under docs/design.md section 5's rule. dsink sums exp(sink - lse_i) * D_i over every row, with
D_i = rowsum(dO * O) read from the 16-bit O that forward returns (what the factor covers), and
is returned in the sink's dtype: with one value per head, its error is mostly that last
rounding, which the rule's rounding term for few-element outputs allows for.
"""

from __future__ import annotations

import pytest
import torch

import flashkit
from flashkit.testing import GRAD_FACTOR, assert_close_to_oracle

# The interpreter's bf16 arithmetic is wrong (tests/ops/test_triton.py): float16 here, and both
# dtypes on the GPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]


def sink_gradient(backend, dtype, q, k, v, dout, sink, device):
    leaves = [t.detach().to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v, sink)]
    out = flashkit.flash_attn_func(*leaves[:3], causal=True, softmax_scale=0.5, sink=leaves[3],
                                   backend=backend)
    out.backward(dout.to(device=device, dtype=dtype))
    return leaves[3].grad.double().cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("seed", range(6))
def test_sink_gradient_meets_the_rule(seed, backend, dtype):
    """Inputs drawn in the tested dtype (so the oracle sees the same values), causal, GQA,
    131 rows per head, sinks of a few units."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, 131, heads, 64, generator=gen).to(dtype)
                     for heads in (4, 2, 2, 4))
    sink = (3 * torch.randn(4, generator=gen)).to(dtype)
    device = DEVICE if backend == "triton" else "cpu"
    got = sink_gradient(backend, dtype, q, k, v, dout, sink, device)
    oracle = sink_gradient("reference", torch.float64, q, k, v, dout, sink, "cpu")
    baseline = sink_gradient("reference", dtype, q, k, v, dout, sink, "cpu")
    assert_close_to_oracle("dsink", got, oracle, baseline, factor=GRAD_FACTOR)
