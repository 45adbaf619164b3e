"""The ring loops, forward and backward, and the autograd.Function that joins them.

Tensors are dense and batch-first: q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv),
out (b, sq, h, dv), lse (b, h, sq) (varlen inputs come as a batch of one, their packed tokens
as the sequence). Each is this rank's shard; `RingProblem.plans[t]` lists the backend calls of
step t (see `plan`), each on a slice of the local query rows and of the held key rows.

Forward, step t: post the send of the held (K, V) to the next rank, run this step's calls,
fold each partial (out, lse) into the accumulators by log-sum-exp (`merge`), then take the
(K, V) that arrived from the previous rank. The kernel runs while the shard is in flight.
A sink (one value-less logit per head) enters the softmax once, folded in after the last step
as one more partial result: (out 0, lse sink).

Backward, step t: the same (K, V) travel, and with them the float32 accumulators (dK, dV) of the
held shard. Each call is the backend's backward given the GLOBAL out and lse: it recomputes
P = exp(S - lse) and D = rowsum(dO * O) from them, so each block's gradient is exactly its term
of the full gradient. dQ accumulates locally; the block's dK, dV are added to the accumulators
received from the previous rank (their transfer overlaps this step's kernels) and sent on.
The kernels run without the sink (the global lse already holds it); its gradient,
-sum_i exp(sink - lse_i) (D_i - dlse_i), is the part from this rank's queries: like any
parameter replicated over the group, sum it over the ranks (data / context parallel training
all-reduces such gradients anyway).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import torch

from flashkit.distributed.merge import merge_
from flashkit.distributed.plan import Call
from flashkit.distributed.ring import Ring
from flashkit.ops.custom_op import backend_module
from flashkit.ops.params import AttentionParams, accumulation_dtype

__all__ = ["RingProblem", "ring_forward", "ring_backward", "RingAttention"]


@dataclass(frozen=True)
class RingProblem:
    """Everything but the tensors: the ring, the calls of each step, the backend and its params.

    params carries the scale, softcap and ALiBi slopes ((h,) or (b, h); for varlen inputs, which
    come as a batch of one, (b, h) means one row per packed sequence); each call replaces its
    window and signs the slopes (see `plan`). The sink travels as a tensor input, not here.
    """

    ring: Ring
    plans: tuple[tuple[Call, ...], ...]
    params: AttentionParams
    backend: str
    varlen: bool = False

    def _slopes(self, call: Call):
        slopes = self.params.alibi_slopes
        if self.varlen and slopes is not None and slopes.dim() == 2:
            return slopes[call.sequence]
        return slopes

    def call_params(self, call: Call) -> AttentionParams:
        """The backend's params for one call: its window, its signed slopes."""
        slopes = self._slopes(call)
        if slopes is not None and call.alibi_sign != 1:
            slopes = -slopes
        return dataclasses.replace(self.params, window_left=call.window_left,
                                   window_right=call.window_right, alibi_slopes=slopes)

    def _lse_offset(self, call: Call, lse: torch.Tensor):
        """-slope * alibi_offset as (b or 1, h, 1), or None: the call's lse is off by it."""
        slopes = self._slopes(call)
        if slopes is None or call.alibi_offset == 0:
            return None
        return (-call.alibi_offset * slopes.to(lse.dtype)).reshape(-1, lse.shape[1], 1)

    def global_lse(self, call: Call, lse: torch.Tensor) -> torch.Tensor:
        """The call's lse (b, h, s) as the global scores give it (see `plan` on ALiBi)."""
        offset = self._lse_offset(call, lse)
        return lse if offset is None else lse + offset

    def kernel_lse(self, call: Call, lse: torch.Tensor) -> torch.Tensor:
        """The global lse of the call's rows as the call's own scores see it."""
        offset = self._lse_offset(call, lse)
        return lse if offset is None else lse - offset


