"""flash-attn 2.8's public interface, run by flashkit's kernels.

The seven functions take flash-attn 2.8.4's arguments in its order and return what it returns;
flashkit's native API (flashkit.flash_attn_func, ...) does the work. Where flash-attn's contract
differs from the native one, this module follows flash-attn:

- `return_attn_probs=True` returns (out, softmax_lse, S_dmask) without materialising the
  attention matrix unless there is dropout: S_dmask is an empty tensor when dropout_p == 0, as
  flash-attn's. With dropout it is (batch, nheads, seqlen_q rounded up to 128, seqlen_k rounded
  up to 128) in q's dtype: entry (i, j) is exp(s_ij - m_i), m_i the largest visible score of
  row i, negated where dropout removed it (flash-attn's sign encoding); `_get_block_size_n`
  gives the block width over which m_i is taken (here the whole row), so flash-attn's test
  helpers recover the probabilities exactly.
- A query row that sees no key gets softmax_lse = +inf (flash-attn's convention; native: -inf).
- `window_size` may be a tuple, a list or a tensor of two ints.
- `flash_attn_varlen_func(..., block_table=...)` reads k and v from a paged cache (num_blocks,
  page_block_size, nheads_k, d): key t of sequence b is in page block_table[b, t //
  page_block_size]. The used keys are gathered into a packed tensor first (one copy of them).
- A paged cache too small for cache_seqlens (+ the new keys) raises RuntimeError naming
  block_table, checked on the host (one device sync, paged caches only, as flash-attn does).
"""

from __future__ import annotations

import math
import numbers

import torch

import flashkit
from flashkit.api import draw_dropout_seed

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]

