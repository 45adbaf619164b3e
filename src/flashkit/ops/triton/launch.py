"""Launch a Triton or Gluon kernel again without its JIT entry's per-call work, where that
provably launches the same compiled kernel.

`kernel[grid](*args, **kwargs)` binds and specialises every argument in Triton's binder, turns
the options into a string for its cache key, then launches; on an H200 host that costs 15-23 us
per launch against 6.5-9.2 us for launching the compiled kernel it returns
(benchmarks/results/decode_20261121T064932.json and _081334.json, launch_study); the Gluon
forward's binder (three TMA descriptors, 34 runtime arguments) costs more. A decoding call makes
three launches, a Gluon forward call one. `launch` keeps the compiled kernel under a key that
determines Triton's own cache key (`JITFunction.run`: the specialisation of every argument and the
options) and launches it directly when the key is seen again:
    tensors  each one's dtype and whether data_ptr() % 16 == 0 (Triton's "D" alignment mark);
             a Gluon TensorDescriptor's dtype, block shape, layout and padding
    scalars  their values and types (int, float, bool or None), of which Triton's marks are a
             function (int == 1 becomes a constexpr, % 16 == 0 "D", int32/int64/uint64 by
             range)
    rest     the constexpr values, the launch options, the device, and the runtime knobs that
             Triton adds to the options (debug, instrumentation mode)
Keying scalars by value is finer than Triton's key (more entries, each launched through Triton
the first time) and costs one C-level tuple hash instead of a Python call per argument.
Anything else (a registered launch hook, the interpreter, a scalar of another type) takes
Triton's entry. Equal keys imply equal Triton keys, so the kernel launched is the one Triton
would launch; tests/test_kvcache.py checks the tensor and descriptor keys against Triton's
specialiser.
"""

from __future__ import annotations

import functools
import operator

import torch
import triton
from triton import knobs

from flashkit.ops.triton.common import interpreting

MAX_ENTRIES = 4096  # forget every entry beyond this (scalars that change every call)
_SCALAR_TYPES = (int, float, bool, type(None))
_compiled: dict = {}  # key -> Triton's compiled kernel
_globals_seen: dict = {}  # kernel -> the objects its globals were when last found unchanged
_MISSING = object()


def tensor_key(t) -> tuple:
    """What Triton's specialisation of a tensor argument depends on: a torch tensor's dtype and
    alignment, a Gluon TMA descriptor's dtype, block, shared layout and padding (its shape and
    strides are runtime arguments; its base is 16-byte aligned by construction)."""
    if isinstance(t, torch.Tensor):
        return t.dtype, t.data_ptr() % 16 == 0
    return t.base.dtype, tuple(t.block_shape), t.layout, t.padding


def launch(kernel, grid: tuple, tensors: tuple, scalars: tuple, constexprs: dict,
           **options) -> None:
    """kernel[grid](*tensors, *scalars, **constexprs, **options), the compiled kernel launched
    directly once it is known. The kernel's signature lists the tensor arguments, then the
    scalars, then the constexprs, each in the order given here."""
    if interpreting() or _hooked():
        kernel[grid](*tensors, *scalars, **constexprs, **options)
        return
    device = torch.cuda.current_device()
    key = (id(kernel), device, tuple([tensor_key(t) for t in tensors]), scalars,
           tuple(map(type, scalars)), tuple(constexprs.values()), tuple(options.items()),
           knobs.runtime.debug, knobs.compilation.instrumentation_mode)
    compiled = _compiled.get(key)
    if compiled is None or _globals_changed(kernel):
        compiled = kernel[grid](*tensors, *scalars, **constexprs, **options)
        if hasattr(compiled, "result"):  # asynchronous compilation
            compiled = compiled.result()
        if kernel.arg_names[len(tensors) + len(scalars):] != list(constexprs):
            raise ValueError(f"launch: {kernel.__name__}'s constexprs must follow its runtime "
                             "arguments in the signature, in order")
        if all(type(a) in _SCALAR_TYPES for a in scalars):
            if len(_compiled) >= MAX_ENTRIES:
                _compiled.clear()
            _compiled[key] = compiled
        return
    grid = tuple(grid) + (1,) * (3 - len(grid))
    stream = triton.runtime.driver.active.get_current_stream(device)
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *tensors, *scalars, *constexprs.values())


@functools.lru_cache
def _device_facts(index: int) -> tuple[int, bool]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major >= 9


def device_facts(device: torch.device) -> tuple[int, bool]:
    """(SM count, whether programmatic dependent launch (PDL, compute capability >= 9) is used)
    for kernels on `device`; (4, False) under the interpreter."""
    if device.type != "cuda" or interpreting():
        return 4, False
    return _device_facts(torch.cuda.current_device() if device.index is None else device.index)


def _hooked() -> bool:
    """Whether a launch hook is registered (Triton 3.6 keeps them in HookChain objects that are
    never None; an empty chain calls nothing, so the direct launch passes no hook)."""
    return any(hook is not None and getattr(hook, "calls", True)
               for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))


def _globals_changed(kernel) -> bool:
    """Triton's check that the globals a compiled kernel used still hold their values, made
    again only when one of them is another object than at the last check that passed (Triton
    compares deep copies by value: 6.4 us a launch for the Gluon forward's nine gl.constexpr
    globals, whose != builds new constexprs). A global mutated in place (a list) would go
    unseen; the kernels' globals are constexprs."""
    current = [scope.get(name, _MISSING) for (name, _), (_, scope) in
               kernel.used_global_vals.items()]
    seen = _globals_seen.get(kernel)
    if seen is not None and len(seen) == len(current) and all(map(operator.is_, seen, current)):
        return False
    values = [value for value, _ in kernel.used_global_vals.values()]
    if any(now != value for now, value in zip(current, values, strict=True)):
        return True
    _globals_seen[kernel] = current  # holds the objects, so an identity cannot be reused
    return False
