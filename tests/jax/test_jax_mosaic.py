"""The Mosaic GPU forward (flashkit.jax.mosaic): what it covers, that it lowers, and (on a Hopper
GPU) that it matches the oracle with the Triton-lowered backward behind it.

Mosaic GPU kernels have no CPU interpreter that runs wgmma on transposed refs, so CI checks the
dispatch and lowers the kernel to Mosaic GPU MLIR for CUDA (layouts, barriers and TMA shapes are
checked there); the numbers are checked by the `gpu` tests.
"""

from __future__ import annotations

import numpy as np
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
    (200, 256, 2, 2, 128, False),  # partial query tile
    (256, 200, 2, 2, 128, False),  # partial key block
    (256, 128, 2, 2, 128, True),  # causal rows that see no key
    (63, 65, 2, 1, 128, True),  # lengths not multiples of 8: padded
    (1, 1, 1, 1, 128, False),
]
NOT_COVERED = [  # (sq, sk, h, hk, d, causal, window, dtype): the Triton kernel runs these
    (256, 256, 2, 2, 80, False, (-1, -1), jnp.bfloat16),  # head dim
    (256, 256, 2, 2, 64, False, (-1, -1), jnp.float32),
    (200, 256, 2, 2, 64, False, (-1, -1), jnp.bfloat16),  # d64: partial query tile
    (256, 200, 2, 2, 64, False, (-1, -1), jnp.bfloat16),  # d64: partial key block
    (256, 128, 2, 2, 64, True, (-1, -1), jnp.bfloat16),  # d64: causal rows that see no key
    (256, 256, 2, 2, 64, False, (16, 0), jnp.bfloat16),  # d64: window
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
    """d64's 256-key blocks halve until they divide seqlen_k (here 384 -> 128); where no block
    of 64 or more divides it, while half a block still holds every key (65 -> 128)."""
    for sk, bk in ((384, 128), (1000, 256), (65, 128), (63, 64)):
        q, k = _arrays(128, sk, 2, 1, 64)
        assert mosaic.cfg_tile(_cfg(q, k, block_k=None), 64).block_k == bk


def test_window_lowers_for_cuda():
    q, k = _arrays(1000, 1000, 2, 1, 128)
    cfg = _cfg(q, k, window=(100, 30))
    lowered = jax.jit(lambda q, k, v: mosaic.forward(q, k, v, cfg)).trace(q, k, k).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("seed", range(3))
def test_band_blocks_hold_every_visible_pair(seed):
    """Band.blocks covers every key (row) that a 64-row (key) range sees, and every block of
    Band.full_blocks is visible whole (docs/design.md section 1's mask, bottom-right aligned)."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        sq, sk = (int(x) for x in rng.integers(1, 300, 2))
        left, right = (int(rng.choice(c)) for c in ([-1, 0, 3, 64, 130], [-1, 0, 5, 70]))
        q, k = _arrays(sq, sk, 1, 1, 64)
        cfg = _cfg(q, k, causal=bool(rng.integers(2)), window=(left, right))
        i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
        seen = np.ones((sq, sk), bool)
        if cfg.window_left is not None:
            seen &= j >= i + cfg.shift - cfg.window_left
        if cfg.window_right is not None:
            seen &= j <= i + cfg.shift + cfg.window_right
        for band, seen_by, size in ((mosaic.Band.keys_of_rows(cfg), seen, 64),
                                    (mosaic.Band.rows_of_keys(cfg, sq), seen.T, 32)):
            for x0 in range(0, len(seen_by), 64):
                part = seen_by[x0:x0 + 64]
                lo, hi = band.blocks(x0, x0 + 64, size)
                cols = np.nonzero(part.any(axis=0))[0]
                assert not len(cols) or lo * size <= cols[0] and cols[-1] < hi * size
                for b in range(*band.full_blocks(x0, x0 + 64, size)):
                    assert part[:, b * size:(b + 1) * size].shape[1] == size
                    assert part[:, b * size:(b + 1) * size].all()


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


AWKWARD = [  # (batch, sq, sk, h, hk, d, causal, window): d128 (d64 keeps whole blocks)
    (1, 1, 1, 2, 1, 128, False, (-1, -1)),
    (2, 63, 65, 4, 2, 128, True, (-1, -1)),  # not multiples of 8: padded copies
    (1, 65, 63, 2, 2, 128, True, (-1, -1)),  # causal sq > sk: leading rows see no key
    (1, 257, 257, 4, 1, 128, False, (-1, -1)),
    (1, 1000, 1000, 2, 2, 128, True, (-1, -1)),
    (2, 1000, 296, 4, 2, 128, True, (-1, -1)),  # sq > sk, in-kernel masking only
    (1, 296, 1000, 2, 1, 128, False, (100, 0)),  # causal window
    (1, 1000, 1000, 2, 2, 128, False, (256, 64)),
    (1, 520, 200, 2, 1, 128, False, (-1, 17)),  # right only, sq > sk: empty leading rows
    (1, 200, 520, 2, 2, 128, False, (33, -1)),  # left only
]


@pytest.fixture
def mosaic_calls(monkeypatch):
    """Counts of the Mosaic forward and backward calls (traced once per jitted check)."""
    from flashkit.jax import mosaic_backward

    calls = {"forward": 0, "backward": 0}

    def counting(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(mosaic, "forward", counting("forward", mosaic.forward))
    monkeypatch.setattr(mosaic_backward, "backward",
                        counting("backward", mosaic_backward.backward))
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("batch,sq,sk,h,hk,d,causal,window", AWKWARD)
def test_awkward_against_oracle(check, mosaic_calls, batch, sq, sk, h, hk, d, causal, window):
    """Partial tiles, causal both ways, windows, GQA: out, lse and gradients, through the Mosaic
    forward and backward (counted, so a silent fallback fails)."""
    if not mosaic.is_hopper():
        pytest.skip("needs a Hopper GPU")
    check("pallas", batch=batch, seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_k=hk, d=d,
          causal=causal, window=window, dtype="bfloat16", seed=3)
    assert mosaic_calls == {"forward": 1, "backward": 1}


@pytest.mark.gpu
def test_awkward_float16_against_oracle(check, mosaic_calls):
    if not mosaic.is_hopper():
        pytest.skip("needs a Hopper GPU")
    check("pallas", batch=1, seqlen_q=1000, seqlen_k=1000, nheads=2, nheads_k=1, d=128,
          window=(128, 128), dtype="float16", seed=4)
    assert mosaic_calls == {"forward": 1, "backward": 1}
