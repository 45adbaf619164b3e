"""Sequence parallelism: ring attention on torch.distributed (NCCL on GPUs, gloo on CPUs).

Each rank of a process group holds a shard of the sequence; the key/value shards travel around
the ring of ranks while every rank attends its queries to the shard it holds, merging the
partial results by log-sum-exp. The result is exact: the same attention as flash_attn_func on
the unsharded tensors, forward and backward, with causal / sliding-window masks, GQA, softcap,
ALiBi (on global distances) and a learnable sink (in each row's softmax once).

    import flashkit.distributed as fd
    q_local = fd.shard(q, dim=1, rank=rank, world=world, layout="zigzag")   # likewise k, v
    out_local = fd.ring_flash_attn_func(q_local, k_local, v_local, causal=True, layout="zigzag")
    out = fd.gather_unshard(out_local, dim=1, layout="zigzag")              # if you need it all

Modules, one job each:
    layout   contiguous / zigzag shards, their segments, shard/unshard helpers
    plan     which backend calls (with which windows) one ring step needs; empty blocks skipped
    ring     the asynchronous P2P send/receive of one step
    merge    folding partial (out, lse) results together
    engine   the forward and backward ring loops and their autograd.Function
    checks   group checks, and that every rank makes the same call
    api      the public functions
"""

from flashkit.distributed.api import ring_flash_attn_func, ring_flash_attn_varlen_func
from flashkit.distributed.layout import (
    gather_unshard,
    shard,
    shard_varlen,
    unshard,
    unshard_varlen,
)

__all__ = ["ring_flash_attn_func", "ring_flash_attn_varlen_func", "shard", "unshard",
           "gather_unshard", "shard_varlen", "unshard_varlen"]
