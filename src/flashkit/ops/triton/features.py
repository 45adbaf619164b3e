"""AttentionParams as kernel arguments, once for every launcher of the Triton backend.

Every launcher (forward.py, backward.py, forward_hopper.py, backward_hopper.py, decode.py,
forward_fp8.py) calls `kernel_features` once and passes its fields through: the runtime
values in the groups the kernels' signatures list them in, and the compile-time flags under
one vocabulary (FLAGS), in one order:

    HAS_LEFT, HAS_RIGHT  the band has a left / right edge (causal: right = 0)
    SCORES               the built-in score modifiers, a tuple (SOFTCAP, ALIBI):
                           SOFTCAP  0, SOFTCAP_EXACT or SOFTCAP_FAST (common.scores)
                           ALIBI    ALiBi slopes are read (common.alibi_bias)
    SINK                 a sink logit starts every row (common.softmax_start)
    DROPOUT              the keep-mask is drawn (dropout.dropout_keep)
    VARLEN               packed sequences, cu_seqlens read (common.sequence)

The score modifiers travel as three bundles that the kernels hand unopened to common.py
(`load_score_mods`, then `score_mod`): the flags SCORES, their runtime values
(`score_values`) and their tensors (`score_tensors`). A new score modifier adds its flag and
values here and its math in common.py; the kernels and their launchers do not change, but for
the Gluon forward's, which specialises on each modifier (docs/extending.md).

A kernel that does not take a feature leaves its flag out (kernel_features' `flags`): the
backward kernels take no SINK (GRADIENT_FLAGS: the sink enters their math through lse alone),
the decode and FP8 kernels no DROPOUT or VARLEN (DENSE_FLAGS: their callers refuse both before
this point). A new feature of another kind adds its field and its flag here and in the
kernels' signatures; the launchers pass it on unchanged.

Host cost matters here (the eager path is measured in microseconds per call): one function,
one NamedTuple, no dataclasses.replace.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from flashkit.ops.params import AttentionParams
from flashkit.ops.triton.common import (
    LOG2E,
    SOFTCAP_EXACT,
    SOFTCAP_FAST,
    interpreting,
)
from flashkit.ops.triton.dropout import dropout_args

FLAGS = ("HAS_LEFT", "HAS_RIGHT", "SCORES", "SINK", "DROPOUT", "VARLEN")
GRADIENT_FLAGS = ("HAS_LEFT", "HAS_RIGHT", "SCORES", "DROPOUT", "VARLEN")
DENSE_FLAGS = ("HAS_LEFT", "HAS_RIGHT", "SCORES", "SINK")
SEED = ("seed_lo", "seed_hi")  # the kernels' dropout seed parameters (dropout_seed)
_NO_DROPOUT = dropout_args(0.0, 0)
_FLOAT32, _HALF = torch.float32, (torch.float16, torch.bfloat16)


class KernelFeatures(NamedTuple):
    """One call's features as the kernels take them.

    batch, seqlen_q, seqlen_k, nheads, nheads_k: the grid's view of the problem (varlen: the
        number of sequences and the longest lengths; decode: the cache's capacity as seqlen_k);
        head_dim, head_dim_v: q's and v's last dims.
    band: (seqlen_q, seqlen_k, window_left, window_right), the kernels' `band` (common.visible,
        common.score_mod). A side that reaches every key from every row is passed as unbounded
        (its flag off): left >= seqlen_k - 1 puts i + shift - left <= 0, right >= seqlen_q - 1
        puts i + shift + right >= seqlen_k - 1. The same visible set, and the kernels'
        band-edge sums (start + BLOCK + shift + window, int32) stay far from overflow:
        window_size=(-1, 2**31 - 1), a common spelling of "unbounded", is then exactly that.
    score_values: the score modifiers' runtime values, (qk_scale, softcap_scale, stride_ab,
        stride_ah) as common.load_score_mods takes them. (qk_scale, softcap_scale) for
        common.scores: softcap c > 0 gives (c * u, scale / c), else (scale * u, 1.0), with
        u = log2(e), or 1 in natural units (fp32 inputs: NATURAL in common.py's notation);
        (stride_ab, stride_ah): the ALiBi slopes' (batch, head) strides (batch stride 0 for
        one row of slopes; (0, 0) without ALiBi).
    score_tensors: the score modifiers' tensors, (alibi,): the float32 slopes (nheads,) or
        (batch, nheads), the placeholder without ALiBi.
    sink: the sink logits (nheads,) in float32 (as given with float32_sink=False); without one
        the placeholder.
    dropout: (seed_lo, seed_hi, dropout_threshold, dropout_scale) (dropout.dropout_args).
    cu_seqlens: (Cu_q, Cu_k), or the placeholder twice when dense; varlen: whether packed.
    flags: the constexpr flags the kernel takes (kernel_features' `flags`) by name, in FLAGS'
        order: a dict of this call's own, which a launcher may specialise further.
    """
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    head_dim_v: int
    band: tuple
    score_values: tuple
    score_tensors: tuple
    sink: torch.Tensor
    dropout: tuple
    cu_seqlens: tuple
    varlen: bool
    flags: dict

    def strides(self, x: torch.Tensor) -> tuple:
        """x's strides with a leading batch stride: varlen tensors (total, ...) get batch
        stride 0, since each sequence's first row is added to the base pointer instead."""
        return (0, *x.stride()) if self.varlen else x.stride()


def kernel_features(params: AttentionParams, q: torch.Tensor, v: torch.Tensor, placeholder,
                    dtype: torch.dtype | None = None, seqlen_k: int | None = None,
                    float32_sink: bool = True, flags: tuple = FLAGS) -> KernelFeatures:
    """The features of one call (KernelFeatures). q, v: the call's query and value tensors,
    dense (batch, seqlen, heads, d) or packed (total, heads, d), or a decode call's q and value
    cache (rows | pages, slots, heads_k, d) with seqlen_k its capacity. placeholder: a tensor
    standing in for absent pointer arguments (never read). dtype: the inputs' dtype, which
    picks the score units and the softcap's tanh (SOFTCAP_FAST for fp16/bf16 on a GPU: the
    hardware's tanh.approx.f32, relative error 2^-11, below those dtypes' own rounding);
    None: log2 units and the exact tanh (kernels whose scores are fp32 whatever the inputs).
    float32_sink=False passes the sink as given (the decode kernel converts it as it loads it,
    so a bf16 sink costs a decoding step no cast). flags: the flags the kernel takes, FLAGS,
    GRADIENT_FLAGS or DENSE_FLAGS."""
    cu_q = params.cu_seqlens_q
    if cu_q is not None:
        varlen = True
        batch, seqlen_q, keys = cu_q.numel() - 1, params.max_seqlen_q, params.max_seqlen_k
        _, nheads, head_dim = q.shape
        _, nheads_k, head_dim_v = v.shape
    else:  # unpacked at once: each .shape builds a torch.Size, each [i] reads one
        varlen = False
        batch, seqlen_q, nheads, head_dim = q.shape
        _, keys, nheads_k, head_dim_v = v.shape
    if seqlen_k is None:
        seqlen_k = keys

    left = params.window_left if cuts_left(params, seqlen_k) else None
    right = params.window_right
    if right is not None and right >= seqlen_q - 1:
        right = None

    units = 1.0 if dtype is _FLOAT32 else LOG2E  # fp32 inputs: natural units (NATURAL)
    cap = params.softcap
    if cap > 0:
        fast = dtype in _HALF and not interpreting()
        qk_scale, softcap_scale = cap * units, params.softmax_scale / cap
        softcap = SOFTCAP_FAST if fast else SOFTCAP_EXACT
    else:
        qk_scale, softcap_scale, softcap = params.softmax_scale * units, 1.0, 0

    slopes = params.alibi_slopes  # float32 (checks.alibi_slopes)
    alibi_strides = ((0, 0) if slopes is None else
                     (0, slopes.stride(0)) if slopes.dim() == 1 else slopes.stride())
    score_tensors, sink, cu_q, cu_k = feature_tensors(params, placeholder, float32_sink)

    dropout = (dropout_args(params.dropout_p, params.dropout_seed) if params.dropout_p > 0
               else _NO_DROPOUT)
    values = {"HAS_LEFT": left is not None, "HAS_RIGHT": right is not None,
              "SCORES": (softcap, slopes is not None)}
    if flags is not GRADIENT_FLAGS:
        values["SINK"] = params.sink is not None
    if flags is not DENSE_FLAGS:
        values["DROPOUT"] = dropout[4]
        values["VARLEN"] = varlen
    # tuple.__new__: the NamedTuple's own __new__ and _make are Python functions (~0.3 us)
    band = (seqlen_q, seqlen_k, 0 if left is None else left, 0 if right is None else right)
    return tuple.__new__(KernelFeatures, (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim,
                                          head_dim_v, band,
                                          (qk_scale, softcap_scale, *alibi_strides),
                                          score_tensors, sink, dropout[:4], (cu_q, cu_k),
                                          varlen, values))


def cuts_left(params: AttentionParams, seqlen_k: int) -> bool:
    """Whether a window's left side hides some of seqlen_k keys from some row (the HAS_LEFT
    flag of kernel_features: a side at least seqlen_k - 1 long reaches every key)."""
    return params.window_left is not None and params.window_left < seqlen_k - 1


def tiles_in_bounds(f: KernelFeatures, params: AttentionParams, block_m: int,
                    block_n: int) -> tuple[bool, bool]:
    """(queries, keys): whether every query tile of block_m rows (key tile of block_n keys)
    that a launch of f runs ends within the queries (keys): common.mod_positions' QUERIES_IN
    and KEYS_IN.
    Dense calls whose lengths fill whole tiles and, under a block mask, whole blocks (each
    listed block runs all its tiles); never varlen (sequences end anywhere in a tile) nor a
    block mask over packed tokens (a modifier sees positions within each sequence)."""
    variant = params.variant
    if f.varlen or (variant is not None and variant.packing):
        return False, False
    if variant is not None and variant.block_mask is not None:
        block_q, block_kv = variant.block_mask.BLOCK_SIZE
        block_m, block_n = math.lcm(block_m, block_q), math.lcm(block_n, block_kv)
    return f.seqlen_q % block_m == 0, f.seqlen_k % block_n == 0


def feature_tensors(params: AttentionParams, placeholder, float32_sink: bool = True) -> tuple:
    """(score_tensors, sink, cu_seqlens_q, cu_seqlens_k) as the kernels take them, the
    placeholder for each tensor the call has not (KernelFeatures' fields of the same names):
    what a launch plan (launch.Prepared) passes again at every call, its other arguments being
    fixed."""
    sink = params.sink  # any float dtype (checks.sink)
    if sink is None:
        sink = placeholder
    elif float32_sink and sink.dtype is not _FLOAT32:  # .to costs ~1 us even as a no-op
        sink = sink.to(_FLOAT32)
    score_tensors = (placeholder if params.alibi_slopes is None else params.alibi_slopes,)
    if params.cu_seqlens_q is None:
        return score_tensors, sink, placeholder, placeholder
    return score_tensors, sink, params.cu_seqlens_q, params.cu_seqlens_k


def dropout_seed(params: AttentionParams) -> tuple[int, int]:
    """(seed_lo, seed_hi) of the call's dropout seed, as in KernelFeatures.dropout ((0, 0)
    without dropout): what a prepared launch takes at every call (launch.Prepared's varying)."""
    if params.dropout_p == 0:
        return _NO_DROPOUT[:2]
    return dropout_args(params.dropout_p, params.dropout_seed)[:2]
