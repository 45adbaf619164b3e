"""The Triton backend's front door: the one place that chooses which kernels run a call.

    forward(q, k, v, params)                     the decode kernels for few query rows over
                                                 many keys (decode.dense), the Gluon forward
                                                 (forward_hopper) where it takes the call,
                                                 else forward.py's kernel
    backward(dout, q, k, v, out, lse, params)    the Gluon dK/dV and dQ kernels (backward_hopper)
                                                 as the call is, or a dense call as varlen with
                                                 equal lengths, else backward.py's kernels
    kvcache(q, k_cache, v_cache, cache, params)  a decoding step in the decode kernel alone;
                                                 else the append kernel, then the Gluon forward
                                                 (a long prefill, prefill.py) or the decode
                                                 kernels

The Gluon kernels read q, k, v (and dO) in place in the flash layout, with tokens a pitch apart
(q, k, v unbound from one packed qkv) and in SDPA's heads-major memory seen as flash-attn's
shape (a model's q.transpose(1, 2)): hopper_common.tma_layout. Where only another layout keeps
them from a forward or backward (a sliced head dim, say), they run on contiguous copies
(ON_COPIES).

Each kernel's predicate lives beside the kernel and returns why it declines a call (a string), or
None when it takes it. A choice depends only on what the plan key holds (shapes, dtypes, the
device, the layout and alignment class of the tensors, params' values but not its tensors'
contents), so it is made once per key and kept in a dict, with the launches the chosen
kernels' launchers prepare (launch.Prepared: grid, scalars, constexprs, tensor descriptors'
geometry): a call whose key was seen costs one tuple hash here and then passes its tensors to
the prepared launches (a dropout seed, new every call, is passed to them as well). The entry
points go one step further for their most repeated calls: flash_attn_func keeps a forward plan
(planned_forward, a PlannedForward, which also keeps the backward plans of its calls' gradients)
and flash_attn_with_kvcache a decoding step's (kvcache_step, a PlannedStep) with the call's
checked arguments, so an equal call skips this module's key and goes to its launches;
flash_attn_func also keeps, for calls that differ in key length alone (a decoding step over a
cache one key longer each call), forward plans for every key length (any_length_forward, an
AnyLengthForward); forget_plans retires them too.

The first call of a forward plan whose q, k or v require grad also compiles the kernels of
its backward, all at once in threads (ahead.py), so a new shape's first step waits for its
slowest compile rather than for each in turn.

To see the choices, set the environment variable FLASHKIT_LOG_DISPATCH=1, or the logger
"flashkit.dispatch" to DEBUG: every call then logs the kernel that ran and why the others
declined, e.g.
    flashkit.dispatch: forward ran triton; declined: decode: 512 keys < 4096; gluon: not an
    sm_90 GPU; gluon on contiguous copies: q, k and v read in place already
"""

from __future__ import annotations

import dataclasses

import torch

from flashkit._dispatch_log import log_choice, logger
from flashkit.kept import length_free
from flashkit.ops.params import SCORE_SCALARS, SCORE_TENSORS, AttentionParams, KVCacheArgs
from flashkit.ops.tiled.kvcache import empty_result
from flashkit.ops.triton import (
    ahead,
    append,
    backward,
    backward_hopper,
    decode,
    forward,
    forward_hopper,
    prefill,
)
from flashkit.ops.triton.configs import GLUON_COPIES_MIN_QUERIES
from flashkit.ops.triton.configs.decode import DENSE_MIN_KEYS
from flashkit.ops.triton.hopper_common import tma_layout
from flashkit.ops.triton.launch import planned

__all__ = ["forward_call", "backward_call", "kvcache_call", "planned_forward", "kvcache_step",
           "forget_plans", "logger", "MAX_PLANS"]

MAX_PLANS = 4096  # forget every plan beyond this many keys (a safety bound)
MAX_KEPT_BACKWARDS = 16  # backward plans a PlannedForward keeps (one per dout layout, usually)
_plans: dict = {}


class Plan:
    """A choice: the kernel that runs, (kernel, why it declined) for the others, and the
    launches its launcher prepared (launch.planned), filled by the first call; fresh until
    that first call ran; live until forget_plans."""
    __slots__ = ("kernel", "declined", "launches", "fresh", "live")

    def __init__(self, kernel: str, declined: tuple):
        self.kernel, self.declined, self.launches = kernel, declined, {}
        self.fresh = self.live = True


