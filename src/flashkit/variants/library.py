"""Built-in modifiers, each a few lines of Triton, and the examples the documentation shows.

Every function returns a ScoreMod or MaskMod ready for flash_attn_func(score_mod=...,
mask_mod=...) or create_block_mask. Indices follow FlexAttention: q_idx and kv_idx are positions
in the sequence (per sequence under varlen), b the batch entry (sequence), h the query head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashkit.ops.triton.common import interpreting, tanh_exact, tanh_hardware
from flashkit.variants.mods import TORCH_OVERRIDES, MaskMod, ScoreMod

# the interpreter runs no PTX: tanh_approx is the exact tanh there
_INTERPRETING = tl.constexpr(interpreting())


@triton.jit
def tanh(x):
    """tanh for modifiers, exact at both tails (the built-in softcap's for float32 inputs;
    torch side: torch.tanh)."""
    return tanh_exact(x)


@triton.jit
def tanh_approx(x):
    """The GPU's own tanh (relative error about 2^-11): one instruction where `tanh` takes an
    exp2 and a division, as the built-in softcap computes it for float16 and bfloat16 inputs,
    whose scores are rounded more coarsely than that. Too coarse for float32 inputs' accuracy.
    The interpreter and the torch backends compute the exact tanh."""
    if _INTERPRETING:
        return tanh_exact(x)
    else:
        return tanh_hardware(x)


TORCH_OVERRIDES[tanh.fn] = torch.tanh
TORCH_OVERRIDES[tanh_approx.fn] = torch.tanh


# --- masks ---------------------------------------------------------------------------------

@triton.jit
def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def causal_mask() -> MaskMod:
    """Top-left causal (key <= query position), as FlexAttention writes it."""
    return MaskMod(_causal)


@triton.jit
def _document(b, h, q_idx, kv_idx, doc, stride_b):
    return tl.load(doc + b * stride_b + q_idx) == tl.load(doc + b * stride_b + kv_idx)


@triton.jit
def _document_causal(b, h, q_idx, kv_idx, doc, stride_b):
    same = tl.load(doc + b * stride_b + q_idx) == tl.load(doc + b * stride_b + kv_idx)
    return same & (q_idx >= kv_idx)


def document_mask(document_ids: torch.Tensor, causal: bool = False) -> MaskMod:
    """Tokens see only tokens of their own document: document_ids int (seqlen,) shared by the
    batch or (batch, seqlen), one id per position (q and k share one packing)."""
    stride_b = 0 if document_ids.dim() == 1 else document_ids.stride(0)
    return MaskMod(_document_causal if causal else _document, document_ids.contiguous(), stride_b)


@triton.jit
def _prefix_lm(b, h, q_idx, kv_idx, prefix):
    return (kv_idx <= q_idx) | (kv_idx < tl.load(prefix + b))


def prefix_lm(prefix_lengths: torch.Tensor) -> MaskMod:
    """Bidirectional over each sequence's prefix, causal after it: int (batch,) lengths."""
    return MaskMod(_prefix_lm, prefix_lengths.contiguous())


# The windows compare each key with bounds of its query's row (q_idx - window, q_idx +
# window): in a kernel q_idx is a column [M, 1] and kv_idx a row [1, N], so the bounds cost M
# additions a tile and each pair one comparison, where |q_idx - kv_idx| <= window costs each
# pair a subtraction too. Windows are capped at 2^30, so for positions below 2^30 the bounds
# stay within int32.
_WINDOW_CAP = 1 << 30


@triton.jit
def _window_globals(b, h, q_idx, kv_idx, window, n_global):
    near = (kv_idx >= q_idx - window) & (kv_idx <= q_idx + window)
    return near | (q_idx < n_global) | (kv_idx < n_global)


def sliding_window_with_globals(window: int, n_global: int) -> MaskMod:
    """Longformer's pattern: keys within `window` positions either side, plus `n_global` global
    tokens at the start that see and are seen by every token."""
    return MaskMod(_window_globals, min(int(window), _WINDOW_CAP), int(n_global))


@triton.jit
def _causal_window(b, h, q_idx, kv_idx, window):
    return (kv_idx <= q_idx) & (kv_idx >= q_idx - window)


def causal_window(window: int) -> MaskMod:
    """Causal sliding window: key within `window` positions before the query (window_size=
    (window, 0) of the built-in band, for equal lengths)."""
    return MaskMod(_causal_window, min(int(window), _WINDOW_CAP))


# --- scores --------------------------------------------------------------------------------

@triton.jit
def _alibi_distance(q_idx, kv_idx, shift):
    # |q_idx + shift - kv_idx| in float32, the positions converted first: in a kernel q_idx is a
    # column [M, 1] and kv_idx a row [1, N], so that is M + N conversions a tile, not M * N
    # (the hardware converts at the exp2's rate). Exact for positions below 2^24.
    return tl.abs((q_idx + shift).to(tl.float32) - kv_idx.to(tl.float32))


@triton.jit
def _alibi(score, b, h, q_idx, kv_idx, slopes, shift):
    return score - tl.load(slopes + h) * _alibi_distance(q_idx, kv_idx, shift)


@triton.jit
def _alibi_grad(score, b, h, q_idx, kv_idx, slopes, shift):
    return 1.0


@triton.jit
def _alibi_captured_grad(ds, score, b, h, q_idx, kv_idx, slopes, shift, dslopes, dshift):
    # one head per tile: reduce the tile first, one atomic add instead of one per score
    distance = _alibi_distance(q_idx, kv_idx, shift)
    tl.atomic_add(dslopes + h, -tl.sum(tl.sum(ds * distance, 1), 0))


