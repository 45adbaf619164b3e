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
    assert mosaic.cfg_tile(_cfg(q, k), 64)[1] == 128


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
@pytest.mark.parametrize("batch,sq,sk,h,hk,d,causal", GPU_CASES)
def test_mosaic_against_oracle(check, batch, sq, sk, h, hk, d, causal):
    if not mosaic.is_hopper():
        pytest.skip("needs a Hopper GPU")
    check("pallas_mosaic", batch=batch, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_k=hk, d=d,
          causal=causal, dtype="bfloat16")