def forget_plans() -> None:
    """Forget every cached choice (after changing a threshold or a switch in configs); a plan
    kept elsewhere (PlannedForward, PlannedStep) then declines to run."""
    for plan in _plans.values():
        plan.live = False
    _plans.clear()


class _Kept:
    """A plan kept by a front door with a call's checked arguments, so an equal call runs it
    without this module's key: calling it returns None (the caller then goes through the
    dispatch) once forget_plans has forgotten the plan, or where q is not on the current CUDA
    device (the launches run there); else it writes the dispatch log, as a call that finds the
    plan does, and returns run's result."""
    __slots__ = ("plan", "op")

    @property
    def live(self) -> bool:
        """Whether the plan is still the dispatch's (not forgotten)."""
        return self.plan.live

    def declines(self, q) -> bool:
        """Whether the plan cannot run a call on q: forgotten, or q on another CUDA device."""
        return _declines(self.plan, q)

    def __call__(self, params: AttentionParams, q, *tensors):
        if self.declines(q):
            return None
        log_choice(self.op, self.plan.kernel, self.plan.declined)
        return self.run(params, q, *tensors)


def _declines(plan: Plan, q) -> bool:
    """Whether a kept plan cannot run a call on q: forgotten, or q on another CUDA device (the
    launches run on the current one)."""
    return not plan.live or (q.is_cuda and q.get_device() != torch.cuda.current_device())


def _choose(op: str, key: tuple, candidates, log: bool = True) -> Plan:
    """The first candidate (name, thunk giving a decline reason or None) that takes the call;
    the last candidate is the portable kernel, which takes every call. Cached under key.
    Logged, unless log is False (a plan looked up again for a call that logged it)."""
    plan = _plans.get(key)
    if plan is None:
        declined = []
        for name, why_not in candidates:
            why = why_not()
            if why is None:
                break
            declined.append((name, why))
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = Plan(name, tuple(declined))
    if log:
        log_choice(op, plan.kernel, plan.declined)
    return plan


def _layout(t: torch.Tensor | None) -> tuple | None:
    """What a kernel choice reads of a tensor besides shape and dtype: its strides, whether it
    is contiguous and whether its address is 16-byte aligned (TMA)."""
    if t is None:
        return None
    return t.shape, t.dtype, t.stride(), t.data_ptr() % 16 == 0


def _values(params: AttentionParams) -> tuple:
    """What a kernel choice and a prepared launch read of params: its scalars' values and its
    tensors' layouts (not their contents; nor the dropout seed, which each call passes). Kept
    for the last params object seen: a call's backward, and the next call of a kept shape,
    pass the same one (params is frozen; its tensors are its own)."""
    global _last_values
    last = _last_values  # one read: autograd's device thread may replace it meanwhile
    if last[0] is params:
        return last[1]
    values = (params.softmax_scale, params.window_left, params.window_right,
              params.dropout_p, params.deterministic, _variant_kind(params.variant),
              *[getattr(params, name) for name in SCORE_SCALARS],
              *[_layout(getattr(params, name)) for name in SCORE_TENSORS],
              _layout(params.sink), _layout(params.attn_bias),
              _layout(params.cu_seqlens_q), _layout(params.cu_seqlens_k), params.max_seqlen_q,
              params.max_seqlen_k)
    _last_values = (params, values)
    return values


_last_values: tuple = (None, None)  # (params, _values(params)) of the last params seen


def _variant_kind(variant) -> tuple | None:
    """What a kernel choice and a prepared launch read of a user's modifiers: each modifier's
    functions and captured values (kernel_key), a block mask's block sizes and shape (which
    fix its lists' shapes), whether it runs over packed tokens, and whether a backward computes
    gradients for the captured tensors. Each call passes its own captured tensors and lists
    (hopper_common.modifier_tensors)."""
    if variant is None:
        return None
    mask = variant.block_mask
    score, mask_mod = variant.score_mod, variant.mask_mod
    return (None if score is None else score.kernel_key(),
            None if mask_mod is None else mask_mod.kernel_key(),
            None if mask is None else (mask.BLOCK_SIZE, mask.shape), bool(variant.packing),
            backward_hopper.wants_captured_grads(variant))


