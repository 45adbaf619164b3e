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

Gradients come from one `jax.custom_vjp` for all of them: the forward saves (q, k, v, out, lse),
and the backward recomputes P = exp(S - lse) tile by tile with delta = rowsum(dO * O)
(FlashAttention-2). The Pallas forwards and the Mosaic backward read the caller's (batch, seqlen,
nheads, d) layout; the XLA ports and the Triton-lowered backward work in the folded GQA layout of
`_layout`.

This module needs jax; `import flashkit` never imports it.
"""

from __future__ import annotations

import functools

try:
    import jax
except ImportError as err:  # say what to install instead of a bare "No module named 'jax'"
    raise ImportError("flashkit.jax needs JAX: pip install 'flashkit-attn[jax]' (or "
                      "jax[cuda12] for GPUs)") from err
from flashkit.jax import _layout, pallas, xla
from flashkit.jax._checks import AttentionConfig, check_inputs
from flashkit.jax._tile import backward_rows

__all__ = ["flash_attention"]

_FOLDED = {"pallas": pallas, "pallas_triton": pallas, "pallas_mosaic": pallas, "xla": xla,
           "fori": xla}  # who runs the backward (and the forward, unless Mosaic does)


def _mosaic_for(q, k, v, cfg: AttentionConfig):
    """The Mosaic GPU module when it runs this forward, else None (see the module doc)."""
    if cfg.implementation not in ("pallas", "pallas_mosaic"):
        return None
    try:  # Mosaic GPU needs absl-py, which a CPU-only jax install may lack
        from flashkit.jax import mosaic
    except ImportError as err:
        if cfg.implementation == "pallas_mosaic":
            raise NotImplementedError(f"implementation='pallas_mosaic': {err}") from err
        return None
    usable = (not cfg.interpret and mosaic.is_hopper()
              and mosaic.supports(q.shape, k.shape, v.shape, q.dtype, cfg))
    if cfg.implementation == "pallas_mosaic" and not usable:
        raise NotImplementedError(
            "implementation='pallas_mosaic' needs a Hopper GPU (no interpreter) and covers "
            "bf16/fp16 with d = dv = 128 (d = 64: whole blocks, no window); use "
            "implementation='pallas'")
    return mosaic if usable else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, cfg: AttentionConfig):
    """Caller's layout: q [B, Sq, H, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv]
    -> (out [B, Sq, H, Dv], lse [B, H, Sq])."""
    mosaic = _mosaic_for(q, k, v, cfg)
    if mosaic is not None:
        return mosaic.forward(q, k, v, cfg)
    if _FOLDED[cfg.implementation] is pallas:
        return pallas.forward(q, k, v, cfg)
    out, lse = xla.forward(_layout.fold_q(q, k.shape[2]), _layout.swap_seq_heads(k),
                           _layout.swap_seq_heads(v), cfg)
    return _layout.unfold_q(out, q.shape[1]), lse.reshape(q.shape[0], q.shape[2], q.shape[1])


def _mosaic_backward_for(q, k, v, cfg: AttentionConfig):
    """The Mosaic GPU backward module when it runs this backward, else None."""
    if cfg.implementation not in ("pallas", "pallas_mosaic") or cfg.interpret:
        return None
    try:  # as in _mosaic_for: a CPU-only jax install may lack what Mosaic GPU needs
        from flashkit.jax import mosaic, mosaic_backward
    except ImportError:
        return None
    usable = mosaic.is_hopper() and mosaic_backward.supports(q.shape, k.shape, v.shape,
                                                             q.dtype, cfg)
    return mosaic_backward if usable else None


def _attention_fwd(q, k, v, cfg):
    out, lse = _attention(q, k, v, cfg)
    return (out, lse), (q, k, v, out, lse)


def _attention_bwd(cfg, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout, dlse = cotangents
    mosaic_backward = _mosaic_backward_for(q, k, v, cfg)
    if mosaic_backward is not None:
        return mosaic_backward.backward(q, k, v, out, dout, lse, dlse, cfg)
    hk = k.shape[2]
    dout_f = _layout.fold_q(dout, hk)
    lse2, delta = backward_rows(_layout.fold_q(out, hk), dout_f, _layout.fold_rows(lse, hk),
                                _layout.fold_rows(dlse, hk))
    dq, dk, dv = _FOLDED[cfg.implementation].backward(
        _layout.fold_q(q, hk), _layout.swap_seq_heads(k), _layout.swap_seq_heads(v), dout_f,
        lse2, delta, cfg)
    return (_layout.unfold_q(dq, q.shape[1]), _layout.swap_seq_heads(dk),
            _layout.swap_seq_heads(dv))


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
