"""AttentionParams as kernel arguments, once for every launcher of the Triton backend.

Every launcher (forward.py, backward.py, forward_hopper.py, backward_hopper.py, decode.py,
forward_fp8.py) calls `kernel_features` once and passes its fields through: the runtime
values in the groups the kernels' signatures list them in, and the compile-time flags under
one vocabulary (FLAGS), in one order:

    HAS_LEFT, HAS_RIGHT  the band has a left / right edge (causal: right = 0)
    SOFTCAP              0, SOFTCAP_EXACT or SOFTCAP_FAST (common.scores)
    ALIBI                ALiBi slopes are read (common.load_alibi_log2, common.alibi_bias)
    SINK                 a sink logit starts every row (common.softmax_start)
    DROPOUT              the keep-mask is drawn (dropout.dropout_keep)
    VARLEN               packed sequences, cu_seqlens read (common.sequence)

A kernel that does not take a feature leaves its flag out (`flags_for`): the backward kernels
take no SINK (GRADIENT_FLAGS: the sink enters their math through lse alone), the decode and FP8
kernels no DROPOUT or VARLEN (DENSE_FLAGS: their callers refuse both before this point). A new feature adds its
field and its flag here and in the kernels' signatures; the launchers pass it on unchanged.

Host cost matters here (the eager path is measured in microseconds per call): one function,
one NamedTuple, no dataclasses.replace.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashkit.ops.params import AttentionParams
from flashkit.ops.triton.common import (
    LOG2E,
    SOFTCAP_EXACT,
    SOFTCAP_FAST,
    interpreting,
    natural_units,
)
from flashkit.ops.triton.dropout import dropout_args

FLAGS = ("HAS_LEFT", "HAS_RIGHT", "SOFTCAP", "ALIBI", "SINK", "DROPOUT", "VARLEN")
GRADIENT_FLAGS = ("HAS_LEFT", "HAS_RIGHT", "SOFTCAP", "ALIBI", "DROPOUT", "VARLEN")
DENSE_FLAGS = ("HAS_LEFT", "HAS_RIGHT", "SOFTCAP", "ALIBI", "SINK")


class KernelFeatures(NamedTuple):
    """One call's features as the kernels take them.

    batch, seqlen_q, seqlen_k, nheads, nheads_k: the grid's view of the problem (varlen: the
        number of sequences and the longest lengths; decode: the cache's capacity as seqlen_k).
    band: (seqlen_q, seqlen_k, window_left, window_right), the kernels' `band` (common.visible,
        common.score_mod). A side that reaches every key from every row is passed as unbounded
        (its flag off): left >= seqlen_k - 1 puts i + shift - left <= 0, right >= seqlen_q - 1
        puts i + shift + right >= seqlen_k - 1. The same visible set, and the kernels'
        band-edge sums (start + BLOCK + shift + window, int32) stay far from overflow:
        window_size=(-1, 2**31 - 1), a common spelling of "unbounded", is then exactly that.
    scores: (qk_scale, softcap_scale) for common.scores: softcap c > 0 gives (c * u,
        scale / c), else (scale * u, 1.0), with u = log2(e), or 1 in natural units (fp32
        inputs: common.natural_units).
    alibi, alibi_strides: float32 slopes (nheads,) or (batch, nheads) and their (batch, head)
        strides (batch stride 0 for one row); without ALiBi the placeholder, (0, 0).
    sink: the sink logits (nheads,) in float32 (as given with float32_sink=False); without one
        the placeholder.
    dropout: (seed_lo, seed_hi, dropout_threshold, dropout_scale) (dropout.dropout_args).
    cu_seqlens: (Cu_q, Cu_k), or the placeholder twice when dense.
    flags: every flag of FLAGS by name, in that order.
    """
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    band: tuple
    scores: tuple
    alibi: torch.Tensor
    alibi_strides: tuple
    sink: torch.Tensor
    dropout: tuple
    cu_seqlens: tuple
    flags: dict

    def strides(self, x: torch.Tensor) -> tuple:
        """x's strides with a leading batch stride: varlen tensors (total, ...) get batch
        stride 0, since each sequence's first row is added to the base pointer instead."""
        return (0, *x.stride()) if self.flags["VARLEN"] else x.stride()

    def flags_for(self, names: tuple) -> dict:
        """The flags `names` (GRADIENT_FLAGS, DENSE_FLAGS) of a kernel that takes a subset."""
        flags = self.flags
        return {name: flags[name] for name in names}


