"""Padding helpers of flash-attn's `bert_padding`, in plain torch: move between padded
(batch, seqlen, ...) tensors and packed (total, ...) ones for the varlen functions.

`unpad_input` returns five values as flash-attn 2.8 does: (packed, indices, cu_seqlens,
max_seqlen, seqused).
"""

from __future__ import annotations

import torch

__all__ = ["index_first_axis", "index_put_first_axis", "unpad_indices", "unpad_input",
           "pad_input", "unpad_input_for_concatenated_sequences"]


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """input[indices] along dim 0: (first, ...) -> (len(indices), ...); differentiable (the
    gradient is scattered back to the selected rows)."""
    return input.index_select(0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor,
                         first_axis_dim: int) -> torch.Tensor:
    """A zero tensor (first_axis_dim, ...) with values[i] at row indices[i]; differentiable."""
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    return out.index_copy(0, indices, values)


def unpad_indices(attention_mask: torch.Tensor, unused_mask=None) -> tuple:
    """What unpad_input packs by: (indices (total,) of the selected tokens in the flattened
    (batch * seqlen) ones, cu_seqlens (batch + 1,) int32, max_seqlen int, seqused (batch,)
    int32), attention_mask and unused_mask as there. Reads the mask on the host (the number of
    selected tokens and the longest sequence): a device sync for a CUDA mask."""
    selected = attention_mask.bool() if unused_mask is None else \
        attention_mask.bool() | unused_mask.bool()
    seqlens = selected.sum(-1, dtype=torch.int32)
    seqused = attention_mask.bool().sum(-1, dtype=torch.int32)
    indices = torch.nonzero(selected.flatten()).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, int(seqlens.max()), seqused


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """Pack the tokens of hidden_states (batch, seqlen, ...) where attention_mask (batch,
    seqlen; nonzero = valid) or unused_mask (allocated but unused tokens) is set.

    Returns (packed (total, ...), indices (total,) into the flattened (batch * seqlen) tokens,
    cu_seqlens (batch + 1,) int32, max_seqlen int, seqused (batch,) int32: the valid tokens of
    each sequence, not counting unused ones).
    """
    indices, cu_seqlens, max_seqlen, seqused = unpad_indices(attention_mask, unused_mask)
    packed = index_first_axis(hidden_states.flatten(0, 1), indices)
    return packed, indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int,
              seqlen: int) -> torch.Tensor:
    """Inverse of unpad_input: packed (total, ...) -> (batch, seqlen, ...), zeros elsewhere."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.unflatten(0, (batch, seqlen))


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor,
                                           attention_mask_in_length: torch.Tensor):
    """Pack several short sequences concatenated in each row: attention_mask_in_length
    (batch, seqlen) holds, per row, the lengths of its sequences followed by zeros (e.g.
    [2, 3, 0, 0, 0, 0]: tokens 0-1 and 2-4 are two sequences, token 5 is padding).

    Returns (packed (total, ...), indices (total,), cu_seqlens (sequences + 1,) int32,
    max_seqlen int), each concatenated sequence its own varlen sequence.
    """
    lengths = attention_mask_in_length
    seqlen = lengths.shape[-1]
    filled = lengths.sum(-1)
    valid = torch.arange(seqlen, device=lengths.device) < filled[:, None]
    seqlens = lengths.flatten()[lengths.flatten() > 0].to(torch.int32)
    indices = torch.nonzero(valid.flatten()).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    packed = index_first_axis(hidden_states.flatten(0, 1), indices)
    return packed, indices, cu_seqlens, int(seqlens.max())
