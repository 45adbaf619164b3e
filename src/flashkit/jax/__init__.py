"""flashkit.jax: exact FlashAttention for JAX, with gradients.

    from flashkit.jax import flash_attention
    out = flash_attention(q, k, v, causal=True)                 # (batch, seqlen, nheads, d)
    out, lse = flash_attention(q, k, v, return_lse=True)         # lse (batch, nheads, seqlen_q)

Implementations (same math, docs/design.md section 1: bottom-right aligned causal/window, GQA,
rows that see no key give 0 and lse -inf):
    "pallas"         Pallas kernels for NVIDIA GPUs, forward and backward: on a Hopper GPU the
                     Mosaic GPU kernels (`mosaic.py` forward, `mosaic_backward.py` dK/dV and dQ:
                     TMA, wgmma, warp specialisation) where they cover the problem, else the
                     Triton-lowered ones (`pallas.py`); on a CPU the Triton-lowered kernels run
                     in Pallas's interpreter (slow: tests and teaching)
    "pallas_triton"  the Triton-lowered kernels only
    "pallas_mosaic"  the Mosaic GPU kernels only (Hopper only; NotImplementedError where they do
                     not cover the problem: bf16/fp16, d = dv = 128 at any lengths, causal
                     and windows; d = dv = 64 on whole blocks without a window)
    "xla"            the TPU post's vmap-over-query-blocks port, tiled in plain JAX
    "fori"           the TPU post's first port, a fori_loop over query blocks (kept to show the
                     difference)

`flashkit.jax.dispatch` picks the implementation of each call (FLASHKIT_LOG_DISPATCH=1 logs the
choice and why the others declined). Gradients come from one `jax.custom_vjp` for all of them:
the forward saves (q, k, v, out, lse), and the backward recomputes P = exp(S - lse) tile by tile
with delta = rowsum(dO * O) (FlashAttention-2). The Pallas forwards and the Mosaic backward read
the caller's (batch, seqlen, nheads, d) layout; the XLA ports and the Triton-lowered backward
work in the folded GQA layout of `_layout`.

This module needs jax; `import flashkit` never imports it.
"""

from __future__ import annotations

import functools

try:
    import jax
except ImportError as err:  # say what to install instead of a bare "No module named 'jax'"
    raise ImportError("flashkit.jax needs JAX: pip install 'flashkit-attn[jax]' (or "
                      "jax[cuda12] for GPUs)") from err
from flashkit.jax import dispatch
from flashkit.jax._checks import AttentionConfig, check_inputs

__all__ = ["flash_attention"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, cfg: AttentionConfig):
    """Caller's layout: q [B, Sq, H, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv]
    -> (out [B, Sq, H, Dv], lse [B, H, Sq])."""
    return dispatch.forward(q, k, v, cfg)


def _attention_fwd(q, k, v, cfg):
    out, lse = _attention(q, k, v, cfg)
    return (out, lse), (q, k, v, out, lse)


def _attention_bwd(cfg, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout, dlse = cotangents
    return dispatch.backward(q, k, v, out, lse, dout, dlse, cfg)


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                    implementation="pallas", return_lse=False, block_q=None, block_k=None,
                    interpret=None):
    """Exact attention, memory O(seqlen), differentiable (jit, grad and vmap all work).

    q (batch, seqlen_q, nheads, d), k (batch, seqlen_k, nheads_k, d),
    v (batch, seqlen_k, nheads_k, dv), nheads % nheads_k == 0; float16/bfloat16/float32 (and
    float64 for "xla"/"fori"). Returns out (batch, seqlen_q, nheads, dv) in q's dtype, and with
    return_lse=True also lse (batch, nheads, seqlen_q) in float32 (float64 for float64 inputs).

    softmax_scale defaults to 1/sqrt(d); window_size (left, right), -1 = unbounded, around the
    bottom-right aligned diagonal; causal is right = 0. block_q/block_k override the tile sizes
    (Pallas: powers of two >= 16). interpret (Pallas only) defaults to True on a CPU backend.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    cfg = check_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale,
                       window_size=tuple(window_size), implementation=implementation,
                       block_q=block_q, block_k=block_k, interpret=interpret)
    out, lse = _attention(q, k, v, cfg)
    return (out, lse) if return_lse else out
