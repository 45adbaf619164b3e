"""The autograd wrapper for calls with modifiers on the tiled and Triton backends.

Modifiers are Python functions, which the custom op's schema cannot carry, so these calls take
a plain torch.autograd.Function: the backend's forward, then its backward with a buffer per
captured tensor that requires a gradient (the tiled backward adds into them, the Triton one
through the score_mod's captured_grad rule).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from flashkit.variants.mods import Variant


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, params, backend, *captured):
        out, lse = backend.forward(q, k, v, params)
        ctx.params, ctx.backend = params, backend
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        params = ctx.params
        variant = params.variant
        score = variant.score_mod
        wanted = set() if score is None else set(score.grad_tensors())
        grads = [torch.zeros_like(t, dtype=torch.float32 if t.dtype != torch.float64
                                  else t.dtype) if n in wanted else None
                 for n, t in enumerate(() if score is None else score.captured)]
        if wanted:  # else the forward's params, whose plan key the backend has seen
            params = dataclasses.replace(params, variant=dataclasses.replace(
                variant, captured_grads=grads))
        dout = torch.zeros_like(out, dtype=q.dtype) if dout is None else dout.to(q.dtype)
        dq, dk, dv, dsink = ctx.backend.backward(dout, q, k, v, out, lse, params, dlse=dlse)
        captured = [None if g is None else g.to(t.dtype)
                    for g, t in zip(grads, () if score is None else score.captured, strict=True)]
        n_mask = 0 if variant.mask_mod is None else len(variant.mask_mod.captured)
        return (dq, dk, dv, dsink if params.sink is not None else None, None, None, *captured,
                *([None] * n_mask))


def attention(q, k, v, params, backend: str):
    """(out, lse) of a call whose params carry a Variant on backend "torch" or "triton";
    differentiable in q, k, v, the sink and score_mod's captured tensors (on the Triton backend
    through the score_mod's captured_grad rule)."""
    from flashkit.ops.custom_op import backend_module

    variant: Variant = params.variant
    score = variant.score_mod
    if backend == "triton" and score is not None:
        if score.grad_tensors() and score.captured_grad is None:
            raise NotImplementedError(
                "score_mod: backend 'triton' needs a captured_grad rule for captured tensors "
                "that require a gradient: ScoreMod(fn, *captured, grad=dfn, captured_grad=gfn) "
                "with gfn(ds, score, b, h, q_idx, kv_idx, *captured, *grads) adding ds * d fn / "
                "d captured into grads; or pass them without requires_grad, or use "
                "backend='torch'")
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, params.sink))
        if needs_grad and score.grad is None:
            raise NotImplementedError(
                "score_mod: backend 'triton' differentiates a score_mod through its derivative; "
                "pass ScoreMod(fn, *captured, grad=dfn) with dfn(score, b, h, q_idx, kv_idx, "
                "*captured) = d fn / d score, or use backend='torch'")
    captured = [*(() if variant.score_mod is None else variant.score_mod.captured),
                *(() if variant.mask_mod is None else variant.mask_mod.captured)]
    tensors = [t if isinstance(t, torch.Tensor) else None for t in captured]
    module = backend_module(backend)
    if backend == "triton" and params.is_varlen and variant.block_mask is not None:
        _refuse_with_packing(params)
        out, lse = _run(q[None], k[None], v[None], _as_one_sequence(params), module, tensors)
        # squeeze, not out[0]: the gradient of a select builds a zero tensor of the batched
        # shape and copies dout into it (a fill and a copy of out's size every backward)
        return out.squeeze(0), lse.squeeze(0)
    return _run(q, k, v, params, module, tensors)


def _run(q, k, v, params, module, tensors):
    """(out, lse) of module's forward, under _Attention where a gradient is wanted."""
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (
            q, k, v, params.sink, *tensors))):  # no graph to record: the forward alone
        return module.forward(q, k, v, params)
    return _Attention.apply(q, k, v, params.sink, params, module, *tensors)


def _refuse_with_packing(params) -> None:
    """A varlen call with a block mask over its packed tokens runs on the Triton kernels as
    one sequence (batch 1) under the mask's blocks, the sequences kept apart and the modifiers
    given per-sequence indices (common.mod_indices). Features that read positions outside the
    modifiers would see packed ones there, so they are refused."""
    for name, used in (("dropout_p", params.dropout_p > 0),
                       ("alibi_slopes", params.alibi_slopes is not None)):
        if used:
            raise NotImplementedError(
                f"block_mask: backend 'triton' runs a varlen block mask over the packed tokens "
                f"and takes no {name} with it; write it as a score_mod (flashkit.variants.alibi) "
                "or use backend='torch'")


def _as_one_sequence(params):
    """params of a varlen call with a block mask over its packed tokens as those of one dense
    sequence, the mask's packing in the Variant. The last ones made are kept by weak reference
    with the params they were made from: a call with the same params (a kept call passes its
    kept params) while they live (an autograd node holds them through a training step's
    forward) gets the same object, whose dispatch key is then computed once
    (dispatch._values); nothing is kept alive."""
    global _last_packed
    source, made = (ref() for ref in _last_packed)  # one read: another thread may replace it
    if source is params and made is not None:
        return made
    variant = dataclasses.replace(params.variant, packing=params.variant.block_mask.packing)
    dense = dataclasses.replace(params, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                                max_seqlen_k=0, variant=variant)
    _last_packed = (weakref.ref(params), weakref.ref(dense))
    return dense


def _dead():
    return None


_last_packed: tuple = (_dead, _dead)  # weak references to the last params and their dense form