# flash-attn's tests import this flag: there is no ROCm Triton path here.
USE_TRITON_ROCM = False


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """Attention on qkv (batch, seqlen, 3, nheads, headdim); gradients flow to qkv.

    Returns out (batch, seqlen, nheads, headdim), or (out, softmax_lse (batch, nheads,
    seqlen), S_dmask) with return_attn_probs (see the module docstring).
    """
    _packed("qkv", qkv, 3, 2)
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """Attention of q (batch, seqlen_q, nheads, headdim) over kv (batch, seqlen_k, 2, nheads_k,
    headdim); as flash_attn_func otherwise."""
    _packed("kv", kv, 2, 2)
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """Exact attention of q (batch, seqlen_q, nheads, headdim) over k, v (batch, seqlen_k,
    nheads_k, headdim), flash-attn 2.8's contract: causal and window_size bottom-right aligned,
    window_size (left, right) with -1 unbounded, GQA/MQA when nheads_k divides nheads, alibi
    slopes float32 (nheads,) or (batch, nheads), softcap > 0 caps the scores.

    Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse (batch, nheads,
    seqlen_q) float32, S_dmask) with return_attn_probs (see the module docstring).
    """
    window = _window(window_size)
    args = (dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, deterministic)
    if not return_attn_probs:
        return flashkit.flash_attn_func(q, k, v, *args)
    seed = _upcoming_dropout_seed() if _has_dropout(dropout_p) else None
    out, lse = flashkit.flash_attn_func(q, k, v, *args, return_softmax_lse=True)
    s_dmask = q.new_empty(0)
    if seed is not None:
        with torch.no_grad():
            *_, probs = flashkit.flash_attn_func(q, k, v, 0.0, *args[1:], return_attn_probs=True)
        keep = _keep_mask(seed, dropout_p, q.shape[0], q.shape[2], q.shape[1], k.shape[1], q)
        s_dmask = _encode_s_dmask([probs[b] for b in range(q.shape[0])], keep, q.shape[1],
                                  k.shape[1], q.dtype)
    return out, _flash_lse(lse), s_dmask


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """Varlen attention on qkv (total, 3, nheads, headdim) with one cu_seqlens (batch + 1,)
    int32 for queries and keys; as flash_attn_varlen_func otherwise."""
    _packed("qkv", qkv, 3, 1)
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """Varlen attention of q (total_q, nheads, headdim) over kv (total_k, 2, nheads_k,
    headdim); as flash_attn_varlen_func otherwise."""
    _packed("kv", kv, 2, 1)
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Attention over sequences packed without padding: q (total_q, nheads, headdim), k, v
    (total_k, nheads_k, headdim), sequence b at rows cu_seqlens[b]:cu_seqlens[b + 1] (int32,
    batch + 1). With block_table (batch, max_blocks) int32, k and v are a paged cache
    (num_blocks, page_block_size, nheads_k, headdim) and cu_seqlens_k gives each sequence's key
    count (see the module docstring).

    Returns out (total_q, nheads, headdim), or (out, softmax_lse (nheads, total_q) float32,
    S_dmask (batch, nheads, max_seqlen_q rounded, max_seqlen_k rounded)) with
    return_attn_probs.
    """
    if block_table is not None:
        k, v, cu_seqlens_k = _gather_pages(k, v, cu_seqlens_k, None, block_table)
    window = _window(window_size)
    fixed = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    args = (dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, deterministic)
    if not return_attn_probs:
        return flashkit.flash_attn_varlen_func(*fixed, *args)
    seed = _upcoming_dropout_seed() if _has_dropout(dropout_p) else None
    out, lse = flashkit.flash_attn_varlen_func(*fixed, *args, return_softmax_lse=True)
    s_dmask = q.new_empty(0)
    if seed is not None:
        with torch.no_grad():
            *_, probs = flashkit.flash_attn_varlen_func(*fixed, 0.0, *args[1:],
                                                        return_attn_probs=True)
        keep = _keep_mask(seed, dropout_p, len(probs), q.shape[1], max_seqlen_q, max_seqlen_k, q)
        s_dmask = _encode_s_dmask(probs, keep, max_seqlen_q, max_seqlen_k, q.dtype)
    return out, _flash_lse(lse), s_dmask


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """Attention of q (batch, seqlen_q, nheads, headdim) over a KV cache, appending k, v
    (batch, seqlen_new, nheads_k, headdim) at slots cache_seqlens.. first (in place), with
    flash-attn 2.8's contract: rotary_cos/sin (seqlen_ro, rotary_dim / 2) rotate the new keys
    at their slots cache_seqlens + i and q at cache_seqlens + i (causal or local) or all at
    cache_seqlens; paged caches (num_blocks, page_block_size, nheads_k, headdim) through
    block_table (batch, max_blocks) int32. Forward only.

    Returns out (batch, seqlen_q, nheads, headdim), and softmax_lse (batch, nheads, seqlen_q)
    with return_softmax_lse.
    """
    if block_table is not None:
        _check_paged_capacity(block_table, k_cache, cache_seqlens, k)
    result = flashkit.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale, causal, _window(window_size), softcap,
        rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse)
    if not return_softmax_lse:
        return result
    out, lse = result
    return out, _flash_lse(lse)


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p, softmax_scale, causal, window_size_left=-1,
                               window_size_right=-1, softcap=0.0, alibi_slopes=None,
                               return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0):
    """flash-attn's low-level varlen forward, for code that calls it directly: returns (out,
    softmax_lse, S_dmask, rng_state). seqused_k (batch,) int32: sequence b uses only its first
    seqused_k[b] keys. num_splits > 1 is refused with a paged cache, as in flash-attn (the
    split count is the kernels' own choice here)."""
    if block_table is not None and num_splits > 1:
        raise RuntimeError("num_splits > 1 is not supported for varlen paged KV")
    if leftpad_k is not None:
        raise NotImplementedError("leftpad_k: not supported by this varlen forward; use "
                                  "flash_attn_with_kvcache(cache_leftpad=...)")
    if seqused_k is not None or block_table is not None:
        k, v, cu_seqlens_k = _gather_pages(k, v, cu_seqlens_k, seqused_k, block_table)
    result = flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, (window_size_left, window_size_right), softcap, alibi_slopes,
        return_attn_probs=True)
    out, lse, s_dmask = result
    rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
    return out, lse, s_dmask if return_softmax else q.new_empty(0), rng_state


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key-block width over which S_dmask's row maximum m_i is taken: the whole row here
    (flash-attn's kernels use their tile width), so any width at least seqlen_k decodes it."""
    return 2**31 - 1


def _packed(name: str, t, parts: int, dim: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() <= dim or t.shape[dim] != parts:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected dim {dim} of size {parts}, got {got}")


def _window(window_size) -> tuple[int, int]:
    """flash-attn accepts (left, right) as a tuple, a list or a tensor of two ints."""
    if isinstance(window_size, torch.Tensor):
        if window_size.numel() != 2 or window_size.is_floating_point():
            raise ValueError(f"window_size: expected two ints (left, right), got a tensor of "
                             f"shape {tuple(window_size.shape)} and dtype {window_size.dtype}")
        window_size = window_size.tolist()
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, (numbers.Integral, torch.Tensor)) for w in window_size)):
        raise ValueError(f"window_size: expected (left, right) ints, got {window_size!r}")
    return tuple(int(w) for w in window_size)


def _has_dropout(dropout_p) -> bool:
    return isinstance(dropout_p, numbers.Real) and dropout_p > 0


def _upcoming_dropout_seed() -> int:
    """The seed the next native call will draw (from torch's CPU generator), without drawing
    it: the keep-mask of S_dmask is rebuilt from it."""
    with torch.random.fork_rng(devices=[]):
        return draw_dropout_seed()


