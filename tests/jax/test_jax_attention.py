"""flashkit.jax against the torch oracle: the TPU post's shapes, awkward shapes, GQA, bf16,
gradients.

The XLA ports ("xla" = vmap over query blocks, "fori" = fori_loop) are cheap on a CPU and get the
post's full sizes; the Pallas kernels run in the interpreter here, so they get small sizes that
still cross block boundaries (blocks of 16).
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

XLA_PORTS = ["xla", "fori"]
ALL = ["xla", "fori", "pallas"]
# "fori" runs the same tile code as "xla" (only the outer map differs): the post shapes and a few
# awkward cases cover it; every awkward case runs on the vmap port and the Pallas kernels.
TILED = ["xla", "pallas"]

# The TPU post's correctness shapes: (n, d, (block_m, block_n)), causal like the post, one head.
SEED_SHAPES = [(257, 64, (64, 64)), (513, 64, (128, 128)), (777, 80, (128, 64))]


@pytest.mark.parametrize("implementation", XLA_PORTS)
@pytest.mark.parametrize("n,d,blocks", SEED_SHAPES)
def test_seed_shapes(check, implementation, n, d, blocks):
    check(implementation, seqlen_q=n, d=d, causal=True, block_q=blocks[0], block_k=blocks[1])


@pytest.mark.parametrize("causal", [False, True])
def test_seed_shape_pallas(check, causal):
    """The smallest of the post's shapes through the Pallas kernels (padding on both axes)."""
    check("pallas", seqlen_q=257, d=64, causal=causal, block_q=64, block_k=64)


# (seqlen_q, seqlen_k, nheads, nheads_k, d, causal, window): awkward lengths, q != k both ways,
# GQA 2:1 / 4:1 / all-to-one, windows, head dims that are not powers of two.
AWKWARD = [
    (1, 1, 1, 1, 16, False, (-1, -1)),
    (3, 3, 2, 2, 32, True, (-1, -1)),
    (17, 17, 4, 1, 40, True, (-1, -1)),
    (3, 17, 2, 1, 16, True, (-1, -1)),
    (17, 3, 2, 2, 16, True, (-1, -1)),  # 14 rows see no key: out 0, lse -inf
    (33, 50, 4, 2, 24, False, (-1, -1)),
    (50, 33, 8, 2, 64, False, (7, 3)),
    (40, 40, 4, 4, 80, False, (5, -1)),
    (70, 90, 2, 2, 16, False, (20, 10)),  # band with unmasked blocks inside it, q != k
]


@pytest.mark.parametrize("implementation", TILED)
@pytest.mark.parametrize("sq,sk,h,hk,d,causal,window", AWKWARD)
def test_awkward_shapes(check, implementation, sq, sk, h, hk, d, causal, window):
    check(implementation, batch=2, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_k=hk, d=d,
          causal=causal, window=window, block_q=16, block_k=16)


@pytest.mark.parametrize("implementation", TILED)
def test_headdim_v_and_scale(check, implementation):
    check(implementation, seqlen_q=20, seqlen_k=29, nheads=2, d=32, dv=16, scale=0.3,
          causal=True, block_q=16, block_k=16)


@pytest.mark.parametrize("implementation", ALL)
def test_default_blocks(check, implementation):
    """No block override: the implementation's own tiles, clipped to a short sequence."""
    check(implementation, seqlen_q=70, seqlen_k=45, nheads=4, nheads_k=2, d=32, causal=True)


@pytest.mark.parametrize("implementation,causal",
                         [("xla", False), ("xla", True), ("fori", True), ("pallas", False),
                          ("pallas", True)])
def test_bfloat16(check, implementation, causal):
    check(implementation, batch=2, seqlen_q=45, seqlen_k=61, nheads=4, nheads_k=2, d=64,
          causal=causal, dtype="bfloat16", block_q=16, block_k=32)


@pytest.mark.parametrize("implementation", ALL)
def test_rows_without_keys_are_zero(check, implementation):
    import numpy as np

    out, lse, grads = check(implementation, seqlen_q=19, seqlen_k=4, nheads=2, d=16,
                            causal=True, block_q=16, block_k=16)
    blind = 19 - 4  # rows i with i + shift < 0 see no key
    assert np.all(np.asarray(out)[:, :blind] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, :blind]))
    assert np.all(np.asarray(grads[0])[:, :blind] == 0)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