# --- forward and backward ----------------------------------------------------------------------

def forward_call(q, k, v, params: AttentionParams, out=None, lse=None):
    """(out, lse) of the attention forward; out and lse may be given preallocated."""
    plan = _forward_plan(q, k, v, params, out, lse)
    if plan.fresh:
        plan.fresh = False
        _compile_ahead(plan, q, k, v, params, out, lse)
    return _forward(plan, q, k, v, params, out, lse)


def planned_forward(q, k, v, params: AttentionParams) -> PlannedForward:
    """The forward plan that runs every call with this call's plan key (out and lse allocated),
    as a PlannedForward; flash_attn_func keeps it with the call's checked arguments after the
    call ran (which logged the choice)."""
    plan = _forward_plan(q, k, v, params, None, None, log=False)
    return planned(plan.launches, "planned", lambda: PlannedForward(plan))


class PlannedForward(_Kept):
    """A forward plan as a front door keeps it (_Kept): `run(params, q, k, v)` gives
    (out, lse), and `backward` the gradients of a call it ran, from the backward plans of its
    key that the calls' gradients found (`backwards`)."""
    __slots__ = ("backwards",)

    def __init__(self, plan: Plan):
        self.plan, self.op = plan, "forward"
        self.backwards: dict = {}  # backward plans by _kept_backward_key

    def run(self, params: AttentionParams, q, k, v):
        return _forward(self.plan, q, k, v, params, None, None)

    def backward(self, dout, q, k, v, out, lse, params: AttentionParams, dlse=None):
        """(dq, dk, dv, dsink) as backward_call gives them, for a call this plan's forward ran
        (q, k, v, out and lse as it saw and gave them, params its own); None where it declines
        (as calling it does: the plan forgotten, q not on the current CUDA device). dout may
        be strided: the backward reads a contiguous copy, as the backend's backward does."""
        if self.declines(q):
            return None
        dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        key = _kept_backward_key(dout, out, lse, dlse)
        plan = self.backwards.get(key)
        if plan is None or not plan.live:
            if len(self.backwards) >= MAX_KEPT_BACKWARDS:
                self.backwards.clear()
            plan = self.backwards[key] = _backward_plan(
                dout, q, k, v, lse, params, dq, dk, dv, True,
                _backward_layouts(dout, q, k, v, out, lse, dlse))
        else:
            log_choice("backward", plan.kernel, plan.declined)
        return _backward(plan, dout, q, k, v, out, lse, params, dq, dk, dv, dlse, True)


def any_length_forward(planned: PlannedForward, q, k, v, params: AttentionParams,
                       kept: AnyLengthForward | None = None) -> AnyLengthForward | None:
    """The forward plans at every key length of the class of a call that `planned` (its plan:
    planned_forward) runs (AnyLengthForward): kept, or a new one, with the call's plan for its
    range of key lengths; None (kept as it was) where another kernel runs the call or its
    features depend on the key length. A decoding step of transformers' cache, one key longer
    every call, would otherwise miss every plan. Dense calls only, without dropout or a user's
    modifiers, on the Gluon forward or the decode kernel; k and v each contiguous or
    heads-major (flashkit.kept.length_free, by which the caller keeps the plans too)."""
    layouts = length_free(k), length_free(v)
    if (not planned.live or planned.plan.kernel not in ("gluon", "decode") or params.is_varlen
            or params.variant is not None or params.dropout_p > 0 or None in layouts
            or k.shape[1] < 2):
        return kept
    above = k.shape[1] >= DENSE_MIN_KEYS
    key = ("forward, any key length", above, _layout(q), *layouts, q.device, _values(params))
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = Plan(planned.plan.kernel, planned.plan.declined)
    kept = kept or AnyLengthForward()
    kept.plans[above] = plan
    return kept


