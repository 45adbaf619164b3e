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

Blocks larger than 64 tokens also get the same lists at 64-token blocks (`fine`, a BlockMask of
its own; 4x the lists' memory at 128-token blocks): kernels whose tiles are that small (the
backward's on sm_90) walk those, and so skip the empty quarter of a partial 128-block and
leave its full quarters unmasked (a causal block's upper and lower quarter).

Varlen (create_block_mask(..., cu_seqlens_q=, cu_seqlens_k=)): the blocks run over the packed
token axes (Q_LEN and KV_LEN are the total token counts, B is 1), as FlexAttention's document
masking over a packed batch; a pair is visible when both tokens are in the same sequence and
mask_mod says so at (the sequence, the positions within it), as mask_mod means under varlen
everywhere. The Triton kernels run such a call as one sequence of the packed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashkit.variants.mods import MaskMod, mask_mod_of

# Elements of the boolean mask evaluated at once (a chunk of query blocks): 64 Mi bools.
_CHUNK_ELEMENTS = 1 << 26
_FINE = 64  # the block size of a mask's `fine` lists (the sm_90 backward's tiles at d128)


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
    # varlen: (seq_q, cu_seqlens_q, cu_seqlens_k), seq_q int32 (Q_LEN,) the sequence of every
    # packed query token; None for a mask over padded (batch, length) positions
    packing: tuple | None = None
    # varlen: the version counters of packing's cu_seqlens_q and _k when the mask was built
    # over them (None for an inference tensor, which has none): a write in place since would
    # leave the blocks stale
    packed_versions: tuple | None = None
    # the same mask at 64-token blocks where BLOCK_SIZE is larger (else None)
    fine: BlockMask | None = None
    # the checked params of calls with this mask (mods.kept_params)
    _kept_calls: dict = field(default_factory=dict, init=False, repr=False)

    def finest(self, rows: int, keys: int) -> BlockMask:
        """The finest of this mask and its `fine` one whose blocks hold whole tiles of `rows`
        queries and `keys` keys (this one is the caller's to check)."""
        fine = self.fine
        if fine is not None and fine.BLOCK_SIZE[0] % rows == 0 and fine.BLOCK_SIZE[1] % keys == 0:
            return fine
        return self

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

    def check_packing(self, total_q: int, nheads: int, cu_seqlens_q, cu_seqlens_k) -> None:
        """ValueError naming block_mask unless it was built over these packed sequences (the
        same cu_seqlens tensors cost nothing; equal copies are compared, one device sync)."""
        if self.packing is None:
            raise ValueError("block_mask: a varlen call needs a block mask over the packed "
                             "tokens: create_block_mask(..., cu_seqlens_q=, cu_seqlens_k=)")
        for name, mine, version, call in zip(
                ("cu_seqlens_q", "cu_seqlens_k"), self.packing[1:],
                self.packed_versions or (None, None), (cu_seqlens_q, cu_seqlens_k), strict=True):
            if version is not None and mine._version != version:
                raise ValueError(f"block_mask: built over a {name} written in place since; "
                                 "build the mask again over the new sequences")
            if mine is not call and (mine.shape != call.shape or mine.device != call.device
                                     or not torch.equal(mine, call)):
                raise ValueError(f"block_mask: built for other sequences than the call's {name}")
        if self.seq_lengths[0] != total_q:
            raise ValueError(f"block_mask: built for {self.seq_lengths[0]} packed query "
                             f"tokens, the call has {total_q}")
        if self.kv_num_blocks.shape[1] not in (1, nheads):
            raise ValueError(f"block_mask: built for H={self.kv_num_blocks.shape[1]}, the call "
                             f"has nheads {nheads} (H may also be 1)")

    def check(self, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, device) -> None:
        """ValueError naming block_mask when it was built for another problem."""
        if self.packing is not None:
            raise ValueError("block_mask: built over packed sequences (cu_seqlens); pass it to "
                             "flash_attn_varlen_func")
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
                      BLOCK_SIZE: int | tuple[int, int] = 128, cu_seqlens_q=None,
                      cu_seqlens_k=None) -> BlockMask:
    """The BlockMask of mask_mod (a function or flashkit.MaskMod) over B x H x Q_LEN x KV_LEN.

    B or H None (or 1) builds one mask shared by every batch entry or head. Evaluated on
    `device`, vectorised over chunks of query blocks (no Python loop over blocks).
    BLOCK_SIZE (query, key) tiles, powers of two >= 16 (kernels' tiles must divide them).
    cu_seqlens_q, cu_seqlens_k (int32, for flash_attn_varlen_func): a mask over the packed
    tokens, Q_LEN and KV_LEN their totals, B None or 1; mask_mod sees each sequence's index and
    positions within it, and tokens of different sequences never see each other.
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
    packing = None
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        packing = _packing(cu_seqlens_q, cu_seqlens_k, B, Q_LEN, KV_LEN, device)

    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    j = torch.arange(n_k * bs_k, device=device)
    col_ok = j < KV_LEN
    j = j.clamp(max=KV_LEN - 1)[None, :]  # the mask is evaluated in range only
    # classified at the fine blocks (at most 64 tokens), the coarse ones reduced from them
    fine_q, fine_k = min(bs_q, _FINE), min(bs_k, _FINE)
    rows = max(1, _CHUNK_ELEMENTS // (B * H * bs_q * n_k * bs_k))
    partial, full = [], []
    for r0 in range(0, n_q, rows):
        r1 = min(r0 + rows, n_q)
        i = torch.arange(r0 * bs_q, r1 * bs_q, device=device)
        row_ok = i < Q_LEN
        i = i.clamp(max=Q_LEN - 1)[:, None]
        if packing is None:
            keep = twin(b, h, i, j, *captured)
        else:
            keep = _packed_keep(twin, captured, packing, h, i, j)
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
            raise TypeError("mask_mod: must return a bool (True = visible)")
        keep = torch.broadcast_to(keep, (B, H, row_ok.numel(), j.numel()))
        keep = (keep & row_ok[:, None] & col_ok[None, :]).view(
            B, H, (r1 - r0) * bs_q // fine_q, fine_q, n_k * bs_k // fine_k, fine_k)
        every = keep.all(5).all(3)
        full.append(every)
        partial.append(keep.any(5).any(3) & ~every)
    partial, full = torch.cat(partial, 2), torch.cat(full, 2)  # fine blocks (B, H, rows, cols)
    versions = None if packing is None else tuple(
        None if cu.is_inference() else cu._version for cu in packing[1:])
    masks = {}
    for size in dict.fromkeys(((fine_q, fine_k), (bs_q, bs_k))):  # the fine mask first
        q_per, k_per = size[0] // fine_q, size[1] // fine_k
        grouped = (B, H, n_q * bs_q // size[0], q_per, n_k * bs_k // size[1], k_per)
        every = full.view(grouped).all(5).all(3)
        seen = (partial | full).view(grouped).any(5).any(3)
        some = seen & ~every
        n_rows, n_cols = -(-Q_LEN // size[0]), -(-KV_LEN // size[1])  # the blocks in range
        some, every = some[:, :, :n_rows, :n_cols], every[:, :, :n_rows, :n_cols]
        masks[size] = BlockMask(
            *_lists(some), *_lists(every), *_lists(some.transpose(-1, -2)),
            *_lists(every.transpose(-1, -2)), BLOCK_SIZE=size, seq_lengths=(Q_LEN, KV_LEN),
            mask_mod=mod, packing=packing, packed_versions=versions,
            fine=None if size == (fine_q, fine_k) else masks[(fine_q, fine_k)])
    return masks[(bs_q, bs_k)]


def _packing(cu_q, cu_k, B: int, Q_LEN: int, KV_LEN: int, device) -> tuple:
    """(seq_q, cu_q, cu_k) of a mask over packed tokens, checked (reads cu_seqlens once)."""
    for name, cu, total in (("cu_seqlens_q", cu_q, Q_LEN), ("cu_seqlens_k", cu_k, KV_LEN)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1:
            raise TypeError(f"{name}: expected an int32 (batch + 1,) tensor with its partner")
        if cu.device != device:
            raise ValueError(f"{name}: on {cu.device}, the mask is built on {device}")
        if int(cu[-1]) != total or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"{name}: must rise from 0 to the packed total {total}")
    if cu_q.shape != cu_k.shape:
        raise ValueError("cu_seqlens_k: must have as many sequences as cu_seqlens_q")
    if B != 1:
        raise ValueError(f"B: a mask over packed sequences has B None or 1, got {B}")
    counts = (cu_q[1:] - cu_q[:-1]).long()
    seq_q = torch.repeat_interleave(torch.arange(counts.numel(), device=device,
                                                 dtype=torch.int32), counts,
                                    output_size=Q_LEN)
    return seq_q, cu_q, cu_k


def _packed_keep(twin, captured, packing, h, i, j):
    """mask_mod over packed tokens i (rows, 1), j (1, cols): at the query's sequence and the
    positions within it (the key's clamped into that sequence), and only within it."""
    seq_q, cu_q, cu_k = packing
    b = seq_q[i.squeeze(1)].long()[:, None]
    q_start, k_start = cu_q[b].long(), cu_k[b].long()
    k_len = cu_k[b + 1].long() - k_start
    same = (j >= k_start) & (j < k_start + k_len)
    kv_idx = torch.minimum((j - k_start).clamp(min=0), (k_len - 1).clamp(min=0))
    return same & twin(b[None, None], h, i - q_start, kv_idx, *captured)


def _lists(blocks: torch.Tensor):
    """(count, indices) of the True blocks along the last dim, listed first in ascending order."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count.contiguous(), order.contiguous()
