"""flash_attn_with_kvcache: attention for incremental decoding over a (paged) KV cache.

Semantics follow flash-attn 2's function of the same name; see its docstring below. Steps:
check every argument, rotate q and the new k, append the new k and v to the cache in place, then
run the backend's attention over each sequence's cached keys, split along the key length into
num_splits chunks merged by lse. A long prefill on sm_90 runs the Gluon forward instead
(flashkit.ops.triton.prefill: a contiguous cache read as varlen keys with seqused_k, a paged
one with power-of-two pages through its block table). The checks are flashkit.checks', the
choice of kernels the backend's (for Triton, flashkit.ops.triton.dispatch).

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

A decoding loop calls with the same tensors' shapes every step: an accepted call's checked
arguments are kept under those facts (_KEPT_CALLS, flashkit.kept), and an equal call skips
the checks that read them alone. The index values are checked every call. On the device path,
where the call was a decoding step in the decode kernel alone, the kept entry also holds that
step's planned launches (the Triton backend's kvcache_step), and an equal call hands its
tensors to them directly.
"""

from __future__ import annotations

import torch

from flashkit import checks, kept, reference
from flashkit.api import build_params, require_available
from flashkit.checks import MIN_PAGE_SIZE
from flashkit.ops.custom_op import backend_module
from flashkit.ops.params import KVCacheArgs
from flashkit.ops.tiled import kvcache as tiled_kvcache
from flashkit.ops.tiled.kvcache import empty_result

__all__ = ["flash_attn_with_kvcache", "MIN_PAGE_SIZE"]


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
    seqlen_new = 0 if k is None else k.shape[1]
    key = _kept_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                    cache_batch_idx, cache_leftpad, block_table, alibi_slopes, sink,
                    (softmax_scale, causal, window_size, softcap, rotary_interleaved,
                     num_splits, backend, sync_checks))
    checked = None if key is None else _KEPT_CALLS.get(key)
    if checked is None:
        checked = _check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                         cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                         window_size, softcap, alibi_slopes, num_splits, backend, sink)
        if key is not None:
            kept.remember(_KEPT_CALLS, key, checked)
    params, name, capacity, q_rows = (checked.params, checked.backend, checked.capacity,
                                      checked.q_rows)
    host_seqlen = checks.host_seqlen(cache_seqlens, seqlen_new, capacity)
    if checked.step is not None:  # a decoding step seen before: its planned launches
        result = checked.step(params, q, k_cache, v_cache, k, v,
                              cache_seqlens if host_seqlen is None else host_seqlen, rotary_cos,
                              rotary_sin, cache_batch_idx, cache_leftpad, block_table)
        if result is not None:  # None: the plans were forgotten since, or another device
            return result if return_softmax_lse else result[0]
    batch, device = q.shape[0], q.device
    rotary = rotary_cos is not None or rotary_sin is not None
    max_seqlen_k = capacity  # a bound for the split heuristic, as flash-attn's
    host_checks = device.type == "cpu" or sync_checks or name != "triton"
    if host_seqlen is not None and host_checks:  # the device path passes the int itself
        cache_seqlens = torch.full((batch,), host_seqlen, dtype=torch.int32, device=device)
    if host_checks:
        max_seqlen_k = checks.kvcache_values(cache_seqlens, seqlen_new, capacity,
                                             cache_batch_idx, cache_leftpad, block_table,
                                             k_cache, rotary_cos.shape[0] if rotary else None,
                                             q_rows)
    if batch == 0:  # nothing to append or attend: empty results, as every shape allows
        return empty_result(q, v_cache, return_softmax_lse)
    cache = KVCacheArgs(
        k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved,
        cache_seqlens=cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None,
        host_seqlen=host_seqlen, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        block_table=block_table, q_rows=q_rows, capacity=capacity, max_seqlen_k=max_seqlen_k,
        num_splits=checked.num_splits, host_checked=host_checks)
    if name == "reference":  # the tiled backend's rotary and append, then the oracle
        q, seqlens_k, cache_batch_idx, cache_leftpad = tiled_kvcache.prepare(q, k_cache,
                                                                             v_cache, cache)
        out, lse = reference.kvcache_attention(q, k_cache, v_cache, seqlens_k, cache_batch_idx,
                                               cache_leftpad, block_table, params)
    else:
        require_available(name, device)
        backend = backend_module(name)
        out, lse = backend.kvcache_attention(q, k_cache, v_cache, cache, params)
        if key is not None and not host_checks and not (checked.step and checked.step.live):
            # kept: an equal call runs the same launches
            checked.step = backend.kvcache_step(q, k_cache, v_cache, cache, params)
    return (out, lse) if return_softmax_lse else out


