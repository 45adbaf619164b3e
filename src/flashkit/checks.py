"""Input checks shared by the public entry points. Each error names the argument and what was
expected, and every check runs before any kernel launch."""

from __future__ import annotations

import math
import numbers
import warnings

import torch

MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # flash_attn_func only: forward, bf16 out
BACKEND_NAMES = ("torch", "triton", "reference")


def tensor(name: str, t, layout: str) -> None:
    """t is a tensor whose rank matches `layout`, e.g. "(batch, seqlen_q, nheads, headdim)"."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {layout}, got {type(t).__name__}")
    ndim = layout.count(",") + 1
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims {layout}, got shape {tuple(t.shape)}")


def no_overlap(name: str, t: torch.Tensor) -> None:
    """t, about to be written in place, gives every element its own memory: no stride 0 of an
    expanded tensor, no strides that fold one dim onto another. (The dims sorted by stride
    must each step past everything the smaller ones span; layouts that interleave dims without
    overlapping fail this too, and none of them is a cache layout.)"""
    span = 0  # elements covered by the dims already seen, minus one
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True)
                               if sz > 1):
        if stride <= span:
            raise ValueError(f"{name}: is written in place but its elements overlap in memory "
                             f"(shape {tuple(t.shape)}, strides {t.stride()}, e.g. an expanded "
                             "tensor); pass a tensor with its own storage (.contiguous())")
        span += (size - 1) * stride


def distinct(names: tuple[str, str], a: torch.Tensor, b: torch.Tensor) -> None:
    """a and b, both written in place, do not start at one address (the same tensor twice).
    Interleaved views of one buffer (k and v halves of a packed cache) stay allowed."""
    if a.numel() and b.numel() and a.data_ptr() == b.data_ptr():
        raise ValueError(f"{names[1]}: is the same memory as {names[0]}, and both are written "
                         "in place; pass separate tensors")


def same_dtype_and_device(named: dict, dtypes=DTYPES) -> None:
    """All tensors share one supported floating dtype and one device."""
    (first, t0), *rest = named.items()
    if t0.dtype not in dtypes:
        raise TypeError(f"{first}: dtype {t0.dtype} is not supported; expected one of "
                        f"{', '.join(str(d) for d in dtypes)}")
    for name, t in rest:
        if t.dtype != t0.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from {first}'s {t0.dtype}")
        if t.device != t0.device:
            raise ValueError(f"{name}: device {t.device} differs from {first}'s {t0.device}")


def dense_qkv(q, k, v, dtypes=DTYPES) -> None:
    """q (batch, seqlen_q, nheads, d), k/v (batch, seqlen_k, nheads_k, d[_v]) that fit together."""
    tensor("q", q, "(batch, seqlen_q, nheads, headdim)")
    tensor("k", k, "(batch, seqlen_k, nheads_k, headdim)")
    tensor("v", v, "(batch, seqlen_k, nheads_k, headdim_v)")
    same_dtype_and_device({"q": q, "k": k, "v": v}, dtypes)
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name}: batch {t.shape[0]} differs from q's {q.shape[0]}")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"v: seqlen {v.shape[1]} differs from k's {k.shape[1]}")
    heads(q.shape[2], k.shape[2], k, v, dim=2)
    head_dims(q, k, v)


def varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> int:
    """Packed q (total_q, nheads, d), k/v (total_k, nheads_k, d[_v]) with valid cu_seqlens;
    returns the number of sequences."""
    tensor("q", q, "(total_q, nheads, headdim)")
    tensor("k", k, "(total_k, nheads_k, headdim)")
    tensor("v", v, "(total_k, nheads_k, headdim_v)")
    same_dtype_and_device({"q": q, "k": k, "v": v})
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v: {v.shape[0]} tokens differ from k's {k.shape[0]}")
    heads(q.shape[1], k.shape[1], k, v, dim=1)
    head_dims(q, k, v)
    batch = cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q",
                       q.device)
    if cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k",
                  q.device) != batch:
        raise ValueError(f"cu_seqlens_k: describes {cu_seqlens_k.numel() - 1} sequences, "
                         f"cu_seqlens_q {batch}")
    return batch


def head_dims(q, k, v, dim: int = -1, names=("q", "k", "v")) -> None:
    """q and k share a head dim; both head dims are within 1..MAX_HEAD_DIM."""
    if k.shape[dim] != q.shape[dim]:
        raise ValueError(f"{names[1]}: head dim {k.shape[dim]} differs from {names[0]}'s "
                         f"{q.shape[dim]}")
    for name, t in ((names[0], q), (names[2], v)):
        if not 1 <= t.shape[dim] <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: head dim {t.shape[dim]} is outside 1..{MAX_HEAD_DIM}")


def heads(nheads: int, nheads_k: int, k, v, dim: int, names=("q", "k", "v")) -> None:
    """k and v have the same kv heads, and they divide the query heads (GQA/MQA)."""
    if v.shape[dim] != nheads_k:
        raise ValueError(f"{names[2]}: {v.shape[dim]} heads differ from {names[1]}'s {nheads_k}")
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"{names[1]}: nheads_k = {nheads_k} must divide {names[0]}'s nheads = "
                         f"{nheads} (GQA/MQA groups query heads over kv heads)")


# Scores are formed in float32 (scale * log2(e) * q . k in the kernels). Up to this scale
# they stay finite for every fp16 input (|q . k| <= 256 * 65504^2 ~ 1.1e12) and for any
# |q . k| < 2^63, so the softmax never sees inf - inf; far above it (1e38) ordinary scores
# overflow to inf and the row becomes NaN where the float64 math is finite.
MAX_SOFTMAX_SCALE = 2.0 ** 64


def softmax_scale(scale, head_dim: int, name: str = "softmax_scale") -> float:
    if scale is None:
        return head_dim ** -0.5
    # Comparisons, not math.isfinite: under torch.compile(dynamic=True) the scale can be a
    # symbolic float, which compares (and is guarded on) but has no isfinite. NaN fails both.
    if not isinstance(scale, numbers.Real) or not 0 < scale <= MAX_SOFTMAX_SCALE:
        raise ValueError(f"{name}: expected a finite positive number at most 2**64 (scores "
                         f"are formed in float32), got {scale!r}")
    return float(scale)


def dropout_p(p) -> float:
    if not isinstance(p, numbers.Real) or not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: expected a number in [0, 1), got {p!r}")
    return float(p)


def softcap(cap) -> float:
    if not isinstance(cap, numbers.Real) or not 0 <= cap < math.inf:  # see softmax_scale
        raise ValueError(f"softcap: expected a finite number >= 0 (0 = off), got {cap!r}")
    return float(cap)


def window_size(window, causal) -> tuple[int | None, int | None]:
    """flash-attn's (left, right), -1 = unbounded -> the backends' pair, None = unbounded."""
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, numbers.Integral) for w in window)):
        raise ValueError(f"window_size: expected a pair of ints (left, right), got {window!r}")
    if min(window) < -1:
        raise ValueError(f"window_size: entries must be >= -1 (-1 = unbounded), got {window!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    left, right = (None if w == -1 else int(w) for w in window)
    return left, 0 if causal else right


def alibi_slopes(slopes, batch: int, nheads: int, device) -> None:
    if slopes is None:
        return
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes: expected a float32 tensor, got {type(slopes).__name__}")
    if slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes: expected dtype torch.float32, got {slopes.dtype}")
    if tuple(slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes: expected shape ({nheads},) or ({batch}, {nheads}), "
                         f"got {tuple(slopes.shape)}")
    if slopes.device != device:
        raise ValueError(f"alibi_slopes: device {slopes.device} differs from q's {device}")


def sink(s, nheads: int, device) -> None:
    if s is None:
        return
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"sink: expected a floating tensor of shape ({nheads},), "
                        f"got {type(s).__name__}")
    if s.dtype not in DTYPES:
        raise TypeError(f"sink: expected a floating dtype, got {s.dtype}")
    if tuple(s.shape) != (nheads,):
        raise ValueError(f"sink: expected shape ({nheads},) (one logit per query head), "
                         f"got {tuple(s.shape)}")
    if s.device != device:
        raise ValueError(f"sink: device {s.device} differs from q's {device}")


def cu_seqlens(name: str, cu, total: int, max_seqlen, max_name: str, device) -> int:
    """A valid int32 prefix sum of sequence lengths; returns the batch size it describes.

    Reading the values costs a device sync; a malformed cu_seqlens would make a kernel read or
    write out of bounds, so it is worth one.
    """
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1:
        got = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else \
            type(cu).__name__
        raise TypeError(f"{name}: expected a 1-D torch.int32 tensor (batch + 1,), got {got}")
    if cu.numel() < 2:
        raise ValueError(f"{name}: expected batch + 1 >= 2 entries, got {cu.numel()}")
    if cu.device != device:
        raise ValueError(f"{name}: device {cu.device} differs from q's {device}")
    values = cu.tolist()
    lengths = [b - a for a, b in zip(values, values[1:], strict=False)]
    if values[0] != 0 or min(lengths) < 0:
        raise ValueError(f"{name}: expected 0 first and non-decreasing entries, got {values}")
    if values[-1] != total:
        raise ValueError(f"{name}: last entry {values[-1]} != total tokens {total}")
    if not isinstance(max_seqlen, numbers.Integral) or max_seqlen < max(lengths):
        raise ValueError(f"{max_name}: expected an int >= the longest sequence "
                         f"({max(lengths)}), got {max_seqlen!r}")
    return len(values) - 1


def warn_if_sdpa_layout(q, k) -> None:
    """Warn when (batch, seqlen, nheads, d) inputs look like SDPA's (batch, nheads, seqlen, d):
    both q and k with fewer positions than heads, and at least 128 query heads (few models have
    that many, and those attend over more keys than heads). Shape comparisons only; skipped
    while torch.compile traces."""
    if torch.compiler.is_compiling():
        return
    (seqlen_q, nheads), (seqlen_k, nheads_k) = q.shape[1:3], k.shape[1:3]
    if seqlen_q < nheads and seqlen_k < nheads_k and nheads >= 128:
        warnings.warn(
            f"q: {nheads} heads of {seqlen_q} positions, k: {nheads_k} heads of {seqlen_k}. "
            "flash_attn_func takes (batch, seqlen, nheads, headdim); tensors in PyTorch SDPA's "
            "(batch, nheads, seqlen, headdim) layout need .transpose(1, 2), or call "
            "flashkit.scaled_dot_product_attention", UserWarning, stacklevel=3)


def descales(q, k, **named) -> bool:
    """Whether q is float8; the descales (q_descale, k_descale, v_descale as keywords) are then
    each None or a float32 tensor of shape (1,) or (batch, nheads_k) (q_descale also (batch,
    nheads)) on q's device, and must be None for other dtypes."""
    float8 = q.dtype in FLOAT8_DTYPES
    batch, nheads, nheads_k = q.shape[0], q.shape[2], k.shape[2]
    for name, d in named.items():
        if d is None:
            continue
        if not float8:
            raise ValueError(f"{name}: descale factors apply to float8 inputs only, q is "
                             f"{q.dtype}")
        shapes = {(1,), (batch, nheads_k)} | ({(batch, nheads)} if name == "q_descale" else set())
        if not isinstance(d, torch.Tensor) or d.dtype != torch.float32:
            got = d.dtype if isinstance(d, torch.Tensor) else type(d).__name__
            raise TypeError(f"{name}: expected a float32 tensor, got {got}")
        if tuple(d.shape) not in shapes:
            raise ValueError(f"{name}: expected shape {' or '.join(map(str, sorted(shapes)))}, "
                             f"got {tuple(d.shape)}")
        if d.device != q.device:
            raise ValueError(f"{name}: device {d.device} differs from q's {q.device}")
    return float8


def backend(name, device) -> str:
    """The backend to run: None picks "triton" for CUDA tensors and "torch" otherwise."""
    if name is None:
        return "triton" if device.type == "cuda" else "torch"
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend: expected None or one of {BACKEND_NAMES}, got {name!r}")
    return name
