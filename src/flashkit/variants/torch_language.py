"""The torch side of a modifier: a stand-in for `triton.language` that runs a @triton.jit
modifier's own Python body on torch tensors.

A modifier is written once, as Triton code. The Triton kernels compile it; the tiled and
reference backends call its undecorated function with this namespace in place of `tl` (and the
torch twins of any other @triton.jit function it calls), so both sides run the same source and
autograd differentiates the torch side. Captured tensors arrive as `Pointer`s, so the kernel
idiom `tl.load(table + index)` indexes the table on both sides.

Covered: where, exp, exp2, log, log2, sqrt, abs, sin, cos, sigmoid, maximum, minimum, clamp,
load (with mask/other), full, zeros, cdiv, the dtype names (float32 means the arithmetic dtype
of the call, so the float64 oracle stays float64), and `tl.math.<the same>`.
"""

from __future__ import annotations

import math
import types

import torch


class Pointer:
    """A captured tensor seen as flat memory: `ptr + index` moves it, `load(ptr)` reads it.

    base is the tensor's storage as a flat view (captured tensors are contiguous); offset is an
    integer tensor or int, broadcast like the indices the modifier computes."""

    __slots__ = ("base", "offset")

    def __init__(self, base: torch.Tensor, offset=0):
        self.base, self.offset = base, offset

    def __add__(self, index):
        return Pointer(self.base, self.offset + index)

    __radd__ = __add__

    def __sub__(self, index):
        return Pointer(self.base, self.offset - index)


def _tensor(x, like):
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x, device=like.device)


def _like(*xs):
    return next((x for x in xs if isinstance(x, torch.Tensor)), None)


def _binary(op):
    def fn(a, b, *_, **__):  # tl.maximum's propagate_nan and friends are accepted, unused
        like = _like(a, b)
        if like is None:
            return op(torch.as_tensor(a), torch.as_tensor(b))
        return op(_tensor(a, like), _tensor(b, like))
    return fn


def _unary(op):
    def fn(x, *_, **__):
        return op(x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float64))
    return fn


def where(cond, a, b):
    like = _like(cond, a, b)
    a, b = _tensor(a, like), _tensor(b, like)
    return torch.where(_tensor(cond, like), a, b)


def load(pointer, mask=None, other=0.0, **_):
    """pointer.base[pointer.offset]; masked-off elements read `other` (and read index 0)."""
    if not isinstance(pointer, Pointer):
        raise TypeError("tl.load in a modifier reads a captured tensor: tl.load(table + index)")
    offset = torch.as_tensor(pointer.offset, device=pointer.base.device)
    if mask is None:
        return pointer.base[offset]
    mask = _tensor(mask, offset)
    values = pointer.base[torch.where(mask, offset, torch.zeros_like(offset))]
    return torch.where(mask, values, _tensor(other, values).to(values.dtype))


def _clamp(x, lo, hi, *_, **__):
    like = _like(x, lo, hi)
    return torch.minimum(torch.maximum(_tensor(x, like), _tensor(lo, like)), _tensor(hi, like))


def language(float_dtype: torch.dtype, device) -> types.SimpleNamespace:
    """The `tl` stand-in for one call: float dtypes name `float_dtype` (the call's arithmetic
    dtype), so `x.to(tl.float32)` keeps the oracle in float64."""
    ns = types.SimpleNamespace(
        where=where, load=load, clamp=_clamp,
        exp=_unary(torch.exp), exp2=_unary(torch.exp2), log=_unary(torch.log),
        log2=_unary(torch.log2), sqrt=_unary(torch.sqrt), abs=_unary(torch.abs),
        sin=_unary(torch.sin), cos=_unary(torch.cos), sigmoid=_unary(torch.sigmoid),
        maximum=_binary(torch.maximum), minimum=_binary(torch.minimum),
        cdiv=lambda a, b: -(-a // b),
        full=lambda shape, value, dtype: torch.full(tuple(shape), value, dtype=dtype,
                                                    device=device),
        zeros=lambda shape, dtype: torch.zeros(tuple(shape), dtype=dtype, device=device),
        float32=float_dtype, float16=float_dtype, bfloat16=float_dtype, float64=torch.float64,
        int1=torch.bool, int8=torch.int8, int16=torch.int16, int32=torch.int32,
        int64=torch.int64, constexpr=lambda x: x, pi=math.pi,
    )
    ns.math = ns
    return ns