class _Checked:
    """What _check found for a kept call: its params, backend name, cache capacity per
    sequence, query rows taking consecutive rotary positions and key splits; and, once an
    equal call ran as a decoding step on the device path, that step's planned launches
    (the Triton backend's kvcache_step), which later equal calls run directly."""
    __slots__ = ("params", "backend", "capacity", "q_rows", "num_splits", "step")

    def __init__(self, params, backend: str, capacity: int, q_rows: int, num_splits: int):
        self.params, self.backend, self.capacity = params, backend, capacity
        self.q_rows, self.num_splits, self.step = q_rows, num_splits, None


def _check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
           cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
           alibi_slopes, num_splits, backend, sink) -> _Checked:
    """Every check of flash_attn_with_kvcache's arguments but those of the index values."""
    checks.kvcache_tensors(q, k_cache, v_cache, k, v)
    batch, device = q.shape[0], q.device
    if k is not None:  # the append writes the caches: each slot must be its own memory
        checks.no_overlap("k_cache", k_cache)
        checks.no_overlap("v_cache", v_cache)
        checks.distinct(("k_cache", "v_cache"), k_cache, v_cache)
    capacity = checks.paging(block_table, k_cache, batch, device, cache_batch_idx,
                             cache_leftpad)
    checks.index_vector("cache_batch_idx", cache_batch_idx, batch, device)
    checks.index_vector("cache_leftpad", cache_leftpad, batch, device)
    if checks.host_seqlen(cache_seqlens, 0 if k is None else k.shape[1], capacity) is None:
        checks.index_vector("cache_seqlens", cache_seqlens, batch, device)
    params = build_params(q, 0.0, softmax_scale, causal, window_size, softcap, alibi_slopes, False,
                          sink, batch=batch)
    num_splits = checks.num_splits(num_splits)
    name = checks.backend(backend, device)
    # flash-attn: with a causal or local mask the query rows are consecutive positions, without
    # one they all sit at the first new position.
    q_rows = q.shape[1] if params.window_left is not None or params.window_right is not None \
        else 1
    if rotary_cos is not None or rotary_sin is not None:
        checks.rotary(rotary_cos, rotary_sin, q, k)
    return _Checked(params, name, capacity, q_rows, num_splits)


_KEPT_CALLS: dict = {}


def _kept_key(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
              cache_batch_idx, cache_leftpad, block_table, alibi_slopes, sink,
              scalars) -> tuple | None:
    """The key under which a call's checked arguments are kept (_check's result), or None for
    a call that is not kept: one with ALiBi slopes or a sink (the params would hold them), an
    argument that is neither a tensor nor None (but an int cache_seqlens, whose value every
    call checks), or scalars that flash_attn_func would not keep either. The key holds what
    _check reads and what a kept decoding step's planned launches fix: each tensor's type,
    shape, dtype, device, requires_grad, strides and whether its address is 16-byte aligned,
    whether grad mode is on, and, where an append writes the caches, whether they share a
    first address."""
    softmax_scale, causal, window_size, softcap, interleaved, num_splits, backend, sync = scalars
    if (alibi_slopes is not None or sink is not None or type(interleaved) not in kept.PLAIN
            or type(num_splits) not in kept.PLAIN or type(sync) not in kept.PLAIN
            or not (backend is None or type(backend) is str)):
        return None
    plain = kept.scalar_key(0.0, softmax_scale, causal, window_size, False, softcap)
    if plain is None:
        return None
    key = [plain, interleaved, num_splits, type(num_splits), backend, sync,
           torch.is_grad_enabled()]
    for t in (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
              cache_batch_idx, cache_leftpad, block_table):
        if t is None:
            key.append(None)
        elif isinstance(t, torch.Tensor):  # with the layout a planned step's launches fix
            key.append((type(t), t.shape, t.dtype, t.device, t.requires_grad, t.stride(),
                        t.data_ptr() % 16 == 0))
        elif t is cache_seqlens and type(t) is int:
            key.append(int)
        else:  # an argument the checks will refuse
            return None
    if k is not None:
        key.append(k_cache.data_ptr() == v_cache.data_ptr())
    return tuple(key)
