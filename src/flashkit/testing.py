"""Helpers for testing attention kernels against the oracle (docs/design.md section 5).

The rule (flash-attn's own): a kernel in dtype t passes when

    max|kernel - oracle| <= factor * max|torch_in_t - oracle| + atol

where the oracle is `flashkit.reference` in float64 and torch_in_t is the same materialised
computation carried out in dtype t. It scales with what dtype t can do, so it is neither loose
for float32 nor impossible for bf16. The factor is 2 for out and lse and 3 for gradients
(dq, dk, dv, dsink): the backward's D = rowsum(dO * O) reads the output rounded to dtype t, as
in every FlashAttention. Outputs of at most TINY elements add flash-attn's rounding term
2 * max|(oracle_t + 0.3 - 0.3) - oracle_t|, oracle_t the oracle rounded to dtype t: on a few
dozen elements the baseline can be exact by luck.
"""

from __future__ import annotations

import torch

__all__ = ["assert_close_to_oracle", "max_error", "poison", "dropout_keep_mask",
           "OUTPUT_FACTOR", "GRAD_FACTOR", "TINY", "factor_for"]

OUTPUT_FACTOR = 2  # out, lse
GRAD_FACTOR = 3  # dq, dk, dv, dsink
TINY = 64  # outputs with at most this many elements add the rounding term


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| in float64, with inf - inf at the same place counting as 0."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    same_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    diff = torch.where(same_inf, torch.zeros_like(a), (a - e).abs())
    if diff.numel() == 0:
        return 0.0
    return float(torch.nan_to_num(diff, nan=float("inf")).max())


def factor_for(name: str) -> float:
    """GRAD_FACTOR for a gradient's name (dq, dk, dv, dsink), else OUTPUT_FACTOR."""
    return GRAD_FACTOR if name.startswith("d") else OUTPUT_FACTOR


def rounding_term(oracle: torch.Tensor, dtype: torch.dtype) -> float:
    """flash-attn's 2 * max|(r + 0.3 - 0.3) - r| with r the oracle rounded to dtype."""
    r = oracle.detach().to(dtype)
    return 2 * max_error(r + 0.3 - 0.3, r)


def assert_close_to_oracle(name: str, actual: torch.Tensor, oracle: torch.Tensor,
                           baseline: torch.Tensor, atol: float = 1e-5,
                           factor: float = OUTPUT_FACTOR) -> None:
    """Assert the rule of docs/design.md section 5 (factor: OUTPUT_FACTOR for out and lse,
    GRAD_FACTOR for gradients); the message names the tensor, the error ratio and the worst
    spot."""
    if actual.shape != oracle.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != oracle "
                             f"{tuple(oracle.shape)}")
    if torch.isnan(actual).any():
        where = tuple(torch.nonzero(torch.isnan(actual))[0].tolist())
        raise AssertionError(f"{name}: NaN at {where} (was every element written?)")
    err, base = max_error(actual, oracle), max_error(baseline, oracle)
    if actual.numel() <= TINY and actual.is_floating_point():
        atol = atol + rounding_term(oracle, actual.dtype)
    bound = factor * base + atol
    if err > bound:
        a, o = actual.detach().double().cpu(), oracle.detach().double().cpu()
        diff = torch.nan_to_num((a - o).abs(), nan=float("inf"))
        worst = tuple(torch.nonzero(diff == diff.max())[0].tolist())
        raise AssertionError(
            f"{name}: max error {err:.3e} > bound {bound:.3e} ({factor:g} x baseline "
            f"{base:.3e} + {atol:.3g}), ratio {err / bound:.2f}; worst at {worst}: got "
            f"{a[worst].item():.6g}, oracle {o[worst].item():.6g}")


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floats) so any element a kernel forgets to write fails the comparison."""
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)


def dropout_keep_mask(seed: int, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
                      dropout_p: float, backend: str = "torch", device=None) -> torch.Tensor:
    """The keep-mask (batch, nheads, seqlen_q, seqlen_k) a backend used for a dropout call.

    The seed is the one the call drew from torch's default generator: after
    `torch.manual_seed(s)`, `flashkit.api.draw_dropout_seed()` returns it. For varlen, pass the
    number of sequences and the max lengths; sequence b uses mask[b, :, :len_q, :len_k].
    Pass the mask to `flashkit.reference.attention(..., dropout_mask=mask)`.

    backend "torch" rebuilds the tiled backend's hash on the CPU; backend "triton" launches a
    small kernel that calls the attention kernels' own Philox helper, on `device` (default: the
    current CUDA device, or the CPU under TRITON_INTERPRET=1). The two backends' masks differ.
    """
    if backend == "triton":
        from flashkit.ops.triton.dropout import keep_mask as triton_keep_mask

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return triton_keep_mask(seed, dropout_p, batch, nheads, seqlen_q, seqlen_k, device)
    if backend != "torch":
        raise NotImplementedError(f"dropout_keep_mask: backend {backend!r} is not supported "
                                  "(expected 'torch' or 'triton')")
    from flashkit.ops.tiled.dropout import keep_mask

    return keep_mask(seed, torch.arange(batch).view(-1, 1, 1, 1),
                     torch.arange(nheads).view(1, -1, 1, 1), torch.arange(seqlen_q).view(-1, 1),
                     torch.arange(seqlen_k).view(1, -1), dropout_p)
