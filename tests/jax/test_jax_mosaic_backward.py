"""The Mosaic GPU backward (flashkit.jax.mosaic_backward): what it covers, when flashkit.jax runs
it, that every tile lowers for CUDA, and (on a Hopper GPU) that its gradients match the oracle.

As for the forward (test_jax_mosaic.py), CI has no interpreter for these kernels: it checks the
dispatch and lowers the kernels to Mosaic GPU MLIR for CUDA; the `gpu` tests check the numbers.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
pytest.importorskip("absl", reason="Mosaic GPU needs absl-py")

from flashkit.jax import dispatch, mosaic, mosaic_backward  # noqa: E402
from flashkit.jax._checks import check_inputs  # noqa: E402


def _problem(sq, sk, h, hk, d, causal=False, window=(-1, -1), dtype=jnp.bfloat16,
             implementation="pallas", interpret=False):
    q = jax.ShapeDtypeStruct((2, sq, h, d), dtype)
    k = jax.ShapeDtypeStruct((2, sk, hk, d), dtype)
    cfg = check_inputs(q, k, k, causal=causal, softmax_scale=None, window_size=window,
                       implementation=implementation, block_q=None, block_k=None,
                       interpret=interpret)
    return q, k, cfg


COVERED = [  # (sq, sk, h, hk, d, causal)
    (256, 256, 4, 2, 64, False),
    (128, 384, 2, 1, 128, True),  # bottom-right causal, shift 256
    (512, 128, 2, 2, 64, False),
    (256, 256, 8, 1, 128, True),  # MQA
    (192, 256, 2, 2, 128, False),  # query rows not a multiple of 128
    (256, 192, 2, 2, 128, False),
    (256, 128, 2, 2, 128, True),  # causal rows that see no key
    (63, 1, 2, 2, 128, False),
]
NOT_COVERED = [  # (sq, sk, h, hk, d, causal, window, dtype): the Triton-lowered backward runs
    (256, 256, 2, 2, 80, False, (-1, -1), jnp.bfloat16),  # head dim
    (256, 256, 2, 2, 64, False, (-1, -1), jnp.float32),
    (192, 256, 2, 2, 64, False, (-1, -1), jnp.bfloat16),  # d64: whole 128-blocks only
    (256, 256, 2, 2, 64, False, (16, 0), jnp.bfloat16),  # d64: window
]


@pytest.mark.parametrize("sq,sk,h,hk,d,causal", COVERED)
def test_supports(sq, sk, h, hk, d, causal):
    q, k, cfg = _problem(sq, sk, h, hk, d, causal)
    assert mosaic_backward.supports(q.shape, k.shape, k.shape, q.dtype, cfg)


@pytest.mark.parametrize("sq,sk,h,hk,d,causal,window,dtype", NOT_COVERED)
def test_not_covered(sq, sk, h, hk, d, causal, window, dtype):
    q, k, cfg = _problem(sq, sk, h, hk, d, causal, window, dtype)
    assert not mosaic_backward.supports(q.shape, k.shape, k.shape, dtype, cfg)


@pytest.mark.parametrize("implementation,interpret,hopper,shape,expected", [
    ("pallas", False, True, (256, 256), True),
    ("pallas_mosaic", False, True, (256, 256), True),
    ("pallas", False, True, (250, 193), False),  # d64 keeps whole blocks (d128: any)
    ("pallas", False, False, (256, 256), False),  # not a Hopper GPU
    ("pallas", True, True, (256, 256), False),  # the interpreter runs Triton's kernels
    ("pallas_triton", False, True, (256, 256), False),
    ("xla", False, True, (256, 256), False),
])
def test_dispatch(monkeypatch, implementation, interpret, hopper, shape, expected):
    monkeypatch.setattr(mosaic, "is_hopper", lambda: hopper)
    q, k, cfg = _problem(*shape, 2, 2, 64, implementation=implementation, interpret=interpret)
    chosen, declined = dispatch.backward_choice(q, k, k, cfg)
    assert (chosen == "mosaic") == expected
    assert bool(declined) == (not expected and implementation.startswith("pallas")
                              and implementation != "pallas_triton")


def test_tables_hold_candidates():
    """What TILES ships is among the candidates the GPU tests check."""
    for (d, _), tile in mosaic_backward.TILES.items():
        assert tile in mosaic_backward.CANDIDATES[d]


CANDIDATES = [(d, tile) for d, tiles in mosaic_backward.CANDIDATES.items() for tile in tiles]


def _use_tile(monkeypatch, d, tile):
    for causal in (False, True):
        monkeypatch.setitem(mosaic_backward.TILES, (d, causal), tile)


def _lower(q, k, cfg):
    lse = jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    fn = jax.jit(lambda q, k, v, o, do, lse, dlse: mosaic_backward.backward(
        q, k, v, o, do, lse, dlse, cfg))
    return fn.trace(q, k, k, q, q, lse, lse).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("d,tile", CANDIDATES)
@pytest.mark.parametrize("causal", [False, True])
def test_candidate_lowers_for_cuda(monkeypatch, d, tile, causal):
    _use_tile(monkeypatch, d, tile)
    q, k, cfg = _problem(256, 384, 4, 2, d, causal)
    assert _lower(q, k, cfg).count("mosaic_gpu") >= 2  # the dK/dV and the dQ kernel


@pytest.mark.parametrize("sq,sk,window", [(1000, 300, (-1, 0)), (63, 65, (-1, -1)),
                                          (300, 1000, (100, 20))])
def test_partial_and_banded_lower_for_cuda(sq, sk, window):
    q, k, cfg = _problem(sq, sk, 4, 2, 128, window=window)
    assert _lower(q, k, cfg).count("mosaic_gpu") >= 2


GPU_CASES = [  # (batch, sq, sk, h, hk, d, causal)
    (2, 256, 256, 4, 2, 64, False),
    (2, 256, 256, 4, 2, 64, True),
    (1, 128, 384, 2, 1, 128, True),  # shift 256: CTAs of keys past every diagonal but the last
    (1, 512, 256, 2, 2, 128, False),
    (1, 1024, 1024, 2, 1, 128, True),
    (2, 384, 640, 4, 4, 64, True),
]


def _require_mosaic_backward(sq, sk, h, hk, d, causal):
    if not mosaic.is_hopper():
        pytest.skip("needs a Hopper GPU")
    q, k, cfg = _problem(sq, sk, h, hk, d, causal)
    assert dispatch.backward_choice(q, k, k, cfg)[0] == "mosaic"


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,sk,h,hk,d,causal", GPU_CASES)
def test_backward_against_oracle(check, batch, sq, sk, h, hk, d, causal):
    """Forward (Mosaic) and backward (Mosaic) through jax.vjp, with cotangents on out and lse."""
    _require_mosaic_backward(sq, sk, h, hk, d, causal)
    check("pallas", batch=batch, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_k=hk, d=d,
          causal=causal, dtype="bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("d,tile", CANDIDATES)
@pytest.mark.parametrize("sq,sk,causal", [(512, 512, False), (512, 512, True),
                                          (256, 1024, True)])
def test_candidate_against_oracle(check, monkeypatch, d, tile, sq, sk, causal):
    """Every candidate tile: rings of 2-3 slots over 4-16 streamed blocks, GQA 2."""
    _require_mosaic_backward(sq, sk, 4, 2, d, causal)
    _use_tile(monkeypatch, d, tile)
    check("pallas", batch=2, seqlen_q=sq, seqlen_k=sk, nheads=4, nheads_k=2, d=d,
          causal=causal, dtype="bfloat16", seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk,h,hk,d,causal", [(256, 256, 4, 2, 64, True),
                                                 (256, 512, 2, 1, 128, False),
                                                 (512, 512, 2, 2, 128, True)])
def test_float16_against_oracle(check, sq, sk, h, hk, d, causal):
    """float16: the oracle's baseline runs in torch.float16."""
    _require_mosaic_backward(sq, sk, h, hk, d, causal)
    check("pallas", batch=2, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_k=hk, d=d,
          causal=causal, dtype="float16", seed=2)
