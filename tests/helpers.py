"""Shared helpers for the attention tests: random inputs and the comparison of
docs/design.md section 5.

    q, k, v = random_qkv(batch=2, seqlen_q=17, seqlen_k=33, nheads=4, nheads_k=2, headdim=40)
    check_against_oracle(tiled_attention, dict(q=q, k=k, v=v, causal=True))

`check_against_oracle(fn, inputs)` runs `fn(**inputs)` (the kernel, in the inputs' dtype), the
oracle on float64 copies, and the oracle on the inputs as given (the baseline), then asserts
`max|kernel - oracle| <= factor * max|baseline - oracle| + 1e-5` for every output (factor 2) and
every gradient (factor 3), as flashkit.testing describes.
"""

from __future__ import annotations

import torch

import flashkit
from flashkit import reference
from flashkit.testing import GRAD_FACTOR, assert_close_to_oracle

# an sm_90 GPU (H100/H200), where the Gluon kernels run
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = ("fp32", "bf16", "fp16")


def randn(*shape, dtype=torch.float32, strided=False):
    """Standard normal values; strided=True returns a non-contiguous view with the same values
    (the last two dims are stored swapped and transposed back)."""
    if not strided or len(shape) < 2:
        return torch.randn(*shape, dtype=dtype)
    return torch.randn(*shape[:-2], shape[-1], shape[-2], dtype=dtype).transpose(-1, -2)


def random_qkv(batch=2, seqlen_q=17, seqlen_k=None, nheads=4, nheads_k=None, headdim=32,
               headdim_v=None, dtype=torch.float32, strided=False):
    """Random q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, .)."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    nheads_k = nheads if nheads_k is None else nheads_k
    headdim_v = headdim if headdim_v is None else headdim_v
    q = randn(batch, seqlen_q, nheads, headdim, dtype=dtype, strided=strided)
    k = randn(batch, seqlen_k, nheads_k, headdim, dtype=dtype, strided=strided)
    v = randn(batch, seqlen_k, nheads_k, headdim_v, dtype=dtype, strided=strided)
    return q, k, v


def cu_seqlens(lengths) -> torch.Tensor:
    """int32 prefix sums (0, l0, l0 + l1, ...) of sequence lengths."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def random_varlen(lengths_q, lengths_k, nheads=4, nheads_k=None, headdim=32,
                  dtype=torch.float32):
    """Packed q, k, v and the varlen arguments of flash_attn_varlen_func / reference.attention."""
    nheads_k = nheads if nheads_k is None else nheads_k
    q = randn(sum(lengths_q), nheads, headdim, dtype=dtype)
    k = randn(sum(lengths_k), nheads_k, headdim, dtype=dtype)
    v = randn(sum(lengths_k), nheads_k, headdim, dtype=dtype)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens(lengths_q),
                cu_seqlens_k=cu_seqlens(lengths_k), max_seqlen_q=max(lengths_q),
                max_seqlen_k=max(lengths_k))


def alibi_slopes(nheads, batch=None):
    """float32 ALiBi slopes in (0, 1): (nheads,), or (batch, nheads) when batch is given."""
    shape = (nheads,) if batch is None else (batch, nheads)
    return torch.rand(shape) * 0.9 + 0.05


def sink(nheads):
    """A float32 sink logit per query head."""
    return torch.randn(nheads)


# --- the functions under test, all as fn(**inputs) -> (out, lse) ----------------------------

def oracle(q, k, v, max_seqlen_q=None, max_seqlen_k=None, **kwargs):
    """flashkit.reference.attention with flash-attn's keyword names; max_seqlen_* are ignored."""
    return reference.attention(q, k, v, **kwargs)


def api_attention(backend="torch", **inputs):
    """(out, lse) from flash_attn_func, or flash_attn_varlen_func when cu_seqlens_q is given."""
    if "cu_seqlens_q" in inputs:
        out, lse, _ = flashkit.flash_attn_varlen_func(**inputs, return_attn_probs=True,
                                                      backend=backend)
    else:
        out, lse, _ = flashkit.flash_attn_func(**inputs, return_attn_probs=True,
                                               backend=backend)
    return out, lse


GRAD_NAMES = ("q", "k", "v", "sink")


def check_against_oracle(fn, inputs: dict, *, grads=True, output_names=("out", "lse"),
                         oracle_fn=oracle, baseline_fn=None, grad_names=GRAD_NAMES):
    """Assert the rule of docs/design.md section 5 for fn's outputs and, with grads, for the
    gradients of the inputs named in grad_names (q, k, v and sink when given), under random
    cotangents shared by the three computations. oracle_fn(**inputs) computes the oracle (on float64
    copies) and, unless baseline_fn is given, the baseline (on the inputs as given).

    Also checks that fn leaves the caller's tensors untouched. Returns fn's outputs.
    """
    grad_names = [n for n in grad_names if grads and inputs.get(n) is not None]
    before = {n: t.clone() for n, t in inputs.items() if isinstance(t, torch.Tensor)}

    def prepare(to_float64: bool):
        prepared = {}
        for name, t in inputs.items():
            if isinstance(t, torch.Tensor):
                t = t.detach()  # keeps the strides: a strided input stays strided
                if to_float64 and t.is_floating_point():
                    t = t.to(torch.float64)
                t.requires_grad_(name in grad_names)
            prepared[name] = t
        return prepared

    runs = {}
    for label, func, to_float64 in (("kernel", fn, False), ("oracle", oracle_fn, True),
                                    ("baseline", baseline_fn or oracle_fn, False)):
        args = prepare(to_float64)
        runs[label] = (args, tuple(func(**args))[:len(output_names)])

    for name, t in before.items():
        assert torch.equal(inputs[name], t), f"{name} was modified in place"
    for i, name in enumerate(output_names):
        assert_close_to_oracle(name, runs["kernel"][1][i], runs["oracle"][1][i],
                               runs["baseline"][1][i])
    if not grad_names:
        return runs["kernel"][1]

    # Rounded to the inputs' dtype, so all three computations see the same cotangent values.
    dtype = inputs[grad_names[0]].dtype
    cotangents = [torch.randn(o.shape, dtype=dtype).double().to(o.device)
                  for o in runs["oracle"][1]]
    grads = {}
    for label, (args, outs) in runs.items():
        grads[label] = torch.autograd.grad(
            outs, [args[n] for n in grad_names],
            [c.to(o.dtype) for c, o in zip(cotangents, outs, strict=True)])
    for i, name in enumerate(grad_names):
        assert_close_to_oracle(f"d{name}", grads["kernel"][i], grads["oracle"][i],
                               grads["baseline"][i], factor=GRAD_FACTOR)
    for name, t in before.items():
        assert torch.equal(inputs[name], t), f"{name} was modified in place by backward"
    return runs["kernel"][1]
