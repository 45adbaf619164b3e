"""Shapes that do not fit together: a ValueError naming the argument, before any compute."""

import pytest
import torch
from adversarial_support import BACKENDS, qkv, randn, rejects

import flashkit


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case, arg", [
    ("q_rank", "q"), ("k_batch", "k"), ("v_seqlen", "v"), ("heads_divide", "k"),
    ("v_heads", "v"), ("k_headdim", "k"), ("headdim_big", "q"), ("headdim_zero", "q"),
])
def test_dense_shape_mismatch(backend, case, arg):
    q, k, v = qkv()
    if case == "q_rank":
        q = q[0]
    elif case == "k_batch":
        k = randn(2, 7, 2, 16)
    elif case == "v_seqlen":
        v = randn(1, 6, 2, 16)
    elif case == "heads_divide":
        q, k, v = qkv(nheads=3, nheads_k=2)
    elif case == "v_heads":
        v = randn(1, 7, 1, 16)
    elif case == "k_headdim":
        k = randn(1, 7, 2, 8)
    elif case == "headdim_big":
        q, k, v = qkv(headdim=257)
    elif case == "headdim_zero":
        q, k, v = qkv(headdim=0)
    rejects((ValueError, TypeError), arg,
            lambda: flashkit.flash_attn_func(q, k, v, backend=backend), q, k, v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_cu_seqlens_shapes(backend):
    q, k, v = randn(5, 2, 16), randn(7, 2, 16), randn(7, 2, 16)
    good = torch.tensor([0, 5], dtype=torch.int32, device=q.device)
    goodk = torch.tensor([0, 7], dtype=torch.int32, device=q.device)
    for bad, arg in ((torch.tensor([0, 4], dtype=torch.int32, device=q.device), "cu_seqlens_q"),
                     (torch.tensor([0, 6, 5], dtype=torch.int32, device=q.device), "cu_seqlens_q"),
                     (torch.tensor([5], dtype=torch.int32, device=q.device), "cu_seqlens_q")):
        rejects(ValueError, arg, lambda bad=bad: flashkit.flash_attn_varlen_func(
            q, k, v, bad, goodk, 5, 7, backend=backend, sync_checks=True), q, k, v, good, goodk)
    # sync_checks: on CUDA the values are otherwise checked by a device-side assertion, which
    # ends the CUDA context (docs/design.md section 2)
    rejects(ValueError, "max_seqlen_k", lambda: flashkit.flash_attn_varlen_func(
        q, k, v, good, goodk, 5, 6, backend=backend, sync_checks=True), q, k, v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seqlen_q, seqlen_k, headdim", [(1, 1, 1), (3, 1, 5), (1, 9, 3)])
def test_awkward_shapes_match_oracle(backend, seqlen_q, seqlen_k, headdim):
    q, k, v = qkv(seqlen_q=seqlen_q, seqlen_k=seqlen_k, headdim=headdim)
    out = flashkit.flash_attn_func(q, k, v, causal=True, backend=backend)
    ref = flashkit.flash_attn_func(q.double(), k.double(), v.double(), causal=True,
                                   backend="reference")
    assert (out.double() - ref).abs().max() < 1e-5