def alibi(slopes: torch.Tensor, shift: int = 0) -> ScoreMod:
    """ALiBi as a score_mod: score - slope_h |q_idx + shift - kv_idx| (shift = seqlen_k -
    seqlen_q puts the diagonal where alibi_slopes= does); slopes float32 (nheads,), learnable
    (requires_grad) on every backend."""
    return ScoreMod(_alibi, slopes.contiguous(), int(shift), grad=_alibi_grad,
                    captured_grad=_alibi_captured_grad)


@triton.jit
def _capped_tanh(score, cap, APPROX: tl.constexpr):
    # score * (1 / cap): one reciprocal a tile, where score / cap divides every score
    if APPROX:
        return tanh_approx(score * (1.0 / cap))
    else:
        return tanh(score * (1.0 / cap))


@triton.jit
def _softcap(score, b, h, q_idx, kv_idx, cap):
    return cap * _capped_tanh(score, cap, False)


@triton.jit
def _softcap_approx(score, b, h, q_idx, kv_idx, cap):
    return cap * _capped_tanh(score, cap, True)


@triton.jit
def _softcap_grad(score, b, h, q_idx, kv_idx, cap):
    t = _capped_tanh(score, cap, False)
    return 1.0 - t * t


@triton.jit
def _softcap_approx_grad(score, b, h, q_idx, kv_idx, cap):
    t = _capped_tanh(score, cap, True)
    return 1.0 - t * t


class _Softcap(ScoreMod):
    """softcap(cap)'s default: the exact tanh for float32 inputs, the GPU's own (tanh_approx)
    for float16 and bfloat16 ones, as softcap= chooses."""

    def __init__(self, cap: float):
        super().__init__(_softcap, cap, grad=_softcap_grad, bound=cap)
        self._half = softcap(cap, approx=True)

    def for_dtype(self, dtype: torch.dtype) -> ScoreMod:
        return self._half if dtype in (torch.float16, torch.bfloat16) else self


def softcap(cap: float, approx: bool | None = None) -> ScoreMod:
    """Tanh soft-capping as a score_mod: cap * tanh(score / cap) (softcap= built in), bounded
    by cap (ScoreMod's bound). approx=None takes the tanh softcap= takes: the GPU's own
    (tanh_approx, relative error about 2^-11) for float16 and bfloat16 inputs, the exact one
    for float32 inputs. approx=True takes the GPU's tanh for every dtype (too coarse for
    float32 inputs), approx=False the exact one for every dtype."""
    cap = float(cap)
    if approx is None:
        return _Softcap(cap)
    if approx:
        return ScoreMod(_softcap_approx, cap, grad=_softcap_approx_grad, bound=cap)
    return ScoreMod(_softcap, cap, grad=_softcap_grad, bound=cap)


@triton.jit
def _relative_bias(score, b, h, q_idx, kv_idx, table, max_distance):
    distance = tl.minimum(tl.maximum(kv_idx - q_idx, -max_distance), max_distance)
    return score + tl.load(table + h * (2 * max_distance + 1) + distance + max_distance)


@triton.jit
def _bias_grad(score, b, h, q_idx, kv_idx, bias, extent):
    return 1.0  # any additive bias


@triton.jit
def _relative_bias_captured_grad(ds, score, b, h, q_idx, kv_idx, table, max_distance, dtable,
                                 dmax_distance):
    distance = tl.minimum(tl.maximum(kv_idx - q_idx, -max_distance), max_distance)
    row = dtable + h * (2 * max_distance + 1) + max_distance
    nearest = tl.min(tl.min(distance, 1), 0)
    if nearest == tl.max(tl.max(distance, 1), 0):
        # a tile past max_distance from the diagonal reads one entry (most tiles of a long
        # sequence): one atomic add of its sum instead of one per score on one address
        tl.atomic_add(row + nearest, tl.sum(tl.sum(ds, 1), 0))
    else:
        tl.atomic_add(row + distance, ds, mask=ds != 0.0)  # masked pairs add nothing


def relative_bias(table: torch.Tensor) -> ScoreMod:
    """A learned bias per head and clipped relative position (T5-style without buckets):
    table (nheads, 2 * max_distance + 1), entry [h, clamp(kv - q, -M, M) + M]. Its gradient
    flows back to the table on every backend."""
    return ScoreMod(_relative_bias, table, (table.shape[-1] - 1) // 2, grad=_bias_grad,
                    captured_grad=_relative_bias_captured_grad)


@triton.jit
def _token_bias(score, b, h, q_idx, kv_idx, bias, stride_b):
    return score + tl.load(bias + b * stride_b + kv_idx)


@triton.jit
def _token_bias_captured_grad(ds, score, b, h, q_idx, kv_idx, bias, stride_b, dbias,
                              dstride_b):
    # rows of ds are queries: sum them first, one atomic add per key instead of per score
    tl.atomic_add(dbias + b * stride_b + kv_idx, tl.sum(ds, 0, keep_dims=True))


def token_bias(bias: torch.Tensor) -> ScoreMod:
    """A bias per key token, shared by every query and head: bias (seqlen_k,) shared by the
    batch or (batch, seqlen_k) (a learned memory-token or padding bias); its gradient flows back
    to it on every backend."""
    stride_b = 0 if bias.dim() == 1 else bias.stride(0)
    return ScoreMod(_token_bias, bias, stride_b, grad=_bias_grad,
                    captured_grad=_token_bias_captured_grad)
