"""What every backend is told about one attention call, already validated by the API layer.

A backend is a module with three functions:

    forward(q, k, v, params)                              -> (out, lse)
    backward(dout, q, k, v, out, lse, params)             -> (dq, dk, dv, dsink)
    kvcache_attention(q, k_cache, v_cache, cache, params) -> (out, lse)   cache: KVCacheArgs

backward also takes, by keyword, dlse (a gradient on lse), own_lse=False (lse is one over more
keys than the call's: ring attention's merged lse) and grad_dtype (dq, dk, dv in that dtype,
not the inputs': ring attention sums its steps' gradients in float32).

Layouts (flash-attn): dense q (batch, seqlen_q, nheads, d), k/v (batch, seqlen_k, nheads_k, d[_v]),
out like q with d_v, in q's dtype, lse (batch, nheads, seqlen_q) float32
(float64 for float64 inputs).
Varlen (params.cu_seqlens_q is set): q (total_q, nheads, d), k/v (total_k, nheads_k, d), lse
(nheads, total_q). dsink is None when
there is no sink.

The visible band is given relative to the bottom-right aligned diagonal (docs/design.md section
1): with shift = seqlen_k - seqlen_q, key j is visible from query i iff
    i + shift - window_left <= j <= i + shift + window_right,
where None means unbounded on that side. Causal is window_right = 0. The SDPA entry point's
top-left causal is window_right = seqlen_q - seqlen_k, which is why "unbounded" is None and not -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def lse_shape(q: torch.Tensor, params: AttentionParams) -> tuple[int, ...]:
    """The lse's shape for queries q: (batch, nheads, seqlen_q), varlen (nheads, total_q)."""
    return (q.shape[1], q.shape[0]) if params.is_varlen else (q.shape[0], q.shape[2], q.shape[1])


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' arithmetic and lse dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# The built-in score modifiers among AttentionParams' fields (docs/extending.md): the scalar
# ones and the tensor ones. What keys on a call's features (a dispatch plan) reads them by name.
SCORE_SCALARS = ("softcap",)
SCORE_TENSORS = ("alibi_slopes",)


@dataclass(frozen=True)
class AttentionParams:
    softmax_scale: float
    window_left: int | None = None
    window_right: int | None = None
    softcap: float = 0.0  # 0 = off; else s = softcap * tanh(s / softcap)
    alibi_slopes: torch.Tensor | None = None  # float32 (nheads,) or (batch, nheads)
    sink: torch.Tensor | None = None  # (nheads,) learnable logit, one per query head
    attn_bias: torch.Tensor | None = None  # SDPA attn_mask as an additive float bias, 4-D
    dropout_p: float = 0.0
    dropout_seed: int = 0  # with (batch, head, i, j) it fixes the keep-mask
    cu_seqlens_q: torch.Tensor | None = None  # int32 (batch + 1,): varlen when set
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    deterministic: bool = False
    # flashkit.variants.mods.Variant: user score/mask modifiers and a block mask, or None. Not a
    # custom-op argument (Python functions): calls with one take flashkit.variants.autograd.
    variant: object | None = None

    @property
    def causal(self) -> bool:
        """Bottom-right causal with no left limit: the common case kernels specialise on."""
        return self.window_left is None and self.window_right == 0

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None


@dataclass(frozen=True)
class KVCacheArgs:
    """One flash_attn_with_kvcache call's cache arguments, checked (flashkit.checks.kvcache_*).

    k, v (batch, seqlen_new, nheads_k, d) or None: appended in place at slots cache_seqlens ..
    before attention. cache_seqlens: int32 (batch,) on q's device, or None when host_seqlen
    (an int, the same for every sequence) is given instead. cache_batch_idx, cache_leftpad:
    int32 (batch,) or None (rows 0..batch-1, no padding); block_table int32 (batch, pages) or
    None (contiguous). rotary_cos/sin (seqlen_ro, rotary_dim / 2) or None. q_rows: how many
    query rows take consecutive rotary positions (the rest share the last). capacity: slots per
    sequence; max_seqlen_k: a bound on any sequence's key count (the split heuristic's).
    num_splits: key chunks per sequence, 0 = the backend chooses. host_checked: the index
    values were read and checked on the host.
    """
    k: torch.Tensor | None
    v: torch.Tensor | None
    rotary_cos: torch.Tensor | None
    rotary_sin: torch.Tensor | None
    rotary_interleaved: bool
    cache_seqlens: torch.Tensor | None
    host_seqlen: int | None
    cache_batch_idx: torch.Tensor | None
    cache_leftpad: torch.Tensor | None
    block_table: torch.Tensor | None
    q_rows: int
    capacity: int
    max_seqlen_k: int
    num_splits: int
    host_checked: bool

    @property
    def seqlen_new(self) -> int:
        return 0 if self.k is None else self.k.shape[1]
