"""flash_attn_with_kvcache: attention for incremental decoding over a (paged) KV cache.

Semantics follow flash-attn 2's function of the same name; see its docstring below. Steps:
check every argument, rotate q and the new k, append the new k and v to the cache in place, then
run the backend's attention over each sequence's cached keys, split along the key length into
num_splits chunks merged by lse. A long prefill on sm_90 runs the Gluon forward instead
(`_gluon_prefill`: a contiguous cache read as varlen keys with seqused_k, a paged one with
power-of-two pages through its block table).

Index values (cache_seqlens, cache_batch_idx, cache_leftpad, the used block_table entries, the
rotary table's length) decide where the kernels read and write, so they are always checked:
- on the host, raising a ValueError that names the argument, when the tensors are on the CPU,
  for the torch and reference backends, and with sync_checks=True (one device sync);
- otherwise (CUDA tensors, the Triton backend) on the device, without a sync: the Triton append
  kernel (flashkit.ops.triton.append), or the decode kernel where it appends itself
  (decode.Step), checks every index before it writes, and a bad one fails a device-side
  assertion in that kernel, which stops the stream. A bad index then raises a device-side
  assertion error (at the next synchronising call, and it ends the CUDA context), never an
  out-of-bounds read or write. Pass sync_checks=True to learn which argument was wrong. An int
  cache_seqlens is checked on the host at once.
A page an append writes must appear once among the used block_table entries (pages only read,
such as a shared prefix, may repeat). The host checks reject a repeated written page; the device
path does not look for one (it would take a sort of the table on every step, and such writes
stay in bounds), so there the caller must keep written pages unshared. k_cache and v_cache are
checked, from their strides alone, to give every slot its own memory when an append writes them.

On CUDA with the Triton backend a call does not synchronise and allocates only through the
caching allocator, and auto num_splits depends on shapes alone (the cache capacity), so a decoding
step can be captured in torch.cuda.graph and replayed with new values copied into the captured
q, k, v and cache_seqlens tensors (an int cache_seqlens is frozen into the graph); tests/
test_kvcache.py checks replays against eager calls and the oracle. Such a step (a few new keys,
a few query rows per kv head) is the decode kernel, which appends the new keys itself, and,
with more than one split, the merge kernel: at most two graph nodes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import torch

from flashkit import checks, reference
from flashkit.api import build_params, require_available
from flashkit.ops.params import AttentionParams, accumulation_dtype
from flashkit.ops.tiled import kvcache as tiled_kvcache

__all__ = ["flash_attn_with_kvcache", "MIN_PAGE_SIZE"]

MIN_PAGE_SIZE = 16  # paged caches: the smallest page_size (the kernels look pages up per key)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, sink=None, backend=None,
                            sync_checks=False):
    """Attention of q over a KV cache, optionally appending new keys/values first (in place).

    q (batch, seqlen_q, nheads, d). k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, d)
    contiguous, or paged (num_blocks, page_size, nheads_k, d) with block_table (batch,
    max_blocks_per_seq) int32: slot p of sequence b is page block_table[b, p // page_size],
    position p % page_size; any page_size >= 16.
    cache_seqlens: int or int32 (batch,), the filled length of each sequence (None = the whole
    capacity). cache_batch_idx int32 (batch,): the cache row of each sequence (contiguous only;
    default 0..batch-1). cache_leftpad int32 (batch,): the first valid slot (contiguous only).
    k, v (batch, seqlen_new, nheads_k, d): written into the cache at slots cache_seqlens ..
    cache_seqlens + seqlen_new - 1 before attention; this is the only in-place mutation. With
    duplicate cache_batch_idx the cache keeps one of the writes.
    rotary_cos/sin (seqlen_ro, rotary_dim / 2) (needs k, v): the new k is rotated at its
    absolute slots cache_seqlens + [0, seqlen_new) (as flash-attn, also with cache_leftpad); q at
    cache_seqlens + [0, seqlen_q) when causal or local, else every query row at cache_seqlens.
    rotary_interleaved pairs dims (0, 1), (2, 3)... (GPT-J), else (i, i + rotary_dim / 2).
    The keys of sequence b are its slots [leftpad, cache_seqlens + seqlen_new); causal and
    window_size are bottom-right aligned to them, so the query rows are the sequence's last
    positions. softcap, alibi_slopes, sink and GQA/MQA are as in flash_attn_func.
    num_splits: key-length chunks per sequence, merged by their log-sum-exp (0 = choose from
    batch, heads and length; the torch backend then uses 1).
    sync_checks: read the index tensors on the host and raise a ValueError naming a bad one
    (one device sync per call); by default CUDA calls on the Triton backend check them on the
    device instead (see the module docstring).
    Forward only, as in flash-attn: inputs that require grad are refused.
    Returns out (batch, seqlen_q, nheads, d_v), and lse (batch, nheads, seqlen_q) float32 with
    return_softmax_lse.
    """
    checks.tensor("q", q, "(batch, seqlen_q, nheads, headdim)")
    checks.tensor("k_cache", k_cache, "(batch_cache | num_blocks, seqlen_cache | page_size, "
                  "nheads_k, headdim)")
    checks.tensor("v_cache", v_cache, "(batch_cache | num_blocks, seqlen_cache | page_size, "
                  "nheads_k, headdim_v)")
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both new keys and new values, or neither")
    if k is not None:
        checks.tensor("k", k, "(batch, seqlen_new, nheads_k, headdim)")
        checks.tensor("v", v, "(batch, seqlen_new, nheads_k, headdim_v)")
        named.update(k=k, v=v)
    checks.same_dtype_and_device(named)
    _no_grad(named)
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache's "
                         f"{tuple(k_cache.shape)} in the first three dims")
    checks.heads(q.shape[2], k_cache.shape[2], k_cache, v_cache, dim=2)
    checks.head_dims(q, k_cache, v_cache)
    batch, device = q.shape[0], q.device
    seqlen_new = 0 if k is None else k.shape[1]
    if k is not None:
        for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
            expected = (batch, seqlen_new, *cache.shape[2:])
            if tuple(t.shape) != expected:
                raise ValueError(f"{name}: expected shape {expected} (batch, seqlen_new, "
                                 f"nheads_k, headdim), got {tuple(t.shape)}")

    if k is not None:  # the append writes the caches: each slot must be its own memory
        checks.no_overlap("k_cache", k_cache)
        checks.no_overlap("v_cache", v_cache)
        checks.distinct(("k_cache", "v_cache"), k_cache, v_cache)
    capacity = _check_paging(block_table, k_cache, batch, device, cache_batch_idx,
                             cache_leftpad)
    cache_batch_idx = _index_vector("cache_batch_idx", cache_batch_idx, batch, device)
    cache_leftpad = _index_vector("cache_leftpad", cache_leftpad, batch, device)
    host_seqlen = _host_seqlen(cache_seqlens, seqlen_new, capacity)
    if host_seqlen is None:
        cache_seqlens = _index_vector("cache_seqlens", cache_seqlens, batch, device)
    params = build_params(q, 0.0, softmax_scale, causal, window_size, softcap, alibi_slopes, False,
                     sink, batch=batch)
    num_splits = _num_splits(num_splits)
    name = checks.backend(backend, device)
    rotary = rotary_cos is not None or rotary_sin is not None
    # flash-attn: with a causal or local mask the query rows are consecutive positions, without
    # one they all sit at the first new position.
    q_rows = q.shape[1] if params.window_left is not None or params.window_right is not None \
        else 1
    if rotary:
        _check_rotary(rotary_cos, rotary_sin, q, k)
    max_seqlen_k = capacity  # a bound for the split heuristic, as flash-attn's
    host_checks = device.type == "cpu" or sync_checks or name != "triton"
    if host_seqlen is not None and host_checks:  # the device path passes the int itself
        cache_seqlens = torch.full((batch,), host_seqlen, dtype=torch.int32, device=device)
    if host_checks:
        max_seqlen_k = _check_values(cache_seqlens, seqlen_new, capacity, cache_batch_idx,
                                     cache_leftpad, block_table, k_cache,
                                     rotary_cos.shape[0] if rotary else None, q_rows)
    if batch == 0:  # nothing to append or attend: empty results, as every shape allows
        return _empty_result(q, v_cache, return_softmax_lse)
    if name == "triton":
        require_available(name, device)
        from flashkit.ops.triton import append, decode

        decode.check_supported(q.dtype, params)
        # one kernel (decode.Step); an append without queries takes the append kernel alone
        if q.shape[1] > 0 and decode.takes_step(q, k_cache.shape[2], seqlen_new):
            step = decode.Step(host_seqlen if cache_seqlens is None else cache_seqlens, k, v,
                               rotary_cos, rotary_sin, rotary_interleaved, q_rows)
            out, lse = decode.forward(q, k_cache, v_cache, None, cache_batch_idx,
                                      cache_leftpad, block_table, params, num_splits,
                                      max_seqlen_k, step=step)
            return (out, lse.contiguous()) if return_softmax_lse else out
        # A bad index fails a device-side assertion in the append kernel (module docstring).
        q, seqlens_k = append.append(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                     cache_seqlens, cache_batch_idx, cache_leftpad,
                                     block_table, q_rows, rotary_interleaved)
        if q.shape[1] == 0:  # an append without queries
            return _empty_result(q, v_cache, return_softmax_lse)
        keys_bound = capacity if host_seqlen is None else host_seqlen + seqlen_new
        prefill = _gluon_prefill(q, k_cache, v_cache, seqlens_k, keys_bound, cache_batch_idx,
                                 cache_leftpad, block_table, params)
        if prefill is not None:
            out, lse = prefill
        else:
            out, lse = decode.forward(q, k_cache, v_cache, seqlens_k, cache_batch_idx,
                                      cache_leftpad, block_table, params, num_splits,
                                      max_seqlen_k)
        return (out, lse.contiguous()) if return_softmax_lse else out

    if cache_batch_idx is None:
        cache_batch_idx = torch.arange(batch, dtype=torch.int32, device=device)
    if cache_leftpad is None:
        cache_leftpad = torch.zeros(batch, dtype=torch.int32, device=device)
    if rotary:  # rotary positions are absolute slots (flash-attn), whatever the leftpad
        first = cache_seqlens.long()[:, None]
        q_pos = first + torch.arange(q.shape[1], device=device).clamp(max=q_rows - 1)
        k_pos = first + torch.arange(seqlen_new, device=device)
        q = tiled_kvcache.rotary(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
        k = tiled_kvcache.rotary(k, rotary_cos, rotary_sin, k_pos, rotary_interleaved)
    if k is not None:
        tiled_kvcache.append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                             block_table)
    seqlens_k = cache_seqlens - cache_leftpad + seqlen_new
    out, lse = _run(name, q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad,
                    block_table, params, num_splits)
    return (out, lse) if return_softmax_lse else out


def _empty_result(q, v_cache, return_softmax_lse: bool):
    """out (batch, seqlen_q, nheads, d_v) and lse (batch, nheads, seqlen_q) of a call where
    one of batch and seqlen_q is 0."""
    batch, seqlen_q, nheads, _ = q.shape
    out = q.new_empty(batch, seqlen_q, nheads, v_cache.shape[-1])
    lse = torch.empty(batch, nheads, seqlen_q, dtype=accumulation_dtype(q.dtype), device=q.device)
    return (out, lse) if return_softmax_lse else out


# Prefill through the Gluon forward (sm_90), from this many query rows and this much work (batch x
# heads x queries x keys, the keys bounded by the capacity when cache_seqlens is a tensor).
# H200, bf16 d128, 32 heads, batch 1, causal, GQA 8:1 and 1:1, public call with the route forced
# on / off, x the dense forward's speed (benchmarks/results/prefill_*.json; route: _prefill_tile's
# tile): 128 queries stay on the decode kernels (split along the keys they fill the GPU: 1.4-1.7
# at 4k and 16k keys against the route's 0.7-1.0, one 64-row program per head); 256 and 512
# queries over 4.3-4.6k keys (3.6e7-7.5e7) too (0.96-1.24 against 0.69-0.80, bound by host
# time: the route's launch costs ~50 us more); 256 x 16.6k (1.4e8) is the route's (contiguous
# 1.00 against 0.93-0.95, pages 64/256 0.93-0.94 against 0.79-0.86, page 16 0.81-0.84 against
# 0.78-0.80; with _prefill_tile's one-consumer tile and the split producer pages 16-256 run
# 1.00-1.21), 512 x 16.9k (pages 1.04-1.10 against
# 0.64-0.71) and 2048 x 6-18k (0.88-1.01 against 0.57-0.76) too.
GLUON_PREFILL_MIN_QUERIES = 256
GLUON_PREFILL_MIN_WORK = 2**27


def _gluon_prefill(q, k_cache, v_cache, seqlens_k, keys_bound, cache_batch_idx, cache_leftpad,
                   block_table, params: AttentionParams):
    """(out, lse) from the Gluon forward over the cache, or None (the decode kernels).

    q (batch, seqlen_q, h, d) is packed as varlen queries (batch * seqlen_q, h, d) with
    cu_seqlens_q = seqlen_q * b; sequence b's keys number seqlens_k[b] (the append kernel's, as
    seqused_k), so tensor cache_seqlens need no host sync. A contiguous cache (batch_cache,
    capacity, hk, d) is read as packed varlen keys (batch_cache * capacity, hk, d): sequence
    b's start at row cache_batch_idx[b] * capacity + cache_leftpad[b] (cu_seqlens_k; only the
    starts are read). A paged one (num_blocks, page_size, hk, d) with a power-of-two page_size
    goes through block_table (attention_forward's paged keys); other page sizes stay on the
    decode kernels. Causal and windows are bottom-right aligned per sequence, as here. Slots
    past a sequence's keys (spare capacity, other rows, the rest of its last page) weigh exactly
    0 even when they hold NaN. keys_bound: the key count (int cache_seqlens) or the capacity,
    for the work threshold."""
    batch, seqlen_q, nheads, head_dim = q.shape
    if (not q.is_cuda or seqlen_q < GLUON_PREFILL_MIN_QUERIES
            or batch * nheads * seqlen_q * keys_bound < GLUON_PREFILL_MIN_WORK):
        return None
    from flashkit.ops.triton import forward_hopper

    slots, nheads_k = k_cache.shape[1], k_cache.shape[2]  # the capacity, or page_size
    if block_table is not None and slots & (slots - 1):
        return None
    if not (forward_hopper.flash_layout_2d(k_cache) and forward_hopper.flash_layout_2d(v_cache)):
        return None
    k, v = k_cache.view(-1, nheads_k, head_dim), v_cache.view(-1, nheads_k, v_cache.shape[-1])
    cu_q = _multiples(seqlen_q, batch + 1, q.device)
    if block_table is not None:
        starts = cu_q  # unread with a block table
    elif cache_batch_idx is None and cache_leftpad is None:
        starts = _multiples(slots, batch + 1, q.device)
    else:  # (batch + 1,): the last entry is never read
        rows = _multiples(1, batch, q.device) if cache_batch_idx is None else cache_batch_idx
        starts = torch.nn.functional.pad(rows * slots if cache_leftpad is None
                                         else rows * slots + cache_leftpad, (0, 1))
    capacity = slots if block_table is None else block_table.shape[1] * slots
    varlen = dataclasses.replace(params, cu_seqlens_q=cu_q, cu_seqlens_k=starts,
                                 max_seqlen_q=seqlen_q, max_seqlen_k=capacity)
    q_packed = q.reshape(batch * seqlen_q, nheads, head_dim)  # a view when q is contiguous
    if not forward_hopper.eligible(q_packed, k, v, varlen, None, None, None):
        return None
    tile = _prefill_tile(q, varlen, slots if block_table is not None else None)
    out, lse = forward_hopper.attention_forward(
        q_packed, k if block_table is None else k_cache, v if block_table is None else v_cache,
        varlen, tile=tile, seqused_k=seqlens_k, block_table=block_table)
    # out (batch * seqlen_q, h, dv) -> (batch, seqlen_q, h, dv); lse (h, batch * seqlen_q)
    return (out.view(batch, seqlen_q, nheads, -1),
            lse.view(nheads, batch, seqlen_q).transpose(0, 1))


def _prefill_tile(q, params: AttentionParams, page_size: int | None) -> tuple:
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
    The measurements: benchmarks/results/prefill_*.json."""
    from flashkit.ops.triton import forward_hopper
    from flashkit.ops.triton.configs import gluon_forward_tile

    batch, seqlen_q, nheads, head_dim = q.shape
    banded = params.window_right is not None
    tile = gluon_forward_tile(head_dim, seqlen_q, banded)
    if tile[3]:
        return tile
    long = gluon_forward_tile(head_dim, 2**31, banded)
    programs = -(-seqlen_q // (forward_hopper.BLOCK_M * long[2])) * batch * nheads
    sms = forward_hopper._programs_per_device(q.device, long[2])
    if 4 * programs >= 3 * sms:
        return long
    if page_size is not None:
        return (*long[:2], 1, True, False, False)
    return tile


def _multiples(step: int, count: int, device) -> torch.Tensor:
    """int32 [0, step, ..., (count - 1) * step] on device (prefill's cu_seqlens; read-only),
    made once per (step, count, device) to spare a launch per call; made afresh under CUDA graph
    capture (a tensor made there holds its values only once the graph replays)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.arange(0, count * step, step, dtype=torch.int32, device=device)
    return _cached_multiples(step, count, device)


@functools.lru_cache(maxsize=64)
def _cached_multiples(step: int, count: int, device) -> torch.Tensor:
    return torch.arange(0, count * step, step, dtype=torch.int32, device=device)


def _run(name, q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table,
         params: AttentionParams, num_splits: int):
    if name == "torch":
        return tiled_kvcache.forward(q, k_cache, v_cache, seqlens_k, cache_batch_idx,
                                     cache_leftpad, block_table, params, num_splits or 1)
    return _reference(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad,
                      block_table, params)


def _reference(q, k_cache, v_cache, seqlens_k, cache_batch_idx, cache_leftpad, block_table,
               params: AttentionParams):
    """The oracle on each sequence's gathered keys (backend="reference")."""
    outs, lses = [], []
    for b, (seqlen_k, leftpad) in enumerate(zip(seqlens_k.tolist(), cache_leftpad.tolist(),
                                                strict=True)):
        k_b, v_b = (tiled_kvcache.gather(c, b, leftpad, leftpad + seqlen_k, cache_batch_idx,
                                         block_table) for c in (k_cache, v_cache))
        slopes = params.alibi_slopes
        params_b = params if slopes is None or slopes.dim() == 1 else dataclasses.replace(
            params, alibi_slopes=slopes[b])
        if seqlen_k == 0:  # no key: out 0, lse the sink's logit or -inf (section 1)
            out_b = q.new_zeros(1, *q.shape[1:3], v_cache.shape[-1])
            lse_b = torch.full((1, q.shape[2], q.shape[1]), -math.inf, dtype=q.dtype,
                               device=q.device)
            if params.sink is not None:
                lse_b[:] = params.sink.to(q.dtype)[None, :, None]
        else:
            out_b, lse_b = reference.attention_with_params(q[b:b + 1], k_b, v_b, params_b)
        outs.append(out_b)
        lses.append(lse_b)
    lse = torch.cat(lses).to(accumulation_dtype(q.dtype))
    return torch.cat(outs), lse


def _no_grad(named: dict) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in named.values()):
        raise NotImplementedError(
            "flash_attn_with_kvcache: there is no backward pass (as in flash-attn); call it "
            "under torch.no_grad() or pass tensors that do not require grad")


def _check_paging(block_table, k_cache, batch, device, cache_batch_idx, cache_leftpad) -> int:
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


def _index_vector(name, t, batch, device):
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


def _host_seqlen(cache_seqlens, seqlen_new, capacity) -> int | None:
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


def _check_values(cache_seqlens, seqlen_new, capacity, cache_batch_idx, cache_leftpad,
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
            _check_written_pages(used, seqlens, seqlen_new, page_size)
    return max(positions) + seqlen_new


def _check_written_pages(used, seqlens, seqlen_new, page_size) -> None:
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


def _check_rotary(cos, sin, q, k) -> None:
    """cos/sin (seqlen_ro, rotary_dim / 2) on q's device, k, v given (their length: in
    _check_values or on the device)."""
    if cos is None or sin is None:
        raise ValueError("rotary_cos, rotary_sin: pass both or neither")
    if k is None:
        raise ValueError("rotary_cos: the rotary embedding applies to new keys; pass k and v "
                         "too (flash-attn's rule)")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        checks.tensor(name, t, "(seqlen_ro, rotary_dim / 2)")
        if not t.is_floating_point() or t.device != q.device:
            raise TypeError(f"{name}: expected a floating tensor on {q.device}, got {t.dtype} "
                            f"on {t.device}")
    if sin.shape != cos.shape:
        raise ValueError(f"rotary_sin: shape {tuple(sin.shape)} differs from rotary_cos's "
                         f"{tuple(cos.shape)}")
    if not 1 <= 2 * cos.shape[1] <= q.shape[-1]:
        raise ValueError(f"rotary_cos: rotary_dim = 2 * {cos.shape[1]} must be in 2..headdim "
                         f"({q.shape[-1]})")


def _num_splits(num_splits) -> int:
    if not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool) \
            or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 = automatic), got {num_splits!r}")
    return int(num_splits)
