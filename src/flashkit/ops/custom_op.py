"""flashkit's attention as torch.library custom ops, so torch.compile traces it without a break.

`flashkit::attention_forward` and `flashkit::attention_backward` take the backend's name and the
fields of AttentionParams flattened in declaration order (custom ops take tensors and scalars,
not dataclasses): their signatures are made from the dataclass (`_params_op`), so a new field
joins both ops by itself. Each has a fake implementation giving output shapes for tracing, and
the forward op's autograd formula calls the backward op. What the forward keeps for the
backward is what every FlashAttention keeps: q, k, v, out and the float32 lse (and the params'
tensors).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing

import torch
from torch import Tensor

from flashkit.ops.params import AttentionParams, accumulation_dtype, lse_shape

__all__ = ["attention", "backend_module", "BACKENDS"]

BACKENDS = ("torch", "triton")
_FIELDS = [f.name for f in dataclasses.fields(AttentionParams) if f.name != "variant"]
_TYPES = typing.get_type_hints(AttentionParams)  # the fields' annotations, evaluated
_TENSOR_FIELDS = [f for f in _FIELDS if Tensor in typing.get_args(_TYPES[f])]


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


def _params_op(name: str, leading: tuple, returns):
    """A custom op `name` whose arguments are `leading` ((name, annotation) pairs), the fields
    of AttentionParams in declaration order, then `backend` (str): torch infers its schema from
    that signature. The decorated function receives (*leading, params, backend)."""
    def wrap(fn):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        signature = inspect.Signature(
            [inspect.Parameter(n, kind, annotation=a) for n, a in leading]
            + [inspect.Parameter(f, kind, annotation=_TYPES[f]) for f in _FIELDS]
            + [inspect.Parameter("backend", kind, annotation=str)], return_annotation=returns)
        count = len(leading)

        def op(*args):
            return fn(*args[:count], _params(args[count:-1]), args[-1])

        op.__name__, op.__doc__, op.__signature__ = fn.__name__, fn.__doc__, signature
        return torch.library.custom_op(name, op, mutates_args=())
    return wrap


@_params_op("flashkit::attention_forward", (("q", Tensor), ("k", Tensor), ("v", Tensor)),
            tuple[Tensor, Tensor])
def attention_forward(q, k, v, params: AttentionParams, backend: str):
    return backend_module(backend).forward(q, k, v, params)


@attention_forward.register_fake
def _(q, k, v, *args):
    params = _params(args[:-1])
    return (q.new_empty((*q.shape[:-1], v.shape[-1])),
            q.new_empty(lse_shape(q, params), dtype=accumulation_dtype(q.dtype)))


@_params_op("flashkit::attention_backward",
            tuple((n, Tensor) for n in ("dout", "q", "k", "v", "out", "lse"))
            + (("dlse", Tensor | None),), tuple[Tensor, Tensor, Tensor, Tensor])
def attention_backward(dout, q, k, v, out, lse, dlse, params: AttentionParams, backend: str):
    dq, dk, dv, dsink = backend_module(backend).backward(dout, q, k, v, out, lse, params,
                                                         dlse=dlse)
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
