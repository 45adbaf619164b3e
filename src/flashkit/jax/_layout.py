"""The folded GQA layout the XLA ports and the backward kernels work in, and back.

The `group = nheads // nheads_k` query heads that share a kv head are stacked into one
(group * seqlen_q)-row problem against that kv head: query head h = kv_head * group + g, position
i  ->  row g * seqlen_q + i of kv_head. dK/dV then sum over the group for free. Each fold is one
transpose (an HBM pass), which is why the forward kernels read the caller's layout instead.
"""

from __future__ import annotations


def fold_q(x, nheads_k: int):
    """(B, Sq, H, D) -> (B, Hk, group * Sq, D)."""
    batch, seqlen, nheads, d = x.shape
    group = nheads // nheads_k
    return (x.reshape(batch, seqlen, nheads_k, group, d).transpose(0, 2, 3, 1, 4)
            .reshape(batch, nheads_k, group * seqlen, d))


def unfold_q(x, seqlen: int):
    """(B, Hk, group * Sq, D) -> (B, Sq, H, D)."""
    batch, nheads_k, rows, d = x.shape
    group = rows // seqlen
    return (x.reshape(batch, nheads_k, group, seqlen, d).transpose(0, 3, 1, 2, 4)
            .reshape(batch, seqlen, nheads_k * group, d))


def fold_rows(x, nheads_k: int):
    """Per-row values (B, H, Sq) -> (B, Hk, group * Sq): a reshape, no data movement."""
    batch, nheads, seqlen = x.shape
    return x.reshape(batch, nheads_k, nheads // nheads_k * seqlen)


def swap_seq_heads(x):
    """(B, S, H, D) <-> (B, H, S, D), for k and v (group 1)."""
    return x.transpose(0, 2, 1, 3)
