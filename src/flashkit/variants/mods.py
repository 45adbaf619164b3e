"""Score and mask modifiers: what the user writes, how it is checked, how each backend runs it.

A modifier is one @triton.jit function (or a plain function in the same small language, which
flashkit decorates itself), with FlexAttention's meaning:

    score_mod(score, b, h, q_idx, kv_idx, *captured) -> new score   (the scaled score q.k*scale)
    mask_mod(b, h, q_idx, kv_idx, *captured)         -> bool        (True = the key is visible)

`captured` are tensors (read with `tl.load(table + index)`, flat and contiguous) or Python
numbers, bound with `ScoreMod(fn, *captured)` / `MaskMod(fn, *captured)`. The Triton kernels
call the function at their one score-modification spot; the tiled and reference backends call
its Python body on torch tensors (torch_language.py), so autograd gives the gradient of the
score and of every captured tensor that requires it. The Triton backward needs
d score_mod / d score from the modifier itself: `ScoreMod(fn, *captured, grad=dfn)` with
`dfn(score, b, h, q_idx, kv_idx, *captured) -> d new score / d score`, and, for captured
tensors that require a gradient, the rule that adds their share:
`captured_grad=gfn` with `gfn(ds, score, b, h, q_idx, kv_idx, *captured, *grads)`, where ds is
dL / d new score on a tile and grads holds one float32 buffer per captured value (None for a
value whose gradient is not wanted), to add into with tl.atomic_add.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field

import torch

from flashkit import kept
from flashkit.variants import torch_language

_SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
_CAPTURED_GRAD_ARGS = ("ds", "score", "b", "h", "q_idx", "kv_idx")
_MASK_ARGS = ("b", "h", "q_idx", "kv_idx")

# Python bodies with a torch implementation of their own (the Triton one is an approximation
# with no useful derivative on torch tensors, e.g. tanh through exp2).
TORCH_OVERRIDES: dict = {}


def _is_jit(obj) -> bool:
    """A @triton.jit function (compiled or interpreted), recognised without importing triton."""
    return type(obj).__module__.startswith("triton.") and callable(getattr(obj, "fn", None))


def python_function(fn):
    """The plain Python function of a modifier (a @triton.jit's undecorated body)."""
    return fn.fn if _is_jit(fn) else fn


_JITTED: dict = {}  # plain function -> its @triton.jit, made once (jitted)
_SIGNATURES_CHECKED: set = set()  # (function, argument names, count of extra ones) that passed


def jitted(fn):
    """fn as a @triton.jit function: itself if it is one, else its decoration, made once per
    Python function, so every modifier of the same function compiles into the same kernels and
    launch plans (a new decoration per call would be a new kernel to Triton's in-memory
    cache)."""
    if fn is None or _is_jit(fn):
        return fn
    jit = _JITTED.get(fn)
    if jit is None:
        import triton
        if len(_JITTED) >= 4096:  # a safety bound
            _JITTED.clear()
        jit = _JITTED[fn] = triton.jit(fn)
    return jit


class _Mod:
    kind = ""
    _arg_names: tuple = ()

    bound = None  # ScoreMod's promise on its scores (None: none)

    def __init__(self, fn, *captured, grad=None, captured_grad=None):
        self.fn, self.captured, self.grad = fn, tuple(captured), grad
        self.captured_grad = captured_grad
        self._twins: dict = {}
        self._kernel_key = None
        self._kept_calls: dict = {}  # kept_params: the calls this modifier hosts

    def check(self, device) -> None:
        """TypeError/ValueError naming the argument for a modifier no backend can run."""
        n = len(self.captured)
        for fn, role, names, n_extra in (
                (self.fn, self.kind, self._arg_names, n),
                (self.grad, f"{self.kind} grad", self._arg_names, n),
                (self.captured_grad, f"{self.kind} captured_grad", _CAPTURED_GRAD_ARGS, 2 * n)):
            if fn is None:
                continue
            py = python_function(fn)
            if not isinstance(py, types.FunctionType):
                raise TypeError(f"{role}: expected a @triton.jit function or a plain def "
                                f"function, got {type(fn).__name__}")
            _check_signature(py, names, n_extra, role)
        for n, t in enumerate(self.captured):
            if isinstance(t, bool) or not isinstance(t, (torch.Tensor, int, float)):
                raise TypeError(f"{self.kind}: captured value {n} must be a tensor, int or "
                                f"float, got {type(t).__name__}")
            if not isinstance(t, torch.Tensor):
                continue
            if t.device != device:
                raise ValueError(f"{self.kind}: captured tensor {n} is on {t.device}, expected "
                                 f"q's device {device}")
            if t.is_complex() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise TypeError(f"{self.kind}: captured tensor {n} has dtype {t.dtype}; "
                                "expected a real float, integer or bool tensor")
            if not t.is_contiguous():
                raise ValueError(f"{self.kind}: captured tensor {n} must be contiguous (the "
                                 "modifier indexes it as flat memory: tl.load(t + index))")

    def jit(self):
        """The @triton.jit function the kernels call (jitted)."""
        return jitted(self.fn)

    def jit_grad(self):
        return jitted(self.grad)

    def jit_captured_grad(self):
        return jitted(self.captured_grad)

    def kernel_key(self) -> tuple:
        """What a Triton kernel compiles in of this modifier, for launch plans' keys: its
        @triton.jit functions, derivative and captured_grad rule included (the same objects
        for the same Python functions: jitted), its captured values' dtypes (tensors, which
        each launch is passed) or types and values (numbers, on which Triton may specialise),
        and a ScoreMod's bound (the forward's fixed row max). Made once: all are fixed. The
        functions' Triton cache keys are settled first, as a launch does before compiling (a
        key hashes them, which computes their cache keys)."""
        if self._kernel_key is None:
            from flashkit.ops.triton.launch import settle_cache_keys
            functions = (self.jit(), self.jit_grad(), self.jit_captured_grad())
            settle_cache_keys(*functions)
            self._kernel_key = (*functions, tuple(
                t.dtype if isinstance(t, torch.Tensor) else (type(t), t) for t in self.captured),
                self.bound)
        return self._kernel_key

    def kernel_args(self) -> tuple:
        """The captured values as the kernels take them (a tuple: tensors become pointers)."""
        return self.captured

    def twin(self, dtype: torch.dtype, device):
        """The modifier's Python body bound to the torch language for this dtype and device."""
        key = (dtype, device)
        if key not in self._twins:
            self._twins[key] = torch_twin(python_function(self.fn), dtype, device)
        return self._twins[key]

    def torch_captured(self, captured=None):
        """Captured tensors as flat Pointers (autograd flows through them), numbers as they are."""
        return tuple(torch_language.Pointer(t.reshape(-1)) if isinstance(t, torch.Tensor) else t
                     for t in (self.captured if captured is None else captured))

    def for_dtype(self, dtype: torch.dtype) -> _Mod:
        """The modifier a call with inputs of this dtype runs: itself (the library's softcap
        chooses its tanh by dtype here, as softcap= does)."""
        return self

    def grad_tensors(self) -> list[int]:
        """Indices of the captured tensors that require a gradient."""
        return [n for n, t in enumerate(self.captured)
                if isinstance(t, torch.Tensor) and t.requires_grad]


class ScoreMod(_Mod):
    """score_mod(score, b, h, q_idx, kv_idx, *captured) -> score, with captured values bound.

    grad (optional, for the Triton backward): grad(score, b, h, q_idx, kv_idx, *captured) ->
    d score_mod / d score at that score (1 for an additive bias).
    captured_grad (optional, for the Triton backward of captured tensors that require a
    gradient): captured_grad(ds, score, b, h, q_idx, kv_idx, *captured, *grads) adds
    ds * d score_mod / d captured into grads (one float32 buffer per captured value, flat like
    it, None where no gradient is wanted) with tl.atomic_add; ds is dL / d score_mod(score)
    on a [BLOCK_M, BLOCK_N] tile (rows queries, 0 where masked), score the score before
    score_mod.
    bound (optional, a positive float B): a promise that -B <= score_mod(score) <= B for every
    score, as a tanh softcap keeps. The Hopper forward then softmaxes against a fixed row max
    instead of a running one (no max per tile, no rescaling of the output), as the built-in
    softcap does, when the inputs' dtype holds every P = exp(s - B) it produces: 2 B log2(e)
    <= 100 in bfloat16 (B <= 34.6), <= 15 in float16 (B <= 5.2); other calls ignore it. A
    score above B makes P larger than 1 (in float16 it may overflow to inf), so declare only
    a bound the function keeps."""
    kind = "score_mod"
    _arg_names = _SCORE_ARGS

    def __init__(self, fn, *captured, grad=None, captured_grad=None, bound=None):
        super().__init__(fn, *captured, grad=grad, captured_grad=captured_grad)
        if bound is not None:
            if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not (
                    0 < bound < float("inf")):
                raise ValueError(f"score_mod: bound must be a positive finite number, got "
                                 f"{bound!r}")
            bound = float(bound)
        self.bound = bound


class MaskMod(_Mod):
    """mask_mod(b, h, q_idx, kv_idx, *captured) -> bool (True = visible), captured bound."""
    kind = "mask_mod"
    _arg_names = _MASK_ARGS

    def __init__(self, fn, *captured):
        super().__init__(fn, *captured)


def _check_signature(py, names: tuple, n_extra: int, role: str) -> None:
    """TypeError unless py takes exactly the positional arguments names and n_extra more
    (inspect's reading, once per function and arguments: tens of microseconds)."""
    if (py, names, n_extra) in _SIGNATURES_CHECKED:
        return
    params = list(inspect.signature(py).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    expected = len(names) + n_extra
    if len(positional) != expected or len(positional) != len(params):
        what = "captured and grads" if names is _CAPTURED_GRAD_ARGS else "captured"
        want = ", ".join(names) + (f", <{n_extra} {what}>" if n_extra else "")
        raise TypeError(f"{role}: {py.__name__}{inspect.signature(py)} must take exactly "
                        f"{expected} positional arguments ({want})")
    if len(_SIGNATURES_CHECKED) >= 4096:  # a safety bound
        _SIGNATURES_CHECKED.clear()
    _SIGNATURES_CHECKED.add((py, names, n_extra))


def torch_twin(py, dtype: torch.dtype, device):
    """py with its globals remapped: triton.language -> the torch language, other @triton.jit
    functions -> their torch twins (or TORCH_OVERRIDES), everything else as it was."""
    tl = torch_language.language(dtype, device)
    env = dict(py.__globals__)
    for name in py.__code__.co_names:
        value = env.get(name)
        if isinstance(value, types.ModuleType) and value.__name__ in ("triton.language",
                                                                      "triton.language.math"):
            env[name] = tl
        elif _is_jit(value):
            body = python_function(value)
            env[name] = TORCH_OVERRIDES.get(body) or torch_twin(body, dtype, device)
    return types.FunctionType(py.__code__, env, py.__name__, py.__defaults__, py.__closure__)


def score_mod_of(score_mod) -> ScoreMod | None:
    if score_mod is None or isinstance(score_mod, ScoreMod):
        return score_mod
    return ScoreMod(score_mod)


def mask_mod_of(mask_mod) -> MaskMod | None:
    if mask_mod is None or isinstance(mask_mod, MaskMod):
        return mask_mod
    if isinstance(mask_mod, ScoreMod):
        raise TypeError("mask_mod: got a ScoreMod; wrap mask functions in flashkit.MaskMod")
    return MaskMod(mask_mod)


@dataclass(eq=False)
class Variant:
    """The modifiers of one call, as every backend reads them (AttentionParams.variant).

    captured_grads: during a backward, one float buffer per captured tensor of score_mod that
    requires a gradient (None for the others); the tiled backward adds into them, the Triton
    backward through the score_mod's captured_grad rule."""
    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    block_mask: object | None = None  # flashkit.variants.BlockMask
    captured_grads: list | None = field(default=None, repr=False)
    # the Triton run of a varlen call with a block mask: the mask's packing (its kernels take
    # the packed tokens as one sequence, common.mod_indices); () otherwise
    packing: tuple = ()

    # --- torch backends ------------------------------------------------------------------
    def grouped_tile(self, s, batch0: int, i0: int, i1: int, j0: int, j1: int, chain=None,
                     grad: bool = False):
        """Modify the tiled backend's scores s (b, hk, g, BM, BN) of rows [i0, i1), columns
        [j0, j1); see `apply`."""
        b = torch.arange(batch0, batch0 + s.shape[0], device=s.device).view(-1, 1, 1, 1, 1)
        h = torch.arange(s.shape[1] * s.shape[2], device=s.device).view(1, *s.shape[1:3], 1, 1)
        i = torch.arange(i0, i1, device=s.device)[:, None]
        j = torch.arange(j0, j1, device=s.device)[None, :]
        return self.apply(s, b, h, i, j, chain, grad)

    def dense(self, s, batch0: int = 0):
        """Modify the oracle's whole score matrix s (b, h, sq, sk) (differentiable)."""
        b = torch.arange(batch0, batch0 + s.shape[0], device=s.device).view(-1, 1, 1, 1)
        h = torch.arange(s.shape[1], device=s.device).view(1, -1, 1, 1)
        i = torch.arange(s.shape[2], device=s.device)[:, None]
        j = torch.arange(s.shape[3], device=s.device)[None, :]
        return self.apply(s, b, h, i, j)[0]

    def apply(self, s, b, h, i, j, chain=None, grad: bool = False):
        """(score_mod(s) with mask_mod's hidden pairs at -inf, chain').

        chain maps a gradient on s to one on the raw scores (None: identity); with grad=True
        the returned chain also passes through score_mod (its vector-Jacobian product, adding
        the captured tensors' share into captured_grads). Without grad the modifier runs on s
        as it is, so autograd sees it (the oracle)."""
        if self.score_mod is not None:
            twin = self.score_mod.twin(s.dtype, s.device)
            if grad:
                s, chain = self._score_vjp(twin, s, b, h, i, j, chain)
            else:
                s = _checked_score(twin(s, b, h, i, j, *self.score_mod.torch_captured()), s)
        if self.mask_mod is not None:
            twin = self.mask_mod.twin(s.dtype, s.device)
            keep = _checked_mask(twin(b, h, i, j, *self.mask_mod.torch_captured()))
            s = s.masked_fill(~keep, float("-inf"))
        return s, chain

    def _score_vjp(self, twin, s, b, h, i, j, chain):
        mod = self.score_mod
        wanted = [n for n in mod.grad_tensors() if self.captured_grads is not None]
        with torch.enable_grad():
            s_in = s.detach().requires_grad_()
            leaves = [t.detach().requires_grad_() if n in wanted else t
                      for n, t in enumerate(mod.captured)]
            out = _checked_score(twin(s_in, b, h, i, j, *mod.torch_captured(leaves)), s)

        def vjp(ds):
            inputs = [s_in, *(leaves[n] for n in wanted)]
            grads = torch.autograd.grad(out, inputs, ds.to(out.dtype), allow_unused=True)
            for n, g in zip(wanted, grads[1:], strict=True):
                if g is not None:
                    self.captured_grads[n] += g.to(self.captured_grads[n].dtype)
            ds_in = torch.zeros_like(s) if grads[0] is None else grads[0]
            return ds_in if chain is None else chain(ds_in)
        return out.detach(), vjp

    # --- Triton ----------------------------------------------------------------------------
    def triton_args(self) -> dict:
        """The kernels' modifier arguments: functions (compile-time) and captured tuples."""
        score, mask = self.score_mod, self.mask_mod
        return dict(SCORE_MOD=None if score is None else score.jit(),
                    SCORE_GRAD=None if score is None else score.jit_grad(),
                    MASK_MOD=None if mask is None else mask.jit(),
                    score_args=() if score is None else score.kernel_args(),
                    mask_args=() if mask is None else mask.kernel_args(),
                    packing=self.packing)


def _checked_score(out, s):
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        got = type(out).__name__ if not isinstance(out, torch.Tensor) else f"{out.dtype} tensor"
        raise TypeError(f"score_mod: must return a floating-point score, got {got}")
    return torch.broadcast_to(out.to(s.dtype), s.shape)


def _checked_mask(keep):
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
        got = type(keep).__name__ if not isinstance(keep, torch.Tensor) else f"{keep.dtype} tensor"
        raise TypeError(f"mask_mod: must return a bool (True = visible), got {got}")
    return keep


_PROBED: set = set()


def probe(variant: Variant, dtype: torch.dtype, device) -> None:
    """Run each modifier once on one (b, h, q_idx, kv_idx) = 0 element, so a modifier that
    returns the wrong thing fails here with its name, before any kernel compiles. Once per
    modifier, captured dtypes and device: later calls cost a set lookup."""
    key = tuple((mod.fn, mod.grad, tuple(getattr(t, "dtype", type(t)) for t in mod.captured))
                for mod in (variant.score_mod, variant.mask_mod) if mod is not None)
    key += (dtype, str(device))
    if key in _PROBED:
        return
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=device)
    s = torch.zeros((1, 1, 1, 1), dtype=dtype, device=device)
    Variant(variant.score_mod, variant.mask_mod).apply(s, zero, zero, zero, zero)
    _PROBED.add(key)


# Kept calls with modifiers (flashkit.kept): a call's checked AttentionParams, with its Variant
# bound, kept by one of the call's own modifier objects (the block mask, else the ScoreMod, else
# the MaskMod: its host), so that they live and die with it; an equal later call with the same
# modifier objects skips the checks and the binding. A modifier's functions and captured values
# are fixed once it is made (kernel_key relies on that too); the captured tensors' contents are
# read by every call. A call whose modifiers include a plain function (wrapped anew every call)
# and no flashkit object to host it is not kept.


def _hosted(score_mod, mask_mod, block_mask) -> dict | None:
    """The kept calls of the flashkit object among a call's modifiers that hosts them (a
    BlockMask's or a ScoreMod's or MaskMod's _kept_calls, in that order), or None. (An object
    that only looks like one never gets an entry: keep_params runs after attach's checks.)"""
    for mod in (block_mask, score_mod, mask_mod):
        calls = getattr(mod, "_kept_calls", None)
        if calls is not None:
            return calls
    return None


def kept_params(score_mod, mask_mod, block_mask, key: tuple):
    """What keep_params kept of an earlier call with these same modifier objects and an equal
    key (the call's scalar arguments and q, k and v's facts): the params attach gave it (a
    varlen call: with its cu_seqlens' identities and versions), or None."""
    calls = _hosted(score_mod, mask_mod, block_mask)
    if calls is None:
        return None
    # the entry holds the objects it was kept for, so their ids stay theirs while it lives
    return calls.get((key, id(score_mod), id(mask_mod), id(block_mask)), (None, None))[1]


def keep_params(score_mod, mask_mod, block_mask, key: tuple, params) -> None:
    """Keep attach's params of a call whose checks all passed, or what the entry point keeps
    with them (kept_params)."""
    calls = _hosted(score_mod, mask_mod, block_mask)
    if calls is not None:  # the objects held: see kept_params
        kept.remember(calls, (key, id(score_mod), id(mask_mod), id(block_mask)),
                      ((score_mod, mask_mod, block_mask), params))


def attach(params, q, score_mod, mask_mod, block_mask, batch: int, nheads: int,
           seqlen_q: int, seqlen_k: int):
    """AttentionParams with the call's modifiers checked and bound (params itself when none)."""
    if score_mod is None and mask_mod is None and block_mask is None:
        return params
    import dataclasses

    from flashkit.variants.block_mask import BlockMask
    score, mask = score_mod_of(score_mod), mask_mod_of(mask_mod)
    if score is not None:
        score = score.for_dtype(q.dtype)
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask: expected a flashkit.BlockMask from "
                            f"flashkit.create_block_mask, got {type(block_mask).__name__}")
        if mask is not None and mask.fn is not block_mask.mask_mod.fn:
            raise ValueError("mask_mod: differs from block_mask's; pass block_mask alone (its "
                             "mask_mod is the mask)")
        if params.window_left is not None or params.window_right is not None:
            raise ValueError("block_mask: causal and window_size are masks too; write them "
                             "into the block mask's mask_mod")
        if params.is_varlen:
            block_mask.check_packing(q.shape[0], nheads, params.cu_seqlens_q,
                                     params.cu_seqlens_k)
        else:
            block_mask.check(batch, nheads, seqlen_q, seqlen_k, q.device)
        mask = block_mask.mask_mod
    for mod in (score, mask):
        if mod is not None:
            mod.check(q.device)
    variant = Variant(score, mask, block_mask)
    probe(variant, torch.float32 if q.dtype != torch.float64 else q.dtype, q.device)
    return dataclasses.replace(params, variant=variant)
