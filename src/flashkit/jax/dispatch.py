"""flashkit.jax's front door: the one place that picks which implementation runs a call.

    forward(q, k, v, cfg)                         the Mosaic GPU forward (mosaic.py) where it
                                                  takes the call, else the implementation cfg
                                                  names: the Triton-lowered Pallas kernels
                                                  (pallas.py) or the XLA ports (xla.py)
    backward(q, k, v, out, lse, dout, dlse, cfg)  the Mosaic GPU backward (mosaic_backward.py)
                                                  where it takes the call, else the same
    forward_choice / backward_choice              the choice alone: (implementation, declined)

implementation="pallas" tries Mosaic GPU first and falls back to the Triton-lowered kernels;
"pallas_mosaic" takes Mosaic GPU or raises NotImplementedError saying why it declined;
"pallas_triton", "xla" and "fori" run what they name. (A backward that the Mosaic GPU
kernels do not cover runs on the Triton-lowered kernels under "pallas_mosaic" too.) Each
Mosaic implementation's `declines` lives beside its kernel and returns why it does not take a
call (a string), or None.

The choice is made when JAX traces the call (under jax.jit: once per shape, dtype and
configuration) and logged as the Triton backend's is: set FLASHKIT_LOG_DISPATCH=1, or the logger
"flashkit.dispatch" to DEBUG, to see e.g.
    jax forward ran pallas_triton; declined: mosaic: not a Hopper GPU (the default device is cpu)
"""

from __future__ import annotations

from flashkit._dispatch_log import log_choice
from flashkit.jax import _layout, pallas, xla
from flashkit.jax._checks import AttentionConfig
from flashkit.jax._tile import backward_rows

__all__ = ["forward", "backward", "forward_choice", "backward_choice"]

_MOSAIC = ("pallas", "pallas_mosaic")  # implementations that try Mosaic GPU first
# What runs where Mosaic GPU is not tried or declines (pallas_mosaic: the backward only), and
# the module of each (the folded GQA layout of _layout).
_PORTABLE = {"pallas": "pallas_triton", "pallas_mosaic": "pallas_triton",
             "pallas_triton": "pallas_triton", "xla": "xla", "fori": "fori"}
_FOLDED = {"pallas_triton": pallas, "xla": xla, "fori": xla}


def _mosaic_declines(module_name: str, q, k, v, cfg: AttentionConfig) -> str | None:
    """Why the Mosaic GPU kernels of module_name ("mosaic" or "mosaic_backward") do not run the
    call, or None: their own declines, once they import (Mosaic GPU needs absl-py, which a
    CPU-only jax install may lack)."""
    try:
        if module_name == "mosaic":
            from flashkit.jax import mosaic as module
        else:
            from flashkit.jax import mosaic_backward as module
    except ImportError as err:
        return f"Mosaic GPU does not import ({err})"
    return module.declines(q.shape, k.shape, v.shape, q.dtype, cfg)


def _choose(op: str, module_name: str, q, k, v, cfg: AttentionConfig) -> tuple[str, tuple]:
    """(implementation, ((name, why declined), ...)) of one call, logged."""
    declined = ()
    if cfg.implementation in _MOSAIC:
        why = _mosaic_declines(module_name, q, k, v, cfg)
        if why is None:
            log_choice(f"jax {op}", "mosaic", ())
            return "mosaic", ()
        if cfg.implementation == "pallas_mosaic" and op == "forward":
            raise NotImplementedError(
                f"implementation='pallas_mosaic': {why}. The Mosaic GPU kernels need a Hopper "
                "GPU (no interpreter) and cover bf16/fp16 with d = dv = 128 (d = 64: whole "
                "blocks, no window); use implementation='pallas'")
        declined = (("mosaic", why),)
    ran = _PORTABLE[cfg.implementation]
    log_choice(f"jax {op}", ran, declined)
    return ran, declined


def forward_choice(q, k, v, cfg: AttentionConfig) -> tuple[str, tuple]:
    """("mosaic" | "pallas_triton" | "xla" | "fori", declined) for the forward of a call."""
    return _choose("forward", "mosaic", q, k, v, cfg)


def backward_choice(q, k, v, cfg: AttentionConfig) -> tuple[str, tuple]:
    """("mosaic" | "pallas_triton" | "xla" | "fori", declined) for the backward of a call."""
    return _choose("backward", "mosaic_backward", q, k, v, cfg)


def forward(q, k, v, cfg: AttentionConfig):
    """Caller's layout: q [B, Sq, H, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv]
    -> (out [B, Sq, H, Dv], lse [B, H, Sq])."""
    ran, _ = forward_choice(q, k, v, cfg)
    if ran == "mosaic":
        from flashkit.jax import mosaic
        return mosaic.forward(q, k, v, cfg)
    if ran == "pallas_triton":  # the caller's layout too
        return pallas.forward(q, k, v, cfg)
    out, lse = xla.forward(_layout.fold_q(q, k.shape[2]), _layout.swap_seq_heads(k),
                           _layout.swap_seq_heads(v), cfg)
    return _layout.unfold_q(out, q.shape[1]), lse.reshape(q.shape[0], q.shape[2], q.shape[1])


def backward(q, k, v, out, lse, dout, dlse, cfg: AttentionConfig):
    """(dq, dk, dv) in the caller's layout, from the forward's out and lse."""
    ran, _ = backward_choice(q, k, v, cfg)
    if ran == "mosaic":
        from flashkit.jax import mosaic_backward
        return mosaic_backward.backward(q, k, v, out, dout, lse, dlse, cfg)
    hk = k.shape[2]
    dout_f = _layout.fold_q(dout, hk)
    lse2, delta = backward_rows(_layout.fold_q(out, hk), dout_f, _layout.fold_rows(lse, hk),
                                _layout.fold_rows(dlse, hk))
    dq, dk, dv = _FOLDED[ran].backward(
        _layout.fold_q(q, hk), _layout.swap_seq_heads(k), _layout.swap_seq_heads(v), dout_f,
        lse2, delta, cfg)
    return (_layout.unfold_q(dq, q.shape[1]), _layout.swap_seq_heads(dk),
            _layout.swap_seq_heads(dv))
