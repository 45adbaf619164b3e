"""flash-attn's `apply_rotary_emb`, on flashkit's rotary helper (float32 arithmetic, one
rounding, as flash-attn's kernel)."""

from __future__ import annotations

import numbers

import torch

from flashkit.ops.tiled.kvcache import rotary

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func"]


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                     cu_seqlens=None, max_seqlen=None):
    """Rotate the first rotary_dim = 2 * cos.shape[1] dims of x by cos/sin (seqlen_ro,
    rotary_dim / 2); differentiable in x.

    x: (batch, seqlen, nheads, headdim), or (total, nheads, headdim) packed with cu_seqlens
    (batch + 1,) and max_seqlen. Token t of sequence b is rotated at position
    seqlen_offsets[b] + t (seqlen_offsets an int or a (batch,) integer tensor). interleaved pairs
    dims (0, 1), (2, 3)... (GPT-J), else (i, i + rotary_dim / 2) (GPT-NeoX). inplace writes the
    result into x and returns x.
    """
    if cos.dim() != 2 or sin.shape != cos.shape:
        raise ValueError(f"cos, sin: expected equal shapes (seqlen_ro, rotary_dim / 2), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if 2 * cos.shape[1] > x.shape[-1]:
        raise ValueError(f"cos: rotary_dim = {2 * cos.shape[1]} exceeds headdim {x.shape[-1]}")
    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        t = torch.arange(seqlen, device=device).expand(batch, seqlen)
        seq = torch.arange(batch, device=device)[:, None].expand(batch, seqlen)
        x4 = x
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        seq = torch.repeat_interleave(torch.arange(lengths.shape[0], device=device), lengths,
                                      output_size=x.shape[0])
        t = (torch.arange(x.shape[0], device=device) - cu_seqlens.long()[seq])[None]
        seq = seq[None]
        x4 = x[None]  # (1, total, nheads, headdim)
    if isinstance(seqlen_offsets, numbers.Integral):
        positions = t + int(seqlen_offsets)
    else:
        positions = t + seqlen_offsets.to(device).long()[seq]
    if positions.numel() and int(positions.max()) >= cos.shape[0]:
        raise ValueError(f"cos: {cos.shape[0]} positions (seqlen_ro), but position "
                         f"{int(positions.max())} is rotated")
    out = rotary(x4, cos, sin, positions, interleaved)
    out = out if cu_seqlens is None else out[0]
    if inplace:
        return x.copy_(out)
    return out


# flash-attn's older name for the same function
apply_rotary_emb_func = apply_rotary_emb
