"""Prefill over a KV cache through the Gluon forward (sm_90): host side.

A long prefill (many query rows over a long cache) reads the cache as varlen keys with seqused_k
(contiguous) or through its block table (paged, power-of-two pages) in the Gluon forward
instead of the decode kernels. `declines` gives the thresholds' verdict, `as_varlen` the packed
view, `forward` the launch; flashkit.ops.triton.dispatch chooses.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from flashkit.ops.params import AttentionParams
from flashkit.ops.triton.configs.decode import GLUON_PREFILL_MIN_QUERIES, GLUON_PREFILL_MIN_WORK
from flashkit.ops.triton.launch import planned

__all__ = ["declines", "as_varlen", "forward", "tile", "GLUON_PREFILL_MIN_QUERIES",
           "GLUON_PREFILL_MIN_WORK"]


def declines(q, k_cache, block_table, keys_bound: int) -> str | None:
    """Why a prefill of q (batch, seqlen_q, h, d) over this cache stays on the decode kernels,
    or None (then `as_varlen` and forward_hopper.declines decide). keys_bound: the key count
    (an int cache_seqlens) or the capacity, for the work threshold."""
    batch, seqlen_q, nheads, _ = q.shape
    if not q.is_cuda:
        return "not a CUDA tensor"
    if seqlen_q < GLUON_PREFILL_MIN_QUERIES:
        return f"{seqlen_q} query rows < {GLUON_PREFILL_MIN_QUERIES}"
    if batch * nheads * seqlen_q * keys_bound < GLUON_PREFILL_MIN_WORK:
        return "too little work"
    slots = k_cache.shape[1]  # the capacity, or page_size
    if block_table is not None and slots & (slots - 1):
        return f"page_size {slots} is not a power of two"
    return None


def as_varlen(q, k_cache, v_cache, cache_batch_idx, cache_leftpad, block_table,
              params: AttentionParams):
    """(q, k, v, params) of the Gluon forward reading the cache as varlen keys, or None where
    the cache is not in the flash layout.

    q (batch, seqlen_q, h, d) is packed as varlen queries (batch * seqlen_q, h, d) with
    cu_seqlens_q = seqlen_q * b; sequence b's keys number seqlens_k[b] (the append kernel's, as
    seqused_k), so tensor cache_seqlens need no host sync. A contiguous cache (batch_cache,
    capacity, hk, d) is read as packed varlen keys (batch_cache * capacity, hk, d): sequence
    b's start at row cache_batch_idx[b] * capacity + cache_leftpad[b] (cu_seqlens_k; only the
    starts are read). A paged one (num_blocks, page_size, hk, d) with a power-of-two page_size
    goes through block_table (attention_forward's paged keys). Causal and windows are
    bottom-right aligned per sequence. Slots past a sequence's keys (spare capacity, other
    rows, the rest of its last page) weigh exactly 0 even when they hold NaN."""
    from flashkit.ops.triton.hopper_common import flash_layout_2d

    batch, seqlen_q, nheads, head_dim = q.shape
    slots, nheads_k = k_cache.shape[1], k_cache.shape[2]  # the capacity, or page_size
    if not (flash_layout_2d(k_cache) and flash_layout_2d(v_cache)):
        return None
    k, v = k_cache.view(-1, nheads_k, head_dim), v_cache.view(-1, nheads_k, v_cache.shape[-1])
    cu_q = multiples(seqlen_q, batch + 1, q.device)
    if block_table is not None:
        starts = cu_q  # unread with a block table
    elif cache_batch_idx is None and cache_leftpad is None:
        starts = multiples(slots, batch + 1, q.device)
    else:  # (batch + 1,): the last entry is never read
        rows = multiples(1, batch, q.device) if cache_batch_idx is None else cache_batch_idx
        starts = torch.nn.functional.pad(rows * slots if cache_leftpad is None
                                         else rows * slots + cache_leftpad, (0, 1))
    capacity = slots if block_table is None else block_table.shape[1] * slots
    varlen = dataclasses.replace(params, cu_seqlens_q=cu_q, cu_seqlens_k=starts,
                                 max_seqlen_q=seqlen_q, max_seqlen_k=capacity)
    q_packed = q.reshape(batch * seqlen_q, nheads, head_dim)  # a view when q is contiguous
    return q_packed, k, v, varlen


def forward(q, k_cache, v_cache, seqlens_k, block_table, packed, plan: dict | None = None):
    """(out (batch, seqlen_q, h, dv), lse (batch, h, seqlen_q)) from the Gluon forward over
    the cache, packed = as_varlen(...); plan: the dispatch plan's prepared launches."""
    from flashkit.ops.triton import forward_hopper

    batch, seqlen_q, nheads, _ = q.shape
    q_packed, k, v, varlen = packed
    out, lse = forward_hopper.attention_forward(
        q_packed, k if block_table is None else k_cache, v if block_table is None else v_cache,
        varlen, seqused_k=seqlens_k, block_table=block_table, plan=plan,
        tile=planned(plan, "tile", lambda: tile(q, varlen, None if block_table is None
                                                else k_cache.shape[1])))
    # out (batch * seqlen_q, h, dv) -> (batch, seqlen_q, h, dv); lse (h, batch * seqlen_q)
    return (out.view(batch, seqlen_q, nheads, -1),
            lse.view(nheads, batch, seqlen_q).transpose(0, 1))


