"""Block sparsity: which (query block, key block) tiles a mask_mod leaves empty, partial or full.

Kernels skip empty tiles, run the elementwise mask only on partial ones and skip it on full ones
(FlexAttention's full and partial blocks). Layouts, with nQ = ceil(Q_LEN / BLOCK_SIZE[0]) and
nK = ceil(KV_LEN / BLOCK_SIZE[1]), B and H either the call's or 1 (broadcast):

    kv_num_blocks, full_kv_num_blocks    int32 (B, H, nQ)      partial / full key blocks per row
    kv_indices, full_kv_indices          int32 (B, H, nQ, nK)  those blocks first, ascending
    q_num_blocks, full_q_num_blocks      int32 (B, H, nK)      the transpose, for the backward
    q_indices, full_q_indices            int32 (B, H, nK, nQ)

A block that runs past KV_LEN or Q_LEN is never full (its missing keys or queries are masked),
so a full tile needs neither the mask nor a bounds check, forward or backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashkit.variants.mods import MaskMod, mask_mod_of

# Elements of the boolean mask evaluated at once (a chunk of query blocks): 64 Mi bools.
_CHUNK_ELEMENTS = 1 << 26


@dataclass(frozen=True, eq=False)
class BlockMask:
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    full_q_num_blocks: torch.Tensor
    full_q_indices: torch.Tensor
    BLOCK_SIZE: tuple[int, int]
    seq_lengths: tuple[int, int]
    mask_mod: MaskMod

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, H, Q_LEN, KV_LEN); B or H is 1 where the mask broadcasts over it."""
        return (*self.kv_num_blocks.shape[:2], *self.seq_lengths)

    def to_dense(self) -> torch.Tensor:
        """int8 (B, H, nQ, nK): 0 empty, 1 partial, 2 full (for tests and inspection)."""
        n_k = self.kv_indices.shape[-1]
        dense = torch.zeros(*self.kv_num_blocks.shape, n_k, dtype=torch.int8,
                            device=self.kv_indices.device)
        for num, idx, value in ((self.kv_num_blocks, self.kv_indices, 1),
                                (self.full_kv_num_blocks, self.full_kv_indices, 2)):
            listed = torch.arange(n_k, device=idx.device) < num[..., None]
            dense.scatter_add_(-1, idx.long(), torch.where(listed, value, 0).to(torch.int8))
        return dense

    def sparsity(self) -> float:
        """Fraction of tiles skipped."""
        n_k = self.kv_indices.shape[-1]
        seen = (self.kv_num_blocks + self.full_kv_num_blocks).sum().item()
        return 1.0 - seen / (self.kv_num_blocks.numel() * n_k)

    def check(self, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, device) -> None:
        """ValueError naming block_mask when it was built for another problem."""
        b, h = self.kv_num_blocks.shape[:2]
        if b not in (1, batch) or h not in (1, nheads):
            raise ValueError(f"block_mask: built for B={b}, H={h}; the call has batch {batch}, "
                             f"nheads {nheads} (B and H may also be 1)")
        if self.seq_lengths != (seqlen_q, seqlen_k):
            raise ValueError(f"block_mask: built for (Q_LEN, KV_LEN) = {self.seq_lengths}, the "
                             f"call has ({seqlen_q}, {seqlen_k})")
        if self.kv_indices.device != device:
            raise ValueError(f"block_mask: on {self.kv_indices.device}, q on {device}")


def create_block_mask(mask_mod, B, H, Q_LEN: int, KV_LEN: int, device="cuda",
                      BLOCK_SIZE: int | tuple[int, int] = 128) -> BlockMask:
    """The BlockMask of mask_mod (a function or flashkit.MaskMod) over B x H x Q_LEN x KV_LEN.

    B or H None (or 1) builds one mask shared by every batch entry or head. Evaluated on
    `device`, vectorised over chunks of query blocks (no Python loop over blocks).
    BLOCK_SIZE (query, key) tiles, powers of two >= 16 (kernels' tiles must divide them).
    """
    mod = mask_mod_of(mask_mod)
    if mod is None:
        raise TypeError("mask_mod: create_block_mask needs a mask function")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    mod.check(device)
    bs_q, bs_k = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    for name, bs in (("BLOCK_SIZE", bs_q), ("BLOCK_SIZE", bs_k)):
        if not isinstance(bs, int) or bs < 16 or bs & (bs - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, got {bs}")
    B, H = B or 1, H or 1
    for name, n in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}: expected a positive int, got {n!r}")
    n_q, n_k = -(-Q_LEN // bs_q), -(-KV_LEN // bs_k)
    twin = mod.twin(torch.float32, device)
    captured = mod.torch_captured()

    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    j = torch.arange(n_k * bs_k, device=device)
    col_ok = j < KV_LEN
    j = j.clamp(max=KV_LEN - 1)[None, :]  # the mask is evaluated in range only
    rows = max(1, _CHUNK_ELEMENTS // (B * H * bs_q * n_k * bs_k))
    partial, full = [], []
    for r0 in range(0, n_q, rows):
        r1 = min(r0 + rows, n_q)
        i = torch.arange(r0 * bs_q, r1 * bs_q, device=device)
        row_ok = i < Q_LEN
        keep = twin(b, h, i.clamp(max=Q_LEN - 1)[:, None], j, *captured)
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
            raise TypeError("mask_mod: must return a bool (True = visible)")
        keep = torch.broadcast_to(keep, (B, H, i.numel(), j.numel()))
        blocks = (B, H, r1 - r0, bs_q, n_k, bs_k)
        seen = (keep & row_ok[:, None] & col_ok[None, :]).view(blocks).any(5).any(3)
        every = (keep & row_ok[:, None] & col_ok[None, :]).view(blocks).all(5).all(3)
        full.append(every)
        partial.append(seen & ~every)
    partial, full = torch.cat(partial, 2), torch.cat(full, 2)  # (B, H, nQ, nK)
    return BlockMask(*_lists(partial), *_lists(full), *_lists(partial.transpose(-1, -2)),
                     *_lists(full.transpose(-1, -2)), BLOCK_SIZE=(bs_q, bs_k),
                     seq_lengths=(Q_LEN, KV_LEN), mask_mod=mod)


def _lists(blocks: torch.Tensor):
    """(count, indices) of the True blocks along the last dim, listed first in ascending order."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count.contiguous(), order.contiguous()
