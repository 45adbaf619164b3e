"""KV-cache attention on the tiled PyTorch path: rotary, in-place append, page gather, split-KV.

Notation (shared with flashkit.ops.triton.decode):
    cache coords   slot p of a cache row: k_cache[row, p] (contiguous) or, paged, slot p of
                   sequence b lives at k_cache[block_table[b, p // page_size], p % page_size]
    leftpad_b      first valid slot of sequence b (contiguous caches only; 0 otherwise)
    seqlen_k       L_b = cache_seqlens_b + seqlen_new - leftpad_b, the keys sequence b attends
                   to: key j of the attention problem is slot leftpad_b + j
    split          the key range [0, L_b) cut into num_splits chunks of whole key tiles; each
                   chunk gives a partial (out, lse) and the chunks merge by their lse

The rotary embedding and the append are plain tensor ops that run on any device; the Triton
backend uses them too, then reads the cache with its own kernel.
"""

from __future__ import annotations

import math

import torch

from flashkit.ops.params import AttentionParams, KVCacheArgs, accumulation_dtype
from flashkit.ops.tiled import layout, tile

BLOCK_M = 128
BLOCK_N = 128
SPLIT_GRANULE = 16  # split boundaries are multiples of this, so small caches split too


def kvcache_attention(q, k_cache, v_cache, cache: KVCacheArgs, params: AttentionParams):
    """The backend's kv-cache entry (flashkit.ops.params): rotate, append in place, attend."""
    q, seqlens_k, cache_batch_idx, cache_leftpad = prepare(q, k_cache, v_cache, cache)
    return forward(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad,
                   cache.block_table, params, cache.num_splits or 1)


def empty_result(q, v_cache, return_softmax_lse: bool = True):
    """out (batch, seqlen_q, nheads, d_v) and lse (batch, nheads, seqlen_q) of a call where
    one of batch and seqlen_q is 0 (or out alone without return_softmax_lse)."""
    batch, seqlen_q, nheads, _ = q.shape
    out = q.new_empty(batch, seqlen_q, nheads, v_cache.shape[-1])
    lse = torch.empty(batch, nheads, seqlen_q, dtype=accumulation_dtype(q.dtype), device=q.device)
    return (out, lse) if return_softmax_lse else out


def prepare(q, k_cache, v_cache, cache: KVCacheArgs):
    """Rotate q and the new keys, append the new keys and values to the cache (in place).
    Returns (q rotated, seqlens_k, cache_batch_idx, cache_leftpad), the last three int32
    (batch,) with the defaults (rows 0..batch-1, no padding) filled in."""
    batch, device = q.shape[0], q.device
    cache_seqlens = cache.cache_seqlens
    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), cache.host_seqlen, dtype=torch.int32,
                                   device=device)
    cache_batch_idx, cache_leftpad = cache.cache_batch_idx, cache.cache_leftpad
    if cache_batch_idx is None:
        cache_batch_idx = torch.arange(batch, dtype=torch.int32, device=device)
    if cache_leftpad is None:
        cache_leftpad = torch.zeros(batch, dtype=torch.int32, device=device)
    k, seqlen_new = cache.k, cache.seqlen_new
    if cache.rotary_cos is not None:  # rotary positions are absolute slots (flash-attn)
        cos, sin, interleaved = cache.rotary_cos, cache.rotary_sin, cache.rotary_interleaved
        first = cache_seqlens.long()[:, None]
        q_pos = first + torch.arange(q.shape[1], device=device).clamp(max=cache.q_rows - 1)
        k_pos = first + torch.arange(seqlen_new, device=device)
        q = rotary(q, cos, sin, q_pos, interleaved)
        k = rotary(k, cos, sin, k_pos, interleaved)
    if k is not None:
        append(k_cache, v_cache, k, cache.v, cache_seqlens, cache_batch_idx, cache.block_table)
    return q, cache_seqlens - cache_leftpad + seqlen_new, cache_batch_idx, cache_leftpad


def rotary(x, cos, sin, positions, interleaved: bool):
    """x (b, s, h, d) rotated at integer positions (b, s) by cos/sin (seqlen_ro, rotary_dim / 2).

    Pairs (x[2i], x[2i+1]) when interleaved (GPT-J), else (x[i], x[i + rotary_dim / 2])
    (GPT-NeoX); dims past rotary_dim are untouched. Computed in float32 (float64 for float64
    inputs), returned in x's dtype.
    """
    half = cos.shape[-1]
    dtype = accumulation_dtype(x.dtype)
    c = cos.to(dtype)[positions][:, :, None, :]  # (b, s, 1, rotary_dim / 2)
    s = sin.to(dtype)[positions][:, :, None, :]
    rot = x[..., :2 * half].to(dtype)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., 2 * half:]), dim=-1)


def append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table) -> None:
    """Write k, v (b, seqlen_new, hk, d) into the caches at slots cache_seqlens_b + [0, n), in
    place."""
    positions = cache_seqlens.long()[:, None] + torch.arange(k.shape[1], device=k.device)
    rows, cols = cache_slots(positions, cache_batch_idx, block_table, k_cache.shape[1])
    k_cache[rows, cols] = k
    v_cache[rows, cols] = v