def _keep_mask(seed, dropout_p, batch, nheads, seqlen_q, seqlen_k, q):
    """The keep-mask (batch, nheads, seqlen_q, seqlen_k) bool the native call used."""
    from flashkit import testing

    backend = "triton" if q.device.type == "cuda" else "torch"
    keep = testing.dropout_keep_mask(seed, batch, nheads, seqlen_q, seqlen_k, float(dropout_p),
                                     backend=backend, device=q.device)
    return keep.to(q.device, torch.bool)


def _encode_s_dmask(probs, keep, seqlen_q, seqlen_k, dtype):
    """flash-attn's S_dmask from the pre-dropout probabilities (one (nheads, sq_b, sk_b) per
    sequence): exp(s - m) = P / max_j P per row, negated where dropped, zero-padded to
    (batch, nheads, round128(seqlen_q), round128(seqlen_k))."""
    rounded = (-(-seqlen_q // 128) * 128, -(-seqlen_k // 128) * 128)
    batch, nheads = len(probs), probs[0].shape[0]
    out = torch.zeros(batch, nheads, *rounded, dtype=dtype, device=keep.device)
    for b, p in enumerate(probs):
        sq, sk = p.shape[-2:]
        row_max = p.amax(-1, keepdim=True) if sk > 0 else p.new_ones(*p.shape[:-1], 1)
        scaled = torch.where(row_max > 0, p / row_max.clamp_min(torch.finfo(p.dtype).tiny), 0.0)
        out[b, :, :sq, :sk] = torch.where(keep[b, :, :sq, :sk], scaled, -scaled).to(dtype)
    return out


def _flash_lse(lse: torch.Tensor) -> torch.Tensor:
    """flash-attn's lse for a row that sees no key is +inf (the native API gives -inf)."""
    return torch.where(lse == -math.inf, torch.full_like(lse, math.inf), lse)


def _check_paged_capacity(block_table, k_cache, cache_seqlens, k) -> None:
    """flash-attn's host check: max(cache_seqlens) + seqlen_new must fit the pages the block
    table can address, else RuntimeError (one device sync, paged caches only)."""
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        return  # the native checks name the malformed argument
    capacity = block_table.shape[1] * k_cache.shape[1]
    seqlen_new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        return
    longest = (int(cache_seqlens) if isinstance(cache_seqlens, numbers.Integral)
               else int(cache_seqlens.max()))
    if longest + seqlen_new > capacity:
        raise RuntimeError(
            f"Paged KV cache: max(cache_seqlens) + seqlen_new (= {longest + seqlen_new}) exceeds "
            f"the capacity addressable by block_table (max_num_blocks_per_seq * page_block_size "
            f"= {capacity}); allocate more columns in block_table")


def _gather_pages(k, v, cu_seqlens_k, seqused_k, block_table):
    """Packed (total_k, nheads_k, d) keys and values and their cu_seqlens_k: sequence b's first
    seqused_k[b] keys (default: all cu_seqlens_k[b + 1] - cu_seqlens_k[b]), read from the packed
    k, v or, with block_table, from the paged cache (num_blocks, page_block_size, nheads_k, d)."""
    for name, t in (("cu_seqlens_k", cu_seqlens_k), ("seqused_k", seqused_k),
                    ("block_table", block_table)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.int32):
            raise TypeError(f"{name}: expected a torch.int32 tensor")
    lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1] if seqused_k is None else seqused_k
    lengths = lengths.long()
    batch, device = lengths.shape[0], k.device
    total = int(lengths.sum())
    seq = torch.repeat_interleave(torch.arange(batch, device=device), lengths,
                                  output_size=total)
    starts = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(total, device=device) - starts[seq]  # key index within its sequence
    if block_table is None:
        rows = cu_seqlens_k.long()[seq] + pos
        k_flat, v_flat = k, v
    else:
        page_size, num_blocks = k.shape[1], k.shape[0]
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table: expected shape ({batch}, max_num_blocks_per_seq), "
                             f"got {tuple(block_table.shape)}")
        capacity = block_table.shape[1] * page_size
        longest = int(lengths.max()) if batch else 0
        if longest > capacity:
            raise RuntimeError(f"Paged KV: a sequence of {longest} keys exceeds the capacity "
                               f"addressable by block_table ({capacity})")
        pages = block_table.long()[seq, pos // page_size]
        if total and (int(pages.min()) < 0 or int(pages.max()) >= num_blocks):
            raise RuntimeError(f"block_table: entries of used pages must be in [0, "
                               f"{num_blocks}) (the cache's num_blocks)")
        rows = pages * page_size + pos % page_size
        k_flat, v_flat = k.flatten(0, 1), v.flatten(0, 1)
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
    return k_flat[rows], v_flat[rows], cu