class AnyLengthForward:
    """The forward plans of dense calls of one class at every key length from 2
    (any_length_forward), kept by flash_attn_func under the class: q's layout, k's and v's but
    for their key length (flashkit.kept.length_free), and params. Two plans, made by the first
    call of each range: below DENSE_MIN_KEYS keys (the decode kernel declines: the Gluon
    forward) and from there (the decode kernel, unless q's rows decline it), whose launches
    take each call's key length. Calling it with (params, q, k, v) gives (out, lse), or None
    where it declines: no plan for the call's range yet, its plan forgotten (forget_plans) or
    q not on the current CUDA device. The dispatch log gives the reasons of the call that made
    the plan."""
    __slots__ = ("plans",)

    def __init__(self):
        self.plans: list[Plan | None] = [None, None]  # below DENSE_MIN_KEYS, from there

    def __call__(self, params: AttentionParams, q, k, v):
        length = k.shape[1]
        plan = None if length < 2 else self.plans[length >= DENSE_MIN_KEYS]
        if plan is None or _declines(plan, q):
            return None
        log_choice("forward", plan.kernel, plan.declined)
        if plan.kernel == "gluon":
            return forward_hopper.attention_forward(q, k, v, params, plan=plan.launches,
                                                    any_length=True)
        return decode.dense(q, k, v, params, plan=plan.launches, any_length=True)


def _kept_backward_key(dout, out, lse, dlse) -> tuple:
    """What a backward plan's key adds to that of the forward plan whose call it
    differentiates: dout's layout, the alignment of out and lse, whether there is an lse
    gradient. The forward's key fixed the rest: q, k and v are the tensors it read (autograd
    refuses them changed in place before the backward), and the forward allocated out and lse,
    laid out by its plan but for their addresses."""
    return _layout(dout), out.data_ptr() % 16 == 0, lse.data_ptr() % 16 == 0, dlse is None


def _forward_plan(q, k, v, params: AttentionParams, out, lse, log: bool = True) -> Plan:
    key = ("forward", _layout(q), _layout(k), _layout(v), q.device, _values(params),
           _layout(out), _layout(lse))
    return _choose("forward", key, [
        ("decode", lambda: decode.dense_declines(q, k, params)),
        ("gluon", lambda: forward_hopper.declines(q, k, v, params, out, lse, None)),
        (ON_COPIES, lambda: _not_for_copies(q, k, v, params) or forward_hopper.declines(
            q, k, v, params, out, lse, None, copies=True)),
        ("triton", lambda: None)], log)


def _forward(plan: Plan, q, k, v, params: AttentionParams, out, lse):
    if plan.kernel == "gluon":
        return forward_hopper.attention_forward(q, k, v, params, out=out, lse=lse,
                                                plan=plan.launches)
    if plan.kernel == ON_COPIES:
        return forward_call(*_copies(q, k, v), params, out=out, lse=lse)
    if plan.kernel == "decode":
        return decode.dense(q, k, v, params, out=out, lse=lse, plan=plan.launches)
    return forward.attention_forward(q, k, v, params, out=out, lse=lse)


# A call whose q, k or v the Gluon kernels cannot read as a 2-D TMA view (hopper_common.
# tma_layout: contiguous, tokens a pitch apart, or dense and heads-major, 16-byte aligned) runs
# them on contiguous copies: a head dim sliced out of a wider tensor, say. A copy reads and
# writes each tensor once: a small part of the attention's time with many query rows per
# sequence, as much as the attention itself with few (a decoding step reads its keys once),
# where the portable kernels, which read any strides, run instead (GLUON_COPIES_MIN_QUERIES).
# The backward copies again from the saved inputs rather than keep the forward's copies
# (autograd saves the inputs themselves: no memory beyond them).
ON_COPIES = "gluon on contiguous copies"


def _not_for_copies(q, k, v, params: AttentionParams) -> str | None:
    """Why copying q, k and v is not the way to the Gluon kernels, or None: they read them in
    place already (the plain "gluon" candidate declined for another reason), or the sequences
    have too few query rows for a copy to pay."""
    if all(tma_layout(x) for x in (q, k, v)):
        return "q, k and v read in place already"
    rows = params.max_seqlen_q if params.is_varlen else q.shape[1]
    if rows < GLUON_COPIES_MIN_QUERIES:
        return f"{rows} query rows < {GLUON_COPIES_MIN_QUERIES} (a copy would cost as much)"
    return None


