"""One Triton launch that checks a varlen call's cu_seqlens_q and cu_seqlens_k on the device.

The device check in torch ops (checks.cu_seqlens_values: a difference, two entry reads, a min,
a max, four comparisons and an assertion) launches about a dozen small kernels per tensor,
two dozen per varlen call: on a small problem most of the call's host time. This kernel checks
both tensors in one program, without a sync: 0 first, non-decreasing, last entry = the packed
total, no length above max_seqlen. A bad entry fails a device-side assertion (compiled in with
debug=True), which stops the stream before any attention kernel queued behind it reads the
entry; the error then surfaces at the next synchronising call, and it ends the CUDA context.
The interpreter skips device assertions: with a Bad flag (an int32 tensor of one element, the
tests') the kernel also stores 1 there for bad entries, 0 otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashkit.ops.triton.launch import launch

BLOCK = 256  # entries read per step
MESSAGE = tl.constexpr(
    "flash_attn_varlen_func: cu_seqlens_q or cu_seqlens_k is not 0 first, non-decreasing, "
    "ending at the total tokens with no length above max_seqlen_q / max_seqlen_k (nothing "
    "was read out of bounds); sync_checks=True says which")


@triton.jit
def _valid(Cu, entries, total, max_seqlen, BLOCK: tl.constexpr):
    """Whether Cu[0 .. entries) is 0 first, ends at total, and rises by 0 .. max_seqlen."""
    ok = (tl.load(Cu) == 0) & (tl.load(Cu + entries - 1) == total)
    bad = 0
    for start in range(0, entries - 1, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < entries - 1
        length = (tl.load(Cu + offs + 1, mask=inside, other=0)
                  - tl.load(Cu + offs, mask=inside, other=0))
        bad += tl.sum(((length < 0) | (length > max_seqlen)).to(tl.int32), 0)
    return ok & (bad == 0)


# The device assertion needs debug=True; the overflow sanitiser that comes with it is turned
# off at launch (sanitize_overflow=False), as in append.py.
@triton.jit(debug=True)
def _check_kernel(CuQ, CuK, Bad, entries, total_q, max_seqlen_q, total_k, max_seqlen_k,
                  BLOCK: tl.constexpr, FLAG: tl.constexpr):
    ok = (_valid(CuQ, entries, total_q, max_seqlen_q, BLOCK)
          & _valid(CuK, entries, total_k, max_seqlen_k, BLOCK))
    if FLAG:
        tl.store(Bad, tl.where(ok, 0, 1))
    tl.device_assert(ok, MESSAGE)


def check_cu_seqlens(cu_q: torch.Tensor, total_q: int, max_seqlen_q: int, cu_k: torch.Tensor,
                     total_k: int, max_seqlen_k: int, bad: torch.Tensor | None = None) -> None:
    """Queue the check of cu_q and cu_k (int32 (batch + 1,) each, on the current device, their
    layout checked by the caller); see the module docstring. bad: the optional flag."""
    launch(_check_kernel, (1,), (cu_q, cu_k, cu_q if bad is None else bad),
           (cu_q.shape[0], total_q, max_seqlen_q, total_k, max_seqlen_k),
           dict(BLOCK=BLOCK, FLAG=bad is not None), num_warps=4, sanitize_overflow=False)