def ring_forward(q, k, v, sink, problem: RingProblem):
    """(out (b, sq, h, dv), lse (b, h, sq)), both float32 (float64 for float64 inputs), of the
    whole ring; sink None or (h,)."""
    kernels = backend_module(problem.backend)
    acc = accumulation_dtype(q.dtype)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), -torch.inf, dtype=acc,
                     device=q.device)
    kv = (k, v)
    for step, calls in enumerate(problem.plans):
        arriving = problem.ring.shift(kv) if step + 1 < len(problem.plans) else None
        held_k, held_v = kv
        try:
            for call in calls:
                out_c, lse_c = kernels.forward(q[:, call.q], held_k[:, call.k],
                                               held_v[:, call.k], problem.call_params(call))
                merge_(out[:, call.q], lse[:, :, call.q], out_c, problem.global_lse(call, lse_c))
        finally:  # also when a kernel raises (e.g. a feature the backend lacks, on every rank):
            if arriving is not None:  # all ranks posted this transfer, so it completes
                kv = arriving.wait()
    if sink is not None:
        merge_(out, lse, torch.zeros_like(out), sink.to(acc)[None, :, None].expand_as(lse))
    return out, lse


def ring_backward(dout, q, k, v, sink, out, lse, dlse, problem: RingProblem):
    """(dq, dk, dv, dsink) of this rank's shards (dsink None without a sink, else the part from
    this rank's queries); out and lse are ring_forward's (the global ones)."""
    kernels = backend_module(problem.backend)
    if dlse is not None and "dlse" not in inspect.signature(kernels.backward).parameters:
        raise NotImplementedError(f"{problem.backend} backend: gradients through the returned "
                                  "lse are not supported (its backward takes no dlse)")
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv, dkv_arriving = (k, v), None
    for step, calls in enumerate(problem.plans):
        kv_arriving = problem.ring.shift(kv) if step + 1 < len(problem.plans) else None
        held_k, held_v = kv
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)  # this step's block terms
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for call in calls:
            extra = {} if dlse is None else {"dlse": dlse[:, :, call.q]}
            # each call's gradients in the accumulation dtype: summed over the steps, they are
            # rounded to the inputs' dtype once, at the end (a bf16 round per step would add up)
            dq_c, dk_c, dv_c, _ = kernels.backward(
                dout[:, call.q], q[:, call.q], held_k[:, call.k], held_v[:, call.k],
                out[:, call.q], problem.kernel_lse(call, lse[:, :, call.q]),
                problem.call_params(call), own_lse=False, grad_dtype=acc, **extra)
            dq[:, call.q] += dq_c
            dk[:, call.k] += dk_c
            dv[:, call.k] += dv_c
        if dkv_arriving is not None:  # what the ranks before this one added for the held shard
            dk_before, dv_before = dkv_arriving.wait()
            dk += dk_before
            dv += dv_before
        dkv_arriving = problem.ring.shift((dk, dv))  # the last shift takes them home
        if kv_arriving is not None:
            kv = kv_arriving.wait()
    dk, dv = dkv_arriving.wait()
    dsink = None if sink is None else _sink_grad(dout, out, lse, dlse, sink)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink


def _sink_grad(dout, out, lse, dlse, sink):
    """-sum over this rank's rows of exp(sink - lse) (D - dlse), D = rowsum(dO * O): (h,)."""
    delta = (dout.to(out.dtype) * out).sum(-1).transpose(1, 2)  # (b, h, sq)
    if dlse is not None:
        delta = delta - dlse
    share = torch.exp(sink.to(lse.dtype)[None, :, None] - lse) * delta
    return (-share.sum((0, 2))).to(sink.dtype)


class RingAttention(torch.autograd.Function):
    """(out, lse) = ring attention of the local shards; backward is a collective too.

    Every rank of the group must call forward, and backward, the same number of times.
    """

    @staticmethod
    def forward(ctx, q, k, v, sink, problem: RingProblem):
        out, lse = ring_forward(q, k, v, sink, problem)
        # The backward's D = rowsum(dO * O) sees the unrounded output: with a sink or a short
        # row, a rounded O costs dq many ulps.
        ctx.save_for_backward(q, k, v, sink, out, lse)
        ctx.problem = problem
        ctx.set_materialize_grads(False)  # an unused lse gives dlse = None, not zeros
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sink, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros(out.shape, dtype=q.dtype, device=out.device)
        dq, dk, dv, dsink = ring_backward(dout, q, k, v, sink, out, lse, dlse, ctx.problem)
        return dq, dk, dv, dsink, None
