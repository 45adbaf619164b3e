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


def varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               sync_checks: bool = False, triton: bool = True) -> int:
    """Packed q (total_q, nheads, d), k/v (total_k, nheads_k, d[_v]) with valid cu_seqlens;
    returns the number of sequences. cu_seqlens' values: see varlen_values."""
    tensor("q", q, "(total_q, nheads, headdim)")
    tensor("k", k, "(total_k, nheads_k, headdim)")
    tensor("v", v, "(total_k, nheads_k, headdim_v)")
    same_dtype_and_device({"q": q, "k": k, "v": v})
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v: {v.shape[0]} tokens differ from k's {k.shape[0]}")
    heads(q.shape[1], k.shape[1], k, v, dim=1)
    head_dims(q, k, v)
    batch = cu_seqlens("cu_seqlens_q", cu_seqlens_q, max_seqlen_q, "max_seqlen_q", q.device)
    batch_k = cu_seqlens("cu_seqlens_k", cu_seqlens_k, max_seqlen_k, "max_seqlen_k", q.device)
    if batch_k != batch:
        raise ValueError(f"cu_seqlens_k: describes {batch_k} sequences, cu_seqlens_q {batch}")
    varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sync_checks,
                  triton)
    return batch


def varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  sync_checks: bool = False, triton: bool = True) -> None:
    """The values of both cu_seqlens (their layouts checked by cu_seqlens): in one Triton
    launch on the device for an eager CUDA call on the current device (ops.triton.cu_check),
    else each through cu_seqlens_values. triton=False: never through the Triton check, for
    calls whose backend launches no Triton kernel."""
    checker = _device_checker(q) if q.is_cuda and triton and not sync_checks else None
    if checker is not None:
        checker(cu_seqlens_q, q.shape[0], max_seqlen_q, cu_seqlens_k, k.shape[0], max_seqlen_k)
        return
    cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q",
                      sync_checks)
    cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k",
                      sync_checks)


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
            or not all(type(w) is int or isinstance(w, numbers.Integral) for w in window)):
        raise ValueError(f"window_size: expected a pair of ints (left, right), got {window!r}")
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"window_size: entries must be >= -1 (-1 = unbounded), got {window!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    return (None if left == -1 else int(left)), 0 if causal else (
        None if right == -1 else int(right))


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


def cu_seqlens(name: str, cu, max_seqlen, max_name: str, device) -> int:
    """A 1-D int32 tensor of batch + 1 >= 2 entries on `device`, with max_seqlen an int
    (trusted as a bound, as flash-attn does, and checked with the values: cu_seqlens_values);
    returns the batch size it describes."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1:
        got = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else \
            type(cu).__name__
        raise TypeError(f"{name}: expected a 1-D torch.int32 tensor (batch + 1,), got {got}")
    if cu.numel() < 2:
        raise ValueError(f"{name}: expected batch + 1 >= 2 entries, got {cu.numel()}")
    if cu.device != device:
        raise ValueError(f"{name}: device {cu.device} differs from q's {device}")
    if not isinstance(max_seqlen, numbers.Integral) or isinstance(max_seqlen, bool):
        raise TypeError(f"{max_name}: expected an int, got {max_seqlen!r}")
    return cu.numel() - 1


def cu_seqlens_values(name: str, cu, total: int, max_seqlen: int, max_name: str,
                      sync_checks: bool = False) -> None:
    """cu's values: 0 first, non-decreasing, last entry = total, no length above max_seqlen.

    Read on the host, raising a ValueError, when cu is on the CPU or with sync_checks (a device
    sync); on a GPU (and under torch.compile, which cannot trace a host read) they are
    otherwise checked on the device without a sync: a bad value fails a device-side assertion
    queued before any kernel that reads it, so nothing reads or writes out of bounds (the error
    then surfaces at the next synchronising call, and it ends the CUDA context). varlen_values
    checks both tensors in one Triton launch instead where it can (ops.triton.cu_check)."""
    if (cu.is_cuda or torch.compiler.is_compiling()) and not sync_checks:
        lengths = cu.diff()
        valid = ((cu[0] == 0) & (cu[-1] == total) & (lengths.min() >= 0)
                 & (lengths.max() <= max_seqlen))
        torch._assert_async(valid, f"{name}: expected 0 first, non-decreasing entries, last "
                            f"entry {total} (total tokens) and no length above {max_name} "
                            f"{max_seqlen}; pass sync_checks=True to learn which")
        return
    values = cu.tolist()
    lengths = [b - a for a, b in zip(values, values[1:], strict=False)]
    if values[0] != 0 or min(lengths) < 0:
        raise ValueError(f"{name}: expected 0 first and non-decreasing entries, got {values}")
    if values[-1] != total:
        raise ValueError(f"{name}: last entry {values[-1]} != total tokens {total}")
    if max_seqlen < max(lengths):
        raise ValueError(f"{max_name}: expected an int >= the longest sequence "
                         f"({max(lengths)}), got {max_seqlen!r}")


# device index -> ops.triton.cu_check.check_cu_seqlens, or None where Triton cannot check there
# (not installed, or a GPU older than sm_80): looked up once per device.
_DEVICE_CHECKERS: dict = {}


def _device_checker(q):
    """The one-launch check of both cu_seqlens for an eager CUDA call with q on the current
    device, or None (then each tensor's values are checked by cu_seqlens_values)."""
    if torch.compiler.is_compiling():  # the torch ops, which it traces
        return None
    index = q.get_device()
    if index != torch.cuda.current_device():
        return None
    if index not in _DEVICE_CHECKERS:
        checker = None
        if torch.cuda.get_device_capability(index) >= (8, 0):
            try:
                from flashkit.ops.triton.cu_check import check_cu_seqlens as checker
            except ImportError:
                pass
        _DEVICE_CHECKERS[index] = checker
    return _DEVICE_CHECKERS[index]


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

# --- flash_attn_with_kvcache ------------------------------------------------------------------

MIN_PAGE_SIZE = 16  # paged caches: the smallest page_size (the kernels look pages up per key)


def kvcache_tensors(q, k_cache, v_cache, k, v) -> None:
    """Ranks, dtypes, devices and shapes of flash_attn_with_kvcache's tensors; none requires
    grad (there is no backward)."""
    tensor("q", q, "(batch, seqlen_q, nheads, headdim)")
    tensor("k_cache", k_cache, "(batch_cache | num_blocks, seqlen_cache | page_size, "
           "nheads_k, headdim)")
    tensor("v_cache", v_cache, "(batch_cache | num_blocks, seqlen_cache | page_size, "
           "nheads_k, headdim_v)")
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both new keys and new values, or neither")
    if k is not None:
        tensor("k", k, "(batch, seqlen_new, nheads_k, headdim)")
        tensor("v", v, "(batch, seqlen_new, nheads_k, headdim_v)")
        named.update(k=k, v=v)
    same_dtype_and_device(named)
    kvcache_no_grad(named)
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache's "
                         f"{tuple(k_cache.shape)} in the first three dims")
    heads(q.shape[2], k_cache.shape[2], k_cache, v_cache, dim=2)
    head_dims(q, k_cache, v_cache)
    if k is not None:
        batch, seqlen_new = q.shape[0], k.shape[1]
        for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
            expected = (batch, seqlen_new, *cache.shape[2:])
            if tuple(t.shape) != expected:
                raise ValueError(f"{name}: expected shape {expected} (batch, seqlen_new, "
                                 f"nheads_k, headdim), got {tuple(t.shape)}")


