"""Keep Triton's interpreter (TRITON_INTERPRET=1: kernels on the CPU) working with numpy >= 2.4.

Triton 3.6's interpreter turns run-time loop bounds into Python ints with int(ndarray of shape
(1,)), which numpy 2.4 rejects ("only 0-dimensional arrays can be converted to Python scalars").
Reading the one element instead is what it meant. Nothing changes when kernels are compiled.
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
