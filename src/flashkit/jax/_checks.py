"""Input checks and the static configuration every JAX implementation reads.

`check_inputs` turns the public arguments into an `AttentionConfig` (hashable, so it can ride
through `jax.custom_vjp` as a non-differentiable argument and through `jax.jit` as a static one)
or raises a ValueError/TypeError that names the argument and what was expected.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

IMPLEMENTATIONS = ("pallas", "pallas_triton", "pallas_mosaic", "xla", "fori")
FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
PALLAS_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
MAX_HEADDIM = 256


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """What a kernel needs to know besides the arrays (all static).

    The kernels see queries in the folded GQA layout (see `flashkit.jax.flash_attention`): row
    `r` of a kv head is query position `r % seqlen_q` of query head `r // seqlen_q` in the group.
    Windows are `None` when unbounded; causal is `window_right = 0`.
    """

    scale: float
    seqlen_q: int
    seqlen_k: int
    group: int  # nheads // nheads_k: query heads folded into the rows of one kv head
    window_left: int | None
    window_right: int | None
    implementation: str
    block_q: int | None
    block_k: int | None
    interpret: bool

    @property
    def shift(self) -> int:
        """Column of query 0's diagonal: bottom-right alignment (docs/design.md section 1)."""
        return self.seqlen_k - self.seqlen_q

    @property
    def banded(self) -> bool:
        return self.window_left is not None or self.window_right is not None


def _check_array(name: str, x, rank: int = 4) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected a jax array, got {type(x).__name__}")
    if x.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank} (batch, seqlen, nheads, headdim), "
                         f"got shape {tuple(x.shape)}")
    if not any(x.dtype == d for d in FLOAT_DTYPES):
        raise TypeError(f"{name}: expected float16, bfloat16, float32 or float64, got {x.dtype}")


def check_inputs(q, k, v, *, causal, softmax_scale, window_size, implementation,
                 block_q, block_k, interpret) -> AttentionConfig:
    """Validate the public arguments (docs/design.md section 2) and build the static config."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, seqlen_q, nheads, headdim = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"k, v: batch must match q's {batch}, got {k.shape[0]} and {v.shape[0]}")
    if v.shape[1] != seqlen_k or v.shape[2] != nheads_k:
        raise ValueError(f"v: expected (batch, seqlen_k={seqlen_k}, nheads_k={nheads_k}, "
                         f"headdim_v), got {tuple(v.shape)}")
    if k.shape[3] != headdim:
        raise ValueError(f"k: headdim {k.shape[3]} != q's headdim {headdim}")
    if min(seqlen_q, seqlen_k, nheads_k) == 0 or batch == 0:
        raise ValueError(f"q, k: empty dimension in q {tuple(q.shape)} / k {tuple(k.shape)}")
    if nheads % nheads_k != 0:
        raise ValueError(f"k: nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")
    for name, d in (("q", headdim), ("v", v.shape[3])):
        if not 1 <= d <= MAX_HEADDIM:
            raise ValueError(f"{name}: headdim {d} outside the supported 1..{MAX_HEADDIM}")

    if softmax_scale is None:
        softmax_scale = headdim ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: expected a Python float, got {type(softmax_scale)}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale: expected a finite positive number, got {softmax_scale}")

    if len(window_size) != 2 or not all(isinstance(w, int) for w in window_size):
        raise TypeError(f"window_size: expected (left, right) ints, got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size: entries must be >= -1 (-1 = unbounded), got {window_size}")

    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation: expected one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    pallas = implementation.startswith("pallas")
    if pallas and not any(q.dtype == d for d in PALLAS_DTYPES):
        raise TypeError(f"q: implementation={implementation!r} takes float16, bfloat16 or "
                        f"float32, got {q.dtype}")
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b is not None and (not isinstance(b, int) or b < 1):
            raise ValueError(f"{name}: expected a positive int or None, got {b!r}")
        if b is not None and pallas and (b < 16 or b & (b - 1)):
            raise ValueError(f"{name}: the Pallas kernel needs a power of two >= 16, got {b}")

    return AttentionConfig(
        scale=float(softmax_scale), seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        group=nheads // nheads_k,
        window_left=None if left < 0 else left,
        window_right=0 if causal else (None if right < 0 else right),
        implementation=implementation, block_q=block_q, block_k=block_k,
        interpret=bool(interpret))
