"""flashkit's attention as torch.library custom ops, so torch.compile traces it without a break.

`flashkit::attention_forward` and `flashkit::attention_backward` take the backend's name and the
fields of AttentionParams flattened in declaration order (custom ops take tensors and scalars,
not dataclasses). Each has a fake implementation giving output shapes for tracing, and the
forward op's autograd formula calls the backward op. What the forward keeps for the backward
is what every FlashAttention keeps: q, k, v, out and the float32 lse (and the params' tensors).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from flashkit.ops.params import AttentionParams, accumulation_dtype, lse_shape

__all__ = ["attention", "backend_module", "BACKENDS"]

BACKENDS = ("torch", "triton")
_FIELDS = [f.name for f in dataclasses.fields(AttentionParams) if f.name != "variant"]
_TENSOR_FIELDS = ["alibi_slopes", "sink", "attn_bias", "cu_seqlens_q", "cu_seqlens_k"]


def backend_module(name: str):
    """The module implementing forward/backward for a backend name, imported on first use.

    Import statements, not importlib.import_module: torch.compile traces the former and breaks
    the graph at the latter (return_attn_probs calls this outside the custom op).
    """
    if name == "torch":
        from flashkit.ops import tiled
        return tiled
    if name == "triton":
        from flashkit.ops import triton
        return triton
    raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")


def attention(q: Tensor, k: Tensor, v: Tensor, params: AttentionParams, backend: str):
    """(out, lse) through the custom op; differentiable in q, k, v and the sink."""
    return attention_forward(q, k, v, *(getattr(params, f) for f in _FIELDS), backend)


def _params(args) -> AttentionParams:
    return AttentionParams(**dict(zip(_FIELDS, args, strict=True)))


def _params_named(arguments: dict) -> AttentionParams:
    """AttentionParams from an op's arguments by name (the signatures spell out the fields)."""
    return AttentionParams(**{f: arguments[f] for f in _FIELDS})


# The op signatures spell out AttentionParams' fields in order; tests/ops check they agree.
@torch.library.custom_op("flashkit::attention_forward", mutates_args=())
def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, window_left: int | None,
    window_right: int | None, softcap: float, alibi_slopes: Tensor | None, sink: Tensor | None,
    attn_bias: Tensor | None, dropout_p: float, dropout_seed: int, cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, deterministic: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    return backend_module(backend).forward(q, k, v, _params_named(locals()))


@attention_forward.register_fake
def _(q, k, v, *args):
    params = _params(args[:-1])
    return (q.new_empty((*q.shape[:-1], v.shape[-1])),
            q.new_empty(lse_shape(q, params), dtype=accumulation_dtype(q.dtype)))


@torch.library.custom_op("flashkit::attention_backward", mutates_args=())
def attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    dlse: Tensor | None, softmax_scale: float, window_left: int | None,
    window_right: int | None, softcap: float, alibi_slopes: Tensor | None, sink: Tensor | None,
    attn_bias: Tensor | None, dropout_p: float, dropout_seed: int, cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, deterministic: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, dsink = backend_module(backend).backward(dout, q, k, v, out, lse,
                                                         _params_named(locals()), dlse=dlse)
    # A custom op returns tensors only: an empty one stands for "no sink".
    return dq, dk, dv, q.new_empty(0) if dsink is None else dsink


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, *args):
    sink = _params(args[:-1]).sink
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(0) if sink is None else torch.empty_like(sink))


def _setup_context(ctx, inputs, output):
    q, k, v, *param_args, backend = inputs
    params = _params(param_args)
    ctx.params = dataclasses.replace(params, **dict.fromkeys(_TENSOR_FIELDS))  # scalars only
    ctx.backend = backend
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *(getattr(params, f) for f in _TENSOR_FIELDS))
    ctx.set_materialize_grads(False)  # an unused lse passes None, not a tensor of zeros


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *tensor_params = ctx.saved_tensors
    params = dataclasses.replace(ctx.params, **dict(zip(_TENSOR_FIELDS, tensor_params,
                                                         strict=True)))
    dout = torch.zeros_like(out, dtype=q.dtype) if dout is None else dout
    dq, dk, dv, dsink = attention_backward(dout, q, k, v, out, lse, dlse,
                                           *(getattr(params, f) for f in _FIELDS), ctx.backend)
    grads = dict.fromkeys(["q", "k", "v", *_FIELDS, "backend"])
    grads.update(q=dq, k=dk, v=dv, sink=dsink if params.sink is not None else None)
    return tuple(grads.values())


attention_forward.register_autograd(_backward, setup_context=_setup_context)
