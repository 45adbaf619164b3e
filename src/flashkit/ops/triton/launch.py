"""Launch a Triton kernel again without its JIT entry's per-call work, where that provably
launches the same compiled kernel.

`kernel[grid](*args, **kwargs)` binds and specialises every argument in Triton's binder, turns
the options into a string for its cache key, then launches; on an H200 host that costs 22.7 us
per launch against 9.2 us for launching the compiled kernel it returns
(benchmarks/results/decode_20261121T064932.json, launch_study). A decoding call makes three
launches. `launch` keeps the compiled kernel under a key that determines Triton's own cache key
(`JITFunction.run`: the specialisation of every argument and the options) and launches it
directly when the key is seen again:
    tensor   its dtype and whether data_ptr() % 16 == 0 (Triton's "D" alignment mark)
    int      == 1 (Triton makes it a constexpr), % 16 == 0 ("D"), and its type: int32, int64
             or uint64 by range; bool and float by type, None as itself
    rest     the constexpr values, the launch options, the device, and the runtime knobs that
             Triton adds to the options (debug, instrumentation mode)
Anything else (an argument of another type, a registered launch hook, the interpreter) takes
Triton's entry. Two calls with equal keys get equal Triton keys, so the kernel launched is the
one Triton would launch; tests/test_kvcache.py checks the key against Triton's specialiser.
"""

from __future__ import annotations

import torch
import triton
from triton import knobs

from flashkit.ops.triton.common import interpreting

_INT32 = (-2**31, 2**31)
_compiled: dict = {}  # key -> Triton's compiled kernel


def arg_key(arg):
    """What Triton's specialisation of one non-constexpr argument depends on (or raises
    TypeError for a type it is not known for)."""
    kind = type(arg)
    if kind is int:
        return (arg == 1, arg % 16 == 0, _INT32[0] <= arg < _INT32[1], arg < 2**63)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if kind is bool or kind is float or arg is None:
        return (kind, arg) if kind is bool else kind
    raise TypeError(f"launch: no key for an argument of type {kind.__name__}")


def launch(kernel, grid: tuple, args: tuple, constexprs: dict, **options) -> None:
    """kernel[grid](*args, **constexprs, **options), the compiled kernel launched directly once
    it is known. args: the runtime arguments in signature order; constexprs: the rest, also in
    signature order (they follow the runtime arguments in every kernel launched here)."""
    if interpreting() or _hooked():
        kernel[grid](*args, **constexprs, **options)
        return
    device = torch.cuda.current_device()
    try:
        key = (id(kernel), device, tuple(map(arg_key, args)), tuple(constexprs.values()),
               tuple(options.items()), knobs.runtime.debug,
               knobs.compilation.instrumentation_mode)
    except TypeError:
        kernel[grid](*args, **constexprs, **options)
        return
    compiled = _compiled.get(key)
    if compiled is None or _globals_changed(kernel):
        compiled = kernel[grid](*args, **constexprs, **options)
        if hasattr(compiled, "result"):  # asynchronous compilation
            compiled = compiled.result()
        if kernel.arg_names[len(args):] != list(constexprs):
            raise ValueError(f"launch: {kernel.__name__}'s constexprs must follow its runtime "
                             "arguments in the signature, in order")
        _compiled[key] = compiled
        return
    grid = tuple(grid) + (1,) * (3 - len(grid))
    stream = triton.runtime.driver.active.get_current_stream(device)
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *constexprs.values())


def _hooked() -> bool:
    """Whether a launch hook is registered (Triton 3.6 keeps them in HookChain objects that are
    never None; an empty chain calls nothing, so the direct launch passes no hook)."""
    return any(hook is not None and getattr(hook, "calls", True)
               for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))


def _globals_changed(kernel) -> bool:
    """Triton's check that the globals a compiled kernel used still hold their values."""
    missing = object()
    return any(scope.get(name, missing) != value
               for (name, _), (value, scope) in kernel.used_global_vals.items())
