"""The ring loops, forward and backward, and the autograd.Function that joins them.

Tensors are dense and batch-first: q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv),
out (b, sq, h, dv), lse (b, h, sq) (varlen inputs come as a batch of one, their packed tokens
as the sequence). Each is this rank's shard; `RingProblem.plans[t]` lists the backend calls of
step t (see `plan`), each on a slice of the local query rows and of the held key rows.

Forward, step t: post the send of the held (K, V) to the next rank, run this step's calls,
fold each partial (out, lse) into the accumulators by log-sum-exp (`merge`), then take the
(K, V) that arrived from the previous rank. The kernel runs while the shard is in flight.

Backward, step t: the same (K, V) travel, and with them the float32 accumulators (dK, dV) of the
held shard. Each call is the backend's backward given the GLOBAL out and lse: it recomputes
P = exp(S - lse) and D = rowsum(dO * O) from them, so each block's gradient is exactly its term
of the full gradient. dQ accumulates locally; the block's dK, dV are added to the accumulators
received from the previous rank (their transfer overlaps this step's kernels) and sent on.
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

    params carries the scale and softcap; each call replaces its window.
    """

    ring: Ring
    plans: tuple[tuple[Call, ...], ...]
    params: AttentionParams
    backend: str

    def call_params(self, call: Call) -> AttentionParams:
        return dataclasses.replace(self.params, window_left=call.window_left,
                                   window_right=call.window_right)


def ring_forward(q, k, v, problem: RingProblem):
    """(out (b, sq, h, dv) in q's dtype, lse (b, h, sq) float32/float64) of the whole ring."""
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
                merge_(out[:, call.q], lse[:, :, call.q], out_c, lse_c)
        finally:  # also when a kernel raises (e.g. a feature the backend lacks, on every rank):
            if arriving is not None:  # all ranks posted this transfer, so it completes
                kv = arriving.wait()
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, dlse, problem: RingProblem):
    """(dq, dk, dv) of this rank's shards; out and lse are ring_forward's (the global ones)."""
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
            dq_c, dk_c, dv_c, _ = kernels.backward(
                dout[:, call.q], q[:, call.q], held_k[:, call.k], held_v[:, call.k],
                out[:, call.q], lse[:, :, call.q], problem.call_params(call), **extra)
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
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """(out, lse) = ring attention of the local shards; backward is a collective too.

    Every rank of the group must call forward, and backward, the same number of times.
    """

    @staticmethod
    def forward(ctx, q, k, v, problem: RingProblem):
        out, lse = ring_forward(q, k, v, problem)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        ctx.set_materialize_grads(False)  # an unused lse gives dlse = None, not zeros
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, dlse, ctx.problem)
        return dq, dk, dv, None