def _copies(*tensors) -> tuple:
    """The tensors, each one the Gluon kernels cannot read in place as a contiguous copy (a
    new allocation, so 16-byte aligned: .contiguous() would return a contiguous tensor off 16
    bytes itself)."""
    return tuple(x if tma_layout(x) else x.clone(memory_format=torch.contiguous_format)
                 for x in tensors)


def _compiles_ahead(q, k, v) -> bool:
    """Whether a forward plan's first call compiles its backward too (_compile_ahead): on a
    GPU, for q, k or v requiring grad, not while a CUDA graph is being captured."""
    return (q.is_cuda and any(x.requires_grad for x in (q, k, v))
            and not torch.cuda.is_current_stream_capturing())


def _compile_ahead(plan: Plan, q, k, v, params: AttentionParams, out, lse) -> None:
    """The first call of a forward plan on a GPU whose q, k or v require grad: run the
    forward and its backward (dout laid out as out, as a loss's gradient is) with every launch
    only compiling, each kernel in its own thread (ahead.py), so the call and its first
    backward wait for the slowest compile instead of all of them in turn. Nothing runs; an
    error here is left to the calls themselves."""
    if not _compiles_ahead(q, k, v):
        return
    with ahead.compiling():
        try:
            out, lse = _forward(plan, q, k, v, params, out, lse)
            backward_call(out, q, k, v, out, lse, params)
        except Exception as error:  # the call itself raises what it must
            logger.debug("compiling ahead stopped: %r", error)


def backward_call(dout, q, k, v, out, lse, params: AttentionParams, dq=None, dk=None, dv=None,
                  dlse=None, own_lse: bool = True):
    """(dq, dk, dv, dsink) of the attention backward; dq, dk, dv may be given preallocated.
    dQ comes from its own kernel, summed in a fixed order (bitwise reproducible)."""
    # gradients allocated here are laid out as q, k, v (empty_like): only given ones add to the key
    given = tuple(None if t is None else (_layout(t), t.is_contiguous()) for t in (dq, dk, dv))
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    plan = _backward_plan(dout, q, k, v, lse, params, dq, dk, dv, own_lse,
                          _backward_layouts(dout, q, k, v, out, lse, dlse), given)
    return _backward(plan, dout, q, k, v, out, lse, params, dq, dk, dv, dlse, own_lse)


def _backward_layouts(dout, q, k, v, out, lse, dlse) -> tuple:
    """What a backward plan's key reads of the call's tensors besides params and the given
    gradients: each one's _layout, and whether there is an lse gradient."""
    return (_layout(q), _layout(k), _layout(v), _layout(dout), _layout(out), _layout(lse),
            dlse is None)


def _backward_plan(dout, q, k, v, lse, params: AttentionParams, dq, dk, dv, own_lse: bool,
                   layouts: tuple, given: tuple = (None, None, None)) -> Plan:
    """The backward's choice for the call: layouts, _backward_layouts of its tensors; given,
    the layouts of dq, dk and dv where the caller gave them (None for one allocated like q, k
    or v, which the layouts fix)."""
    key = ("backward", layouts, q.device, _values(params), given, own_lse)
    args = (q, k, v, dout, lse, params, dq, dk, dv, None)

    def copies_decline():  # neither Gluon way takes the call on copies of q, k and v
        why = _not_for_copies(q, k, v, params) or backward_hopper.declines(*args, copies=True)
        if why is not None and backward_hopper.as_varlen_declines(*args, copies=True) is None:
            why = None
        return why

    return _choose("backward", key, [
        ("gluon", lambda: backward_hopper.declines(*args)),
        ("gluon as varlen", lambda: backward_hopper.as_varlen_declines(*args)),
        (ON_COPIES, copies_decline),
        ("triton", lambda: None)])


def _backward(plan: Plan, dout, q, k, v, out, lse, params: AttentionParams, dq, dk, dv, dlse,
              own_lse: bool):
    """Run the backward's chosen kernels into dq, dk, dv."""
    if plan.kernel == "triton":
        return backward.attention_backward(dout, q, k, v, out, lse, params, dq, dk, dv,
                                           dlse=dlse, own_lse=own_lse)
    if plan.kernel == ON_COPIES:  # the gradients written into dq, dk, dv as they are laid out
        return backward_call(dout, *_copies(q, k, v), out, lse, params, dq=dq, dk=dk, dv=dv,
                             dlse=dlse, own_lse=own_lse)
    if plan.kernel == "gluon as varlen":
        return _dense_as_varlen(dout, q, k, v, out, lse, params, dq, dk, dv, dlse, own_lse,
                                plan=plan.launches)
    return backward.attention_backward(dout, q, k, v, out, lse, params, dq, dk, dv, dlse=dlse,
                                       gluon=True, own_lse=own_lse, plan=plan.launches)