def lse_shape(q: torch.Tensor, params: AttentionParams) -> tuple[int, ...]:
    """The lse's shape for queries q: (batch, nheads, seqlen_q), varlen (nheads, total_q)."""
    return (q.shape[1], q.shape[0]) if params.is_varlen else (q.shape[0], q.shape[2], q.shape[1])


def kernel_features(params: AttentionParams, q: torch.Tensor, v: torch.Tensor, placeholder,
                    dtype: torch.dtype | None = None, seqlen_k: int | None = None,
                    float32_sink: bool = True) -> KernelFeatures:
    """The features of one call (KernelFeatures). q, v: the call's query and value tensors,
    dense (batch, seqlen, heads, d) or packed (total, heads, d), or a decode call's q and value
    cache (rows | pages, slots, heads_k, d) with seqlen_k its capacity. placeholder: a tensor
    standing in for absent pointer arguments (never read). dtype: the inputs' dtype, which
    picks the score units and the softcap's tanh (SOFTCAP_FAST for fp16/bf16 on a GPU: the
    hardware's tanh.approx.f32, relative error 2^-11, below those dtypes' own rounding);
    None: log2 units and the exact tanh (kernels whose scores are fp32 whatever the inputs).
    float32_sink=False passes the sink as given (the decode kernel converts it as it loads it,
    so a bf16 sink costs a decoding step no cast)."""
    if params.cu_seqlens_q is not None:
        varlen = True
        batch, seqlen_q = params.cu_seqlens_q.numel() - 1, params.max_seqlen_q
        keys, nheads, nheads_k = params.max_seqlen_k, q.shape[1], v.shape[1]
        cu_seqlens = (params.cu_seqlens_q, params.cu_seqlens_k)
    else:
        varlen = False
        batch, seqlen_q, keys, nheads, nheads_k = (q.shape[0], q.shape[1], v.shape[1],
                                                   q.shape[2], v.shape[2])
        cu_seqlens = (placeholder, placeholder)
    if seqlen_k is None:
        seqlen_k = keys

    left, right = params.window_left, params.window_right
    if left is not None and left >= seqlen_k - 1:
        left = None
    if right is not None and right >= seqlen_q - 1:
        right = None

    units = 1.0 if natural_units(dtype) else LOG2E
    if params.softcap > 0:
        fast = dtype in (torch.float16, torch.bfloat16) and not interpreting()
        scores = (params.softcap * units, params.softmax_scale / params.softcap)
        softcap = SOFTCAP_FAST if fast else SOFTCAP_EXACT
    else:
        scores, softcap = (params.softmax_scale * units, 1.0), 0

    slopes = params.alibi_slopes
    if slopes is None:
        alibi, alibi_strides = placeholder, (0, 0)
    else:
        alibi = slopes.to(torch.float32)
        alibi_strides = (0, alibi.stride(0)) if alibi.dim() == 1 else alibi.stride()

    sink = params.sink
    if sink is None:
        sink = placeholder
    elif float32_sink:
        sink = sink.to(torch.float32)

    dropout = dropout_args(params.dropout_p, params.dropout_seed)
    flags = {"HAS_LEFT": left is not None, "HAS_RIGHT": right is not None, "SOFTCAP": softcap,
             "ALIBI": slopes is not None, "SINK": params.sink is not None,
             "DROPOUT": dropout[4], "VARLEN": varlen}
    return KernelFeatures(batch, seqlen_q, seqlen_k, nheads, nheads_k,
                          (seqlen_q, seqlen_k, 0 if left is None else left,
                           0 if right is None else right),
                          scores, alibi, alibi_strides, sink, dropout[:4], cu_seqlens, flags)