def cache_slots(positions, cache_batch_idx, block_table, page_size: int):
    """(row, slot) index tensors into dims 0 and 1 of a cache for positions (b, n) in cache
    coords: the sequence's cache row, or with block_table its page and the slot in the page."""
    if block_table is None:
        return cache_batch_idx.long()[:, None].expand_as(positions), positions
    batch = torch.arange(positions.shape[0], device=positions.device)[:, None]
    return block_table.long()[batch, positions // page_size], positions % page_size


def gather(cache, b: int, start: int, end: int, cache_batch_idx, block_table):
    """Slots [start, end) of sequence b as one (1, end - start, hk, d) tensor (a copy if paged)."""
    positions = torch.arange(start, end, device=cache.device)[None]
    rows, cols = cache_slots(positions, cache_batch_idx[b:b + 1],
                             None if block_table is None else block_table[b:b + 1],
                             cache.shape[1])
    return cache[rows, cols]


def split_bounds(seqlen_k: int, num_splits: int, granule: int) -> list[tuple[int, int]]:
    """num_splits chunks [c0, c1) of [0, seqlen_k), each a whole number of granules (the last
    ones may be empty); the Triton kernel splits the same way with granule = its key tile."""
    chunk = math.ceil(math.ceil(seqlen_k / granule) / num_splits) * granule
    return [(min(s * chunk, seqlen_k), min((s + 1) * chunk, seqlen_k))
            for s in range(num_splits)]


def forward(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table,
            params: AttentionParams, num_splits: int, block_m: int = BLOCK_M,
            block_n: int = BLOCK_N):
    """(out, lse) of q (b, sq, h, d) over each sequence's cached keys, the append already done.

    seqlens_k, cache_batch_idx, cache_leftpad: int32 (b,); block_table int32 (b, pages) or None.
    num_splits >= 1 key chunks per sequence, merged by lse (0 is resolved by the caller).
    """
    batch, seqlen_q, nheads, _ = q.shape
    nheads_k, head_dim_v = v_cache.shape[2], v_cache.shape[3]
    acc_dtype = accumulation_dtype(q.dtype)
    out = q.new_empty(batch, seqlen_q, nheads, head_dim_v)
    lse = torch.empty(batch, nheads, seqlen_q, dtype=acc_dtype, device=q.device)
    for b, (seqlen_k, leftpad) in enumerate(zip(seqlens_k.tolist(), cache_leftpad.tolist(),
                                                strict=True)):
        k_b = gather(k_cache, b, leftpad, leftpad + seqlen_k, cache_batch_idx, block_table)
        v_b = gather(v_cache, b, leftpad, leftpad + seqlen_k, cache_batch_idx, block_table)
        slopes = layout.group_slopes(layout.sequence_slopes(params, b), nheads_k, acc_dtype)
        parts = [_attend_range(q[b:b + 1], k_b, v_b, c0, c1, params, slopes, first=s == 0,
                               block_m=block_m, block_n=block_n)
                 for s, (c0, c1) in enumerate(split_bounds(seqlen_k, num_splits, SPLIT_GRANULE))]
        out_b, lse_b = tile.merge_by_lse(torch.stack([p[0] for p in parts]),
                                    torch.stack([p[1] for p in parts]))
        out[b] = out_b[0].to(out.dtype)
        lse[b] = lse_b[0].transpose(0, 1)
    return out, lse


def _attend_range(q, k, v, c0: int, c1: int, params: AttentionParams, slopes, first: bool,
                  block_m: int, block_n: int):
    """Partial (out (1, sq, h, dv), lse (1, sq, h)) of q over keys [c0, c1) of k, v (1, sk, hk,
    d), masks placed as for the whole sequence. The sink, a logit without a value, enters the
    first chunk only (its state starts from it), so the merge counts it once."""
    seqlen_q, nheads = q.shape[1], q.shape[2]
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    shift = seqlen_k - seqlen_q
    acc_dtype = accumulation_dtype(q.dtype)
    q_g = layout.group_heads(q, nheads_k)  # (1, hk, g, sq, d)
    k_g = layout.group_heads(k, nheads_k)  # (1, hk, 1, sk, d)
    v_g = layout.group_heads(v, nheads_k)
    out = torch.empty(1, nheads_k, nheads // nheads_k, seqlen_q, v.shape[-1], dtype=acc_dtype,
                      device=q.device)
    lse = torch.empty(*out.shape[:-1], dtype=acc_dtype, device=q.device)
    state_shape = (1, nheads_k, nheads // nheads_k)
    for i0 in range(0, seqlen_q, block_m):
        i1 = min(i0 + block_m, seqlen_q)
        if first and params.sink is not None:
            m = params.sink.to(acc_dtype).reshape(state_shape + (1,)).expand(
                *state_shape, i1 - i0)
            l = torch.ones_like(m)
        else:
            m = torch.full((*state_shape, i1 - i0), -math.inf, dtype=acc_dtype, device=q.device)
            l = torch.zeros_like(m)
        acc = torch.zeros(*m.shape, v.shape[-1], dtype=acc_dtype, device=q.device)
        lo, hi = tile.key_range(i0, i1, seqlen_k, shift, params)
        q_t = q_g[..., i0:i1, :].to(acc_dtype)
        for j0 in range(max(lo, c0), min(hi, c1), block_n):
            j1 = min(j0 + block_n, hi, c1)
            s, _ = tile.scores(q_t, k_g[..., j0:j1, :].to(acc_dtype), i0, i1, j0, j1, shift,
                               params, slopes, None)
            m, l, acc = tile.online_update(m, l, acc, s, v_g[..., j0:j1, :].to(acc_dtype))
        out[..., i0:i1, :], lse[..., i0:i1] = tile.finalize(m, l, acc)
    # (1, hk, g, sq, dv) -> (1, sq, h, dv); (1, hk, g, sq) -> (1, sq, h)
    return out.flatten(1, 2).transpose(1, 2), lse.flatten(1, 2).transpose(1, 2)