def _dense_as_varlen(dout, q, k, v, out, lse, params: AttentionParams, dq, dk, dv, dlse,
                     own_lse: bool = True, gluon: bool = True, plan: dict | None = None):
    """A dense call whose lengths are not tile multiples (backward_hopper.as_varlen_declines)
    through the Gluon kernels as varlen with equal lengths, which they take at any length:
    tokens as (batch * seqlen, heads, d) views (dq, dk, dv written through theirs), lse and dlse
    as (nheads, batch * seqlen_q) copies. Sequence b is batch entry b: ALiBi's (batch, nheads)
    slopes and the dropout keep-mask, indexed (sequence, head, i, j), mean what they did dense.
    gluon=False runs the packed call on backward.py's varlen kernels instead (a test of the
    packing, in the interpreter too). plan: the dense call's prepared launches (the packed
    call's shapes and params follow from the dense key)."""
    batch, seqlen_q, nheads = q.shape[:3]
    seqlen_k = k.shape[1]
    packed = dataclasses.replace(params, cu_seqlens_q=prefill.multiples(seqlen_q, batch + 1,
                                                                         q.device),
                                 cu_seqlens_k=prefill.multiples(seqlen_k, batch + 1, q.device),
                                 max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k)

    def tokens(x):  # (batch, seqlen, heads, d) -> (batch * seqlen, heads, d)
        return x.reshape(-1, *x.shape[2:])

    def rows(x):  # (batch, nheads, seqlen_q) -> (nheads, batch * seqlen_q), contiguous (at
        # seqlen_q 1 a reshape would return a strided view, which the Gluon kernels refuse)
        return x.transpose(0, 1).contiguous().view(nheads, -1)

    dsink = backward.attention_backward(
        tokens(dout), tokens(q), tokens(k), tokens(v), tokens(out), rows(lse), packed,
        dq.view(-1, *dq.shape[2:]), dk.view(-1, *dk.shape[2:]), dv.view(-1, *dv.shape[2:]),
        dlse=None if dlse is None else rows(dlse), gluon=gluon, own_lse=own_lse, plan=plan)[3]
    return dq, dk, dv, dsink


# --- kv-cache ----------------------------------------------------------------------------------

def kvcache_call(q, k_cache, v_cache, cache: KVCacheArgs, params: AttentionParams):
    """(out, lse) of flash_attn_with_kvcache on the Triton kernels; appends in place."""
    step = kvcache_step(q, k_cache, v_cache, cache, params)
    if step is not None:  # one kernel rotates, appends and attends (decode.Step)
        return step.run(params, q, k_cache, v_cache, cache.k, cache.v, _seqlens(cache),
                        cache.rotary_cos, cache.rotary_sin, cache.cache_batch_idx,
                        cache.cache_leftpad, cache.block_table)
    seqlens, seqlen_new = _seqlens(cache), cache.seqlen_new
    # A bad index fails a device-side assertion in the append kernel (kvcache.py's docstring).
    q, seqlens_k = append.append(q, k_cache, v_cache, cache.k, cache.v, cache.rotary_cos,
                                 cache.rotary_sin, seqlens, cache.cache_batch_idx,
                                 cache.cache_leftpad, cache.block_table, cache.q_rows,
                                 cache.rotary_interleaved)
    if q.shape[1] == 0:  # an append without queries
        return empty_result(q, v_cache)
    keys_bound = cache.capacity if cache.host_seqlen is None else (cache.host_seqlen
                                                                   + seqlen_new)

    def packed():
        return prefill.as_varlen(q, k_cache, v_cache, cache.cache_batch_idx,
                                 cache.cache_leftpad, cache.block_table, params)

    def prefill_declines():
        why = prefill.declines(q, k_cache, cache.block_table, keys_bound)
        if why is None:
            view = packed()
            why = ("the cache is not contiguous and aligned" if view is None
                   else forward_hopper.declines(*view, None, None, None))
        return why

    key = ("prefill", _layout(q), q.device, _kvcache_key(k_cache, v_cache, cache),
           _layout(seqlens_k), keys_bound, _values(params))
    plan = _choose("kvcache", key, [("gluon prefill", prefill_declines), ("decode", lambda: None)])
    if plan.kernel == "gluon prefill":
        return prefill.forward(q, k_cache, v_cache, seqlens_k, cache.block_table, packed(),
                               plan=plan.launches)
    return decode.forward(q, k_cache, v_cache, seqlens_k, cache.cache_batch_idx,
                          cache.cache_leftpad, cache.block_table, params, cache.num_splits,
                          cache.max_seqlen_k, plan=plan.launches)


