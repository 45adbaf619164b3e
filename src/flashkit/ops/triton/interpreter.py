"""Keep Triton's interpreter (TRITON_INTERPRET=1: kernels on the CPU) correct where it is not.

- numpy >= 2.4: Triton 3.6's interpreter turns run-time loop bounds into Python ints with
  int(ndarray of shape (1,)), which numpy 2.4 rejects ("only 0-dimensional arrays can be
  converted to Python scalars"). Reading the one element instead is what it meant.
- float8 casts: its float -> fp8 rounding drops the carry when the mantissa rounds up (31.3 ->
  16 instead of 32 in e4m3), so fp8 kernels would compute with wrong P. Casts to float8_e4m3fn
  and float8_e5m2 go through torch's round-to-nearest-even instead, saturated to the largest
  finite value as the GPU's cvt.rn.satfinite does.
- bfloat16: it keeps bfloat16 values as their uint16 bit patterns and multiplies those as
  integers, so every bfloat16 tl.dot (the kernels' QK^T and PV) gave garbage: the operands are
  widened to the float32 values they stand for (exact), as the tensor cores read them. And it
  truncates float32 -> bfloat16 casts where the GPU rounds to nearest even (cvt.rn.bf16.f32):
  they go through torch's rounding instead.
Nothing changes when kernels are compiled.
"""

from __future__ import annotations

import os

import numpy as np


def patch_for_numpy() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    if tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 4):
        return
    import triton.runtime.interpreter as interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "_flashkit_shim", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._flashkit_shim = True
    interpreter._patch_lang_tensor = patched


def patch_bfloat16() -> None:
    """bfloat16 tl.dot multiplies values and float32 -> bfloat16 rounds to nearest even (see
    above)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    builder = interpreter.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl
    if getattr(dot, "_flashkit_shim", False):
        return

    def values(handle):  # a bfloat16 handle's uint16 bits -> float32 handle of its values
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = np.asarray(handle.data).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, values(a), values(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast(self, src, dst_type)
        data = np.asarray(src.data)  # torch.from_numpy keeps its shape, 0-d included
        rounded = torch.from_numpy(np.ascontiguousarray(data)).reshape(data.shape)
        bits = rounded.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return interpreter.TensorHandle(bits, dst_type.scalar)

    create_dot._flashkit_shim = True
    builder.create_dot, builder.cast_impl = create_dot, cast_impl


def patch_float8_casts() -> None:
    """Casts from fp16/fp32/fp64 (numpy's own types) to fp8 round as torch does (see above)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import torch
    import triton.runtime.interpreter as interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_to_fp
    if getattr(original, "_flashkit_shim", False):
        return
    targets = {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        target = targets.get(dst_type.scalar.name)
        if target is None or src.dtype.scalar.name not in ("fp16", "fp32", "fp64"):
            return original(self, src, dst_type, rounding_mode)
        x = torch.from_numpy(np.ascontiguousarray(src.data).astype(np.float32))
        limit = torch.finfo(target).max
        x = torch.where(torch.isnan(x), x, x.clamp(-limit, limit))
        data = x.to(target).view(torch.uint8).numpy()
        return interpreter.TensorHandle(data, dst_type.scalar)

    create_fp_to_fp._flashkit_shim = True
    builder.create_fp_to_fp = create_fp_to_fp