def kvcache_no_grad(named: dict) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in named.values()):
        raise NotImplementedError(
            "flash_attn_with_kvcache: there is no backward pass (as in flash-attn); call it "
            "under torch.no_grad() or pass tensors that do not require grad")


def paging(block_table, k_cache, batch, device, cache_batch_idx, cache_leftpad) -> int:
    """Validate the block table's layout; returns the capacity of one sequence in slots."""
    if block_table is None:
        return k_cache.shape[1]
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 \
            or block_table.dim() != 2:
        got = (f"{block_table.dtype} of shape {tuple(block_table.shape)}"
               if isinstance(block_table, torch.Tensor) else type(block_table).__name__)
        raise TypeError(f"block_table: expected a 2-D torch.int32 tensor (batch, "
                        f"max_blocks_per_seq), got {got}")
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table: {block_table.shape[0]} rows differ from q's batch "
                         f"{batch}")
    if block_table.device != device:
        raise ValueError(f"block_table: device {block_table.device} differs from q's {device}")
    page_size = k_cache.shape[1]
    if page_size < MIN_PAGE_SIZE:
        raise ValueError(f"k_cache: page_size (dim 1 of a paged cache) must be at least "
                         f"{MIN_PAGE_SIZE}, got {page_size}")
    if cache_batch_idx is not None:
        raise ValueError("cache_batch_idx: not supported with a paged cache (block_table "
                         "already maps each sequence to its pages)")
    if cache_leftpad is not None:
        raise ValueError("cache_leftpad: not supported with a paged cache")
    return block_table.shape[1] * page_size