def tile(q, params: AttentionParams, page_size: int | None) -> tuple:
    """The Gluon forward's tile for a prefill of q (batch, seqlen_q, h, d): the configured one
    (configs.gluon_forward_tile), or in place of an unspecialized one (causal up to 1k queries
    at d128) the long queries' specialized tile where
    - its programs fill about every SM: the causal band over a long cache is nearly full, so
      the configured tile's masking rationale does not hold (paged 512 x 16.9k: 1.04-1.10x
      the dense forward against 0.92-0.94; contiguous 1.10-1.17 against 0.91-0.92);
    - else, paged, with one consumer (twice the programs, each with a producer warp): the
      consumer of an unspecialized tile looks its pages up and issues their TMAs itself
      between its matmuls, two consumers leave half the SMs idle (page 16 / 32 / 64, d128
      bf16, 256 x 16.6k, GQA 8:1: 1.08 / 1.10 / 1.04 against the unspecialized 0.74 / 0.88 /
      0.95 and two consumers' 0.86 / 0.87 / 0.95; d64: 1.22-1.40 against 0.97-1.09).
      Contiguous caches keep the configured tile there (1.00; the one-consumer tile not
      measured on them).
    The measurements: benchmarks/notes/decode.md."""
    from flashkit.ops.triton import forward_hopper
    from flashkit.ops.triton.configs import gluon_forward_tile

    batch, seqlen_q, nheads, head_dim = q.shape
    banded = params.window_right is not None
    tile = gluon_forward_tile(head_dim, seqlen_q, banded)
    if tile[3]:
        return tile
    long = gluon_forward_tile(head_dim, 2**31, banded)
    programs = -(-seqlen_q // (forward_hopper.BLOCK_M * long[2])) * batch * nheads
    sms = forward_hopper.programs_per_device(q.device, long[2])
    if 4 * programs >= 3 * sms:
        return long
    if page_size is not None:
        return (*long[:2], 1, True, False, False)
    return tile


def multiples(step: int, count: int, device) -> torch.Tensor:
    """int32 [0, step, ..., (count - 1) * step] on device (the cu_seqlens of sequences of one
    length; read-only), made once per (step, count, device) to spare a launch per call; made
    afresh under CUDA graph capture (a tensor made there holds its values only once the graph
    replays)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.arange(0, count * step, step, dtype=torch.int32, device=device)
    return _cached_multiples(step, count, device)


@functools.lru_cache(maxsize=64)
def _cached_multiples(step: int, count: int, device) -> torch.Tensor:
    return torch.arange(0, count * step, step, dtype=torch.int32, device=device)
