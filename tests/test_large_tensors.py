"""Tensors past 2^31 elements (GPU): a sequence whose row offsets (row * nheads * headdim) pass
the int32 range, forward and backward, checked against the float64 oracle on chunks of rows
(a local window keeps both the kernel's work and the oracle's chunks small)."""

import pytest
import torch

import flashkit
from flashkit import reference
from flashkit.testing import max_error

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

SEQLEN = 2**24 + 4099  # q (1, SEQLEN, 8, 16): 2^31 + 524672 elements
NHEADS, HEADDIM, LEFT = 8, 16, 63


def test_sequence_past_int32_offsets():
    torch.manual_seed(0)
    shape = (1, SEQLEN, NHEADS, HEADDIM)
    assert torch.Size(shape).numel() > 2**31
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16).requires_grad_()
               for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.float16)
    out = flashkit.flash_attn_func(q, k, v, window_size=(LEFT, 0))
    out.backward(dout)
    # chunks at the start, in the middle, and where row * 128 passes 2^31, and the last rows
    for c0 in (0, 2**23, 2**24 - 300, SEQLEN - 700):
        c1 = min(c0 + 700, SEQLEN)
        # chunk-local indices: rows that see all their keys in the chunk, and keys whose rows
        # all are such rows
        n, first = c1 - c0, LEFT if c0 else 0
        rows, keys = slice(first, n), slice(first, n - LEFT if c1 < SEQLEN else n)
        chunk = [t.detach()[:, c0:c1] for t in (q, k, v, dout)]

        def run(dtype, chunk=chunk):
            qc, kc, vc = (t.to(dtype).requires_grad_() for t in chunk[:3])
            o, _ = reference.attention(qc, kc, vc, window_size=(LEFT, 0))
            o.backward(chunk[3].to(dtype))
            return o.detach(), qc.grad, kc.grad, vc.grad

        oracle, baseline = run(torch.float64), run(torch.float16)
        got = (out.detach()[:, c0:c1], q.grad[:, c0:c1], k.grad[:, c0:c1], v.grad[:, c0:c1])
        for name, g, o, b, sel, factor in zip(
                ("out", "dq", "dk", "dv"), got, oracle, baseline, (rows, rows, keys, keys),
                (2, 3, 3, 3), strict=True):
            err, base = max_error(g[:, sel], o[:, sel]), max_error(b[:, sel], o[:, sel])
            assert err <= factor * base + 1e-5, (name, c0, err, base)
