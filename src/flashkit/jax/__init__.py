"""flashkit.jax: exact FlashAttention for JAX, with gradients.

    from flashkit.jax import flash_attention
    out = flash_attention(q, k, v, causal=True)                 # (batch, seqlen, nheads, d)
    out, lse = flash_attention(q, k, v, return_lse=True)         # lse (batch, nheads, seqlen_q)

Implementations (same math, DESIGN section 1: bottom-right aligned causal/window, GQA, rows that
see no key give 0 and lse -inf):
    "pallas"  a Pallas kernel (Triton lowering) for NVIDIA GPUs, forward and backward; on a CPU
              it runs in Pallas's interpreter (slow: tests and teaching)
    "xla"     seed 003's vmap-over-query-blocks port, tiled in plain JAX
    "fori"    seed 003's first port, a fori_loop over query blocks (kept to show the difference)

Gradients come from one `jax.custom_vjp` for all three: the forward saves (q, k, v, out, lse),
and the backward recomputes P = exp(S - lse) tile by tile with delta = rowsum(dO * O)
(FlashAttention-2).

GQA is folded into rows: the `group = nheads // nheads_k` query heads that share a kv head are
stacked into one (group * seqlen_q)-row problem against that kv head, so every kernel sees
q (batch, nheads_k, rows, d) and dK/dV sum over the group for free.

This module needs jax; `import flashkit` never imports it.
"""

from __future__ import annotations

import functools

try:
    import jax
except ImportError as err:  # say what to install instead of a bare "No module named 'jax'"
    raise ImportError("flashkit.jax needs JAX: pip install 'flashkit[jax]' (or jax[cuda12] "
                      "for GPUs)") from err
from flashkit.jax import pallas, xla
from flashkit.jax._checks import AttentionConfig, check_inputs
from flashkit.jax._tile import backward_rows

__all__ = ["flash_attention"]

_IMPLEMENTATIONS = {"pallas": pallas, "xla": xla, "fori": xla}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, cfg: AttentionConfig):
    """Folded layout: q [B, Hk, R, D], k [B, Hk, Sk, D], v [B, Hk, Sk, Dv] -> (out, lse)."""
    return _IMPLEMENTATIONS[cfg.implementation].forward(q, k, v, cfg)


def _attention_fwd(q, k, v, cfg):
    out, lse = _attention(q, k, v, cfg)
    return (out, lse), (q, k, v, out, lse)


def _attention_bwd(cfg, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout, dlse = cotangents
    lse2, delta = backward_rows(out, dout, lse, dlse)
    return _IMPLEMENTATIONS[cfg.implementation].backward(q, k, v, dout, lse2, delta, cfg)


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
    batch, seqlen_q, nheads, d = q.shape
    nheads_k, group = k.shape[2], cfg.group

    # Fold GQA: query head h = kv_head * group + g  ->  rows g * seqlen_q + i of kv_head.
    qf = (q.reshape(batch, seqlen_q, nheads_k, group, d).transpose(0, 2, 3, 1, 4)
          .reshape(batch, nheads_k, group * seqlen_q, d))
    out, lse = _attention(qf, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), cfg)

    dv = v.shape[3]
    out = (out.reshape(batch, nheads_k, group, seqlen_q, dv).transpose(0, 3, 1, 2, 4)
           .reshape(batch, seqlen_q, nheads, dv))
    lse = lse.reshape(batch, nheads, seqlen_q)
    return (out, lse) if return_lse else out