def index_vector(name, t, batch, device):
    """An int32 (batch,) tensor on q's device, or None."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (batch,):
        got = (f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
               else type(t).__name__)
        raise TypeError(f"{name}: expected a torch.int32 tensor of shape ({batch},), got {got}")
    if t.device != device:
        raise ValueError(f"{name}: device {t.device} differs from q's {device}")
    return t


def host_seqlen(cache_seqlens, seqlen_new, capacity) -> int | None:
    """An int cache_seqlens (None: the whole capacity), checked against the capacity here; None
    for a tensor (checked where its values are read)."""
    if cache_seqlens is None:
        return capacity
    if not isinstance(cache_seqlens, numbers.Integral) or isinstance(cache_seqlens, bool):
        return None
    n = int(cache_seqlens)
    if not 0 <= n <= capacity - seqlen_new:
        raise ValueError(f"cache_seqlens: {n} tokens and {seqlen_new} appended must fit the "
                         f"cache's capacity of {capacity} slots per sequence (and be >= 0)")
    return n


def kvcache_values(cache_seqlens, seqlen_new, capacity, cache_batch_idx, cache_leftpad,
                  block_table, k_cache, seqlen_ro, q_rows) -> int:
    """Index values in range, read on the host (a device sync for CUDA tensors): nothing reads
    or writes outside the cache. Only the block_table entries of pages a sequence uses are read,
    so the rest may be padding. seqlen_ro: the rotary table's length, None without rotary.
    Returns the longest sequence's key count (the split heuristic's max_seqlen_k)."""
    num_blocks = batch_cache = k_cache.shape[0]
    page_size = k_cache.shape[1]
    seqlens = cache_seqlens.tolist()
    if not seqlens:  # batch 0
        return 0
    rows = list(range(len(seqlens))) if cache_batch_idx is None else cache_batch_idx.tolist()
    leftpad = [0] * len(seqlens) if cache_leftpad is None else cache_leftpad.tolist()
    if min(seqlens) < 0:
        raise ValueError(f"cache_seqlens: entries must be >= 0, got {seqlens}")
    if max(seqlens) + seqlen_new > capacity:
        worst = max(range(len(seqlens)), key=seqlens.__getitem__)
        raise ValueError(f"cache_seqlens: sequence {worst} holds {seqlens[worst]} tokens and "
                         f"appends {seqlen_new}, beyond the cache's capacity of {capacity} "
                         "slots per sequence")
    if block_table is None and rows and not all(0 <= r < batch_cache for r in rows):
        raise ValueError(f"cache_batch_idx: entries must be in [0, {batch_cache}) (k_cache's "
                         f"batch_cache), got {rows}")
    bad = [b for b, (p, n) in enumerate(zip(leftpad, seqlens, strict=True)) if not 0 <= p <= n]
    if bad:
        raise ValueError(f"cache_leftpad: entries must be in [0, cache_seqlens]; sequence "
                         f"{bad[0]} has {leftpad[bad[0]]} > {seqlens[bad[0]]}")
    positions = [n - p for n, p in zip(seqlens, leftpad, strict=True)]
    if seqlen_ro is not None and max(seqlens) + max(seqlen_new, q_rows) > seqlen_ro:
        raise ValueError(f"rotary_cos: {seqlen_ro} positions (seqlen_ro), but positions up to "
                         f"{max(seqlens) + max(seqlen_new, q_rows) - 1} are rotated")
    if block_table is not None:
        table = block_table.tolist()
        used = [table[b][:-(-(n + seqlen_new) // page_size)] for b, n in enumerate(seqlens)]
        for b, pages in enumerate(used):
            if not all(0 <= page < num_blocks for page in pages):
                raise ValueError(f"block_table: sequence {b} uses pages {pages}; every entry "
                                 f"must be in [0, {num_blocks}) (k_cache's num_blocks)")
        if seqlen_new:
            _written_pages(used, seqlens, seqlen_new, page_size)
    return max(positions) + seqlen_new


def _written_pages(used, seqlens, seqlen_new, page_size) -> None:
    """A page the append writes belongs to one sequence, once: shared pages (a common prefix)
    may be read by many sequences, but a write into one would change what the others read,
    and two writes to one slot race. used[b]: the pages sequence b reads."""
    owners = {}
    for b, pages in enumerate(used):
        for page in set(pages):
            owners.setdefault(page, []).append(b)
    for b, (pages, n) in enumerate(zip(used, seqlens, strict=True)):
        written = pages[n // page_size:]
        for page in written:
            if len(owners[page]) > 1 or pages.count(page) > 1:
                others = [o for o in owners[page] if o != b] or [b]
                raise ValueError(f"block_table: sequence {b} appends into page {page}, which "
                                 f"sequence {others[0]} also uses; a page written by an "
                                 "append must appear once in the used entries")


def rotary(cos, sin, q, k) -> None:
    """cos/sin (seqlen_ro, rotary_dim / 2) on q's device, k, v given (their length: in
    _check_values or on the device)."""
    if cos is None or sin is None:
        raise ValueError("rotary_cos, rotary_sin: pass both or neither")
    if k is None:
        raise ValueError("rotary_cos: the rotary embedding applies to new keys; pass k and v "
                         "too (flash-attn's rule)")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        tensor(name, t, "(seqlen_ro, rotary_dim / 2)")
        if not t.is_floating_point() or t.device != q.device:
            raise TypeError(f"{name}: expected a floating tensor on {q.device}, got {t.dtype} "
                            f"on {t.device}")
    if sin.shape != cos.shape:
        raise ValueError(f"rotary_sin: shape {tuple(sin.shape)} differs from rotary_cos's "
                         f"{tuple(cos.shape)}")
    if not 1 <= 2 * cos.shape[1] <= q.shape[-1]:
        raise ValueError(f"rotary_cos: rotary_dim = 2 * {cos.shape[1]} must be in 2..headdim "
                         f"({q.shape[-1]})")


def num_splits(num_splits) -> int:
    if not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool) \
            or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 = automatic), got {num_splits!r}")
    return int(num_splits)
