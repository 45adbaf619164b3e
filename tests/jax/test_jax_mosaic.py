"""The Mosaic GPU forward (flashkit.jax.mosaic): what it covers, that it lowers, and (on a Hopper
GPU) that it matches the oracle with the Triton-lowered backward behind it.

Mosaic GPU kernels have no CPU interpreter that runs wgmma on transposed refs, so CI checks the
dispatch and lowers the kernel to Mosaic GPU MLIR for CUDA (layouts, barriers and TMA shapes are
checked there); the numbers are checked by the `gpu` tests.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
pytest.importorskip("absl", reason="Mosaic GPU needs absl-py")

from flashkit.jax import flash_attention, mosaic  # noqa: E402
from flashkit.jax._checks import check_inputs  # noqa: E402


def _cfg(q, k, causal=False, window=(-1, -1), block_k=None):
    return check_inputs(q, k, k, causal=causal, softmax_scale=None, window_size=window,
                        implementation="pallas", block_q=None, block_k=block_k, interpret=False)


def _arrays(sq, sk, h, hk, d, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((2, sq, h, d), dtype), jax.ShapeDtypeStruct((2, sk, hk, d), dtype))


COVERED = [  # (sq, sk, h, hk, d, causal)
    (256, 256, 4, 2, 64, False),
    (128, 384, 2, 1, 128, True),  # bottom-right causal, shift 256
    (256, 128, 2, 2, 64, False),
]
NOT_COVERED = [  # (sq, sk, h, hk, d, causal, window, dtype): the Triton kernel runs these
    (256, 256, 2, 2, 80, False, (-1, -1), jnp.bfloat16),  # head dim
    (200, 256, 2, 2, 64, False, (-1, -1), jnp.bfloat16),  # partial query block
    (256, 200, 2, 2, 64, False, (-1, -1), jnp.bfloat16),  # partial key block (of 64)
    (256, 128, 2, 2, 64, True, (-1, -1), jnp.bfloat16),  # causal rows that see no key
    (256, 256, 2, 2, 64, False, (16, 0), jnp.bfloat16),  # window
    (256, 256, 2, 2, 64, False, (-1, -1), jnp.float32),
]


@pytest.mark.parametrize("sq,sk,h,hk,d,causal", COVERED)
def test_supports_and_lowers_for_cuda(sq, sk, h, hk, d, causal):
    q, k = _arrays(sq, sk, h, hk, d)
    cfg = _cfg(q, k, causal=causal)
    assert mosaic.supports(q.shape, k.shape, k.shape, q.dtype, cfg)
    lowered = jax.jit(lambda q, k, v: mosaic.forward(q, k, v, cfg)).trace(q, k, k).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_block_k_divides_seqlen_k():
    """d64's 256-key blocks halve until they divide seqlen_k (here 384 -> 128)."""
    q, k = _arrays(128, 384, 2, 1, 64)
    assert mosaic.cfg_tile(_cfg(q, k), 64).block_k == 128


CANDIDATES = [(d, tile) for d, tiles in mosaic.CANDIDATES.items() for tile in tiles]


def _use_tile(monkeypatch, d, tile, ctas=None):
    """Make every (d, causal) problem run `tile`; a persistent launch gets `ctas` CTAs."""
    for causal in (False, True):
        monkeypatch.setitem(mosaic.TILES, (d, causal), ((None, tile),))
    if ctas is not None:
        monkeypatch.setattr(mosaic, "sm_count", lambda: ctas)


def test_tables_hold_candidates():
    """What TILES ships is among the candidates the GPU tests check."""
    for (d, _), entries in mosaic.TILES.items():
        for _, tile in entries:
            assert tile in mosaic.CANDIDATES[d]


@pytest.mark.parametrize("d,tile", CANDIDATES)
@pytest.mark.parametrize("causal", [False, True])
def test_candidate_lowers_for_cuda(monkeypatch, d, tile, causal):
    _use_tile(monkeypatch, d, tile, ctas=5)
    q, k = _arrays(512, 1024, 4, 2, d)
    cfg = _cfg(q, k, causal=causal)
    assert mosaic.cfg_tile(cfg, d) == tile
    lowered = jax.jit(lambda q, k, v: mosaic.forward(q, k, v, cfg)).trace(q, k, k).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("sq,sk,h,hk,d,causal,window,dtype", NOT_COVERED)
def test_not_covered(sq, sk, h, hk, d, causal, window, dtype):
    q, k = _arrays(sq, sk, h, hk, d, dtype)
    assert not mosaic.supports(q.shape, k.shape, k.shape, dtype, _cfg(q, k, causal, window))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU refusal")
def test_explicit_mosaic_refuses_without_hopper():
    x = jnp.ones((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="pallas_mosaic"):
        flash_attention(x, x, x, implementation="pallas_mosaic")


GPU_CASES = [  # (batch, sq, sk, h, hk, d, causal)
    (2, 256, 256, 4, 2, 64, False),
    (2, 256, 256, 4, 2, 64, True),
    (1, 128, 384, 2, 1, 128, True),
    (1, 512, 256, 2, 2, 128, False),
    (1, 1024, 1024, 2, 1, 128, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("d,tile", CANDIDATES)
@pytest.mark.parametrize("sq,sk,causal", [(512, 512, False), (512, 512, True),
                                          (256, 1024, True)])
def test_candidate_against_oracle(check, monkeypatch, d, tile, sq, sk, causal):
    """Every candidate tile, forward only (the backward is the Triton kernel's): 5 persistent
    CTAs walk 3 to 7 tiles each, so the K/V ring, the Q prefetch and the O store run on across
    tiles of different lengths."""
    if not mosaic.is_hopper():
        pytest.skip("needs a Hopper GPU")
    _use_tile(monkeypatch, d, tile, ctas=5)
    check("pallas_mosaic", batch=2, seqlen_q=sq, seqlen_k=sk, nheads=4, nheads_k=2, d=d,
          causal=causal, dtype="bfloat16", with_grads=False)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,sk,h,hk,d,causal", GPU_CASES)
def test_mosaic_against_oracle(check, batch, sq, sk, h, hk, d, causal):
    if not mosaic.is_hopper():
        pytest.skip("needs a Hopper GPU")
    check("pallas_mosaic", batch=batch, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_k=hk, d=d,
          causal=causal, dtype="bfloat16")
