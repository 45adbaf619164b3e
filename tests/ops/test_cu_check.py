"""The one-launch device check of a varlen call's cu_seqlens (flashkit.ops.triton.cu_check).

On a GPU a bad entry fails a device-side assertion, which ends the CUDA context, so the cases
here run the kernel in Triton's interpreter on CPU tensors, reading the flag it stores beside
the assertion; the GPU test checks that good tensors pass and that varlen calls queue it.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashkit import checks

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRET, reason="CPU tensors: needs TRITON_INTERPRET=1")


def _flag(cu_q, total_q, max_q, cu_k, total_k, max_k, device="cpu") -> int:
    from flashkit.ops.triton.cu_check import check_cu_seqlens
    bad = torch.full((1,), -7, dtype=torch.int32, device=device)  # poisoned: must be written
    to = dict(dtype=torch.int32, device=device)
    check_cu_seqlens(torch.tensor(cu_q, **to), total_q, max_q, torch.tensor(cu_k, **to),
                     total_k, max_k, bad)
    return int(bad.item())


# (cu_seqlens_q, total_q, max_seqlen_q, cu_seqlens_k, total_k, max_seqlen_k); the longest
# sequences cross the kernel's 256-entry steps
GOOD = [
    ([0, 5], 5, 5, [0, 7], 7, 7),
    ([0, 3, 3, 8], 8, 5, [0, 0, 4, 9], 9, 5),  # empty sequences
    (list(range(0, 3 * 600, 3)), 3 * 599, 3, list(range(0, 600)), 599, 1),
]
BAD = [
    ([1, 5], 5, 5, [0, 7], 7, 7),  # q does not start at 0
    ([0, 5], 5, 5, [0, 6], 7, 7),  # k does not end at the total
    ([0, 6, 5, 9], 9, 9, [0, 1, 2, 3], 3, 1),  # q decreases
    ([0, 2, 4], 4, 2, [0, 1, 9], 9, 7),  # a k length above max_seqlen_k
    (list(range(0, 600)), 599, 1, list(range(0, 599)) + [597], 597, 1),  # k decreases at 598
]


@interpreted
@pytest.mark.parametrize("case", range(len(GOOD)))
def test_good_cu_seqlens_pass(case):
    assert _flag(*GOOD[case]) == 0


@interpreted
@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_cu_seqlens_are_flagged(case):
    assert _flag(*BAD[case]) == 1


@pytest.mark.gpu
def test_gpu_varlen_calls_check_with_one_launch(monkeypatch):
    """A CUDA varlen call queues the one-launch check (not the per-tensor torch ops), and good
    tensors pass it; sync_checks and backends that launch no Triton kernel check otherwise."""
    from flashkit.ops.triton import cu_check
    assert _flag(*GOOD[2], device="cuda") == 0
    calls = []
    monkeypatch.setattr(checks, "cu_seqlens_values", lambda *a: calls.append(a))
    q = torch.randn(8, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device="cuda")
    checker = checks._device_checker(q)
    assert checker is cu_check.check_cu_seqlens
    assert checks.varlen_qkv(q, q, q, cu, cu, 5, 5) == 2
    assert calls == []
    checks.varlen_qkv(q, q, q, cu, cu, 5, 5, sync_checks=True)  # the host read instead
    assert len(calls) == 2
    checks.varlen_qkv(q, q, q, cu, cu, 5, 5, triton=False)  # a backend without Triton: torch
    assert len(calls) == 4
    torch.cuda.synchronize()