def kvcache_step(q, k_cache, v_cache, cache: KVCacheArgs, params: AttentionParams):
    """The planned decoding step (PlannedStep) that runs every call with this call's plan key,
    or None where the step is not the decode kernel's alone (the append kernel, then
    attention). flash_attn_with_kvcache keeps it with the call's checked arguments, so an equal
    call passes its tensors to it straight away. Refuses (NotImplementedError) what the decode
    kernels do not do, before anything writes the cache."""
    decode.check_supported(q.dtype, params)
    nheads_k = k_cache.shape[2]
    key = ("kvcache", _layout(q), q.device, _kvcache_key(k_cache, v_cache, cache),
           _values(params))
    plan = _choose("kvcache", key, [
        # an append without queries takes the append kernel alone
        ("decode step", lambda: "no query row" if q.shape[1] == 0 else
         decode.step_declines(q, nheads_k, cache.seqlen_new)),
        ("append, then attention", lambda: None)])
    if plan.kernel != "decode step":
        return None
    return planned(plan.launches, "planned", lambda: PlannedStep(
        plan, cache.num_splits, cache.max_seqlen_k, cache.q_rows, cache.rotary_interleaved))


class PlannedStep(_Kept):
    """A decoding step in the decode kernel alone (decode.Step), as every call of one plan key
    runs it, kept by flash_attn_with_kvcache (_Kept): splits, the cache-length bound and the
    rotary layout fixed, so a call passes its params, tensors and cache lengths alone (params'
    tensors, a sink or ALiBi slopes, change from call to call with the layout the key
    fixes)."""
    __slots__ = ("num_splits", "max_seqlen_k", "q_rows", "interleaved")

    def __init__(self, plan: Plan, num_splits: int, max_seqlen_k: int, q_rows: int,
                 interleaved: bool):
        self.plan, self.op = plan, "kvcache"
        self.num_splits, self.max_seqlen_k = num_splits, max_seqlen_k
        self.q_rows, self.interleaved = q_rows, interleaved

    def run(self, params: AttentionParams, q, k_cache, v_cache, k, v, cache_seqlens, cos, sin,
            cache_batch_idx, cache_leftpad, block_table):
        """(out, lse); cache_seqlens the lengths before the append, an int32 (batch,) tensor
        or an int."""
        step = decode.Step(cache_seqlens, k, v, cos, sin, self.interleaved, self.q_rows)
        return decode.forward(q, k_cache, v_cache, None, cache_batch_idx, cache_leftpad,
                              block_table, params, self.num_splits, self.max_seqlen_k,
                              step=step, plan=self.plan.launches)


def _seqlens(cache: KVCacheArgs):
    """The cache lengths before the append: cache_seqlens, or the int that stands for it."""
    return cache.host_seqlen if cache.cache_seqlens is None else cache.cache_seqlens


def _kvcache_key(k_cache, v_cache, cache: KVCacheArgs) -> tuple:
    """The cache's arguments as a launch reads them (an int cache_seqlens: each call passes
    its value to the planned launch)."""
    return (_layout(k_cache), _layout(v_cache), _layout(cache.k), _layout(cache.v),
            _layout(cache.rotary_cos), _layout(cache.rotary_sin), cache.rotary_interleaved,
            cache.q_rows, _layout(cache.cache_seqlens), _layout(cache.cache_batch_idx),
            _layout(cache.cache_leftpad), _layout(cache.block_table), cache.num_splits,
            cache.max_seqlen_k, cache.capacity)
