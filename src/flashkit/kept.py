"""Kept calls: what an accepted call's checks found, kept under what they read, so an equal later
call skips them. Checking a call's arguments costs several microseconds of host time, more than
launching its kernel on small problems.

A kept call is one whose checks all passed. Keys hold Python scalars (of the types in PLAIN,
with the types the checks refuse by, such as causal's) and tensors' facts (type, shape, dtype,
device, ...), never a tensor: nothing is kept alive, and a tensor changed in place is not read
stale. Calls with dropout (a new seed every call) and calls under torch.compile (the compiler
would guard on the dicts) are never kept. The dicts: flashkit.api's _SCALAR_CALLS
(build_params), _DENSE_CALLS (flash_attn_func), _ANY_LENGTH_CALLS (flash_attn_func's calls
that differ in key length alone: length_free) and _VARLEN_CALLS (flash_attn_varlen_func, whose
cu_seqlens values are checked again unless a call passes the last checked tensors unchanged:
tensor_states, same_tensors), flashkit.kvcache's _KEPT_CALLS; and the calls with modifiers,
which each modifier object keeps itself, so that they live and die with it
(flashkit.variants.mods.kept_params). The transformers integration keeps its last mask's
unpadding the same way (tensor_states).
"""

from __future__ import annotations

import weakref

import torch

PLAIN = frozenset((bool, int, float, type(None)))  # the scalar types a key may hold
MAX_CALLS = 256  # forget every kept call of a dict beyond this many


def scalar_key(dropout_p, softmax_scale, causal, window_size, deterministic,
               *score_scalars) -> tuple | None:
    """The key of a call's scalar arguments, or None for a call that is not kept: dropout, an
    argument that is not a Python bool, int, float or None (a tensor would be kept alive and
    could change in place), a window that is not a tuple of two ints, torch.compile.
    score_scalars: the scalar score modifiers' arguments (softcap), each keyed with its type."""
    types = tuple(map(type, score_scalars))
    if (type(dropout_p) not in PLAIN or dropout_p != 0 or type(window_size) is not tuple
            or len(window_size) != 2 or type(window_size[0]) is not int
            or type(window_size[1]) is not int or type(softmax_scale) not in PLAIN
            or type(causal) not in PLAIN or not PLAIN.issuperset(types)
            or type(deterministic) not in PLAIN or torch.compiler.is_compiling()):
        return None
    return (softmax_scale, type(softmax_scale), causal, type(causal), window_size,
            deterministic, score_scalars, types)


def remember(calls: dict, key: tuple, value) -> None:
    """calls[key] = value, forgetting every kept call first once calls holds MAX_CALLS."""
    if len(calls) >= MAX_CALLS:
        calls.clear()
    calls[key] = value


def tensor_states(*tensors) -> tuple | None:
    """What identifies tensors and their contents now, without keeping them alive: each one's
    weak reference and version counter (every in-place write through torch bumps it); None
    where one has no counter (an inference tensor) or under torch.compile: nothing to compare
    with later (same_tensors is then False)."""
    if torch.compiler.is_compiling() or any(t.is_inference() for t in tensors):
        return None
    return tuple((weakref.ref(t), t._version) for t in tensors)


def same_tensors(states: tuple | None, tensors: tuple) -> bool:
    """Whether tensors are those tensor_states saw, each unchanged since (a write that torch
    does not see, through .data or by a kernel torch did not launch, is not noticed); never
    under torch.compile."""
    return states is not None and not torch.compiler.is_compiling() and all(
        ref() is t and t._version == version
        for (ref, version), t in zip(states, tensors, strict=True))


def length_free(t: torch.Tensor) -> tuple | None:
    """A dense (batch, seqlen, heads, d) tensor's layout but for its length (dim 1), or None
    unless its strides follow from its shape: contiguous, or heads-major ((batch, heads,
    seqlen, d) memory seen through transpose(1, 2), as a model's key cache reaches
    flash_attn_func). Equal for two tensors that differ in length alone, such as a cache one
    key longer after each decoding step."""
    if t.dim() != 4:
        return None
    batch, length, heads, head_dim = t.shape
    if t.is_contiguous():
        kind = "contiguous"
    else:
        s_batch, s_seq, s_head, s_dim = t.stride()
        if not (s_dim == 1 and s_seq == head_dim and s_head == length * head_dim
                and (batch == 1 or s_batch == heads * s_head)):
            return None
        kind = "heads-major"
    return kind, batch, heads, head_dim, t.dtype, t.device, t.data_ptr() % 16 == 0
