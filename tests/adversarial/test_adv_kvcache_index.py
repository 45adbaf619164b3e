"""Every kv-cache index argument out of range or of the wrong type: a ValueError/TypeError naming
it, raised before the cache is touched (the cache stays bit for bit the same). On CUDA the
Triton backend checks index values on the device unless sync_checks=True, which these tests
pass so that the same expectation holds everywhere."""

import pytest
import torch
from adversarial_support import BACKENDS, DEVICE, randn, rejects

import flashkit


def i32(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


CASES = [
    ("cache_seqlens", dict(cache_seqlens=i32(-1, 3))),
    ("cache_seqlens", dict(cache_seqlens=i32(3, 32))),  # 32 + 1 appended > capacity 32
    ("cache_seqlens", dict(cache_seqlens=32)),
    ("cache_seqlens", dict(cache_seqlens=-1)),
    ("cache_seqlens", dict(cache_seqlens=torch.tensor([3, 4], device=DEVICE))),  # int64
    ("cache_seqlens", dict(cache_seqlens=i32(3))),  # wrong shape
    ("cache_batch_idx", dict(cache_seqlens=i32(3, 4), cache_batch_idx=i32(0, 2))),
    ("cache_batch_idx", dict(cache_seqlens=i32(3, 4), cache_batch_idx=i32(-1, 0))),
    ("cache_batch_idx", dict(cache_seqlens=i32(3, 4), cache_batch_idx=[0, 1])),
    ("cache_leftpad", dict(cache_seqlens=i32(3, 4), cache_leftpad=i32(4, 0))),
    ("cache_leftpad", dict(cache_seqlens=i32(3, 4), cache_leftpad=i32(-1, 0))),
    ("rotary_cos", dict(cache_seqlens=i32(3, 4), rotary=4)),  # positions up to 4 need 5
    ("num_splits", dict(cache_seqlens=i32(3, 4), num_splits=-1)),
]
PAGED = [
    ("block_table", dict(cache_seqlens=i32(3, 20), block_table=i32(0, 1, 2, 9).view(2, 2))),
    ("block_table", dict(cache_seqlens=i32(3, 20), block_table=i32(0, 1, 2, -1).view(2, 2))),
    ("block_table", dict(cache_seqlens=i32(3, 20), block_table=i32(0, 1).view(1, 2))),
    ("block_table", dict(cache_seqlens=i32(3, 20),
                         block_table=torch.tensor([[0, 1], [2, 3]], device=DEVICE))),
    ("cache_batch_idx", dict(cache_seqlens=i32(3, 4), block_table=i32(0, 1, 2, 3).view(2, 2),
                             cache_batch_idx=i32(0, 1))),
]


def _call(backend, kc, vc, kwargs):
    kwargs = dict(kwargs)
    q, k, v = randn(2, 1, 2, 16), randn(2, 1, 2, 16), randn(2, 1, 2, 16)
    rotary = kwargs.pop("rotary", None)
    if rotary is not None:
        kwargs.update(rotary_cos=randn(rotary, 4), rotary_sin=randn(rotary, 4))
    return (lambda: flashkit.flash_attn_with_kvcache(q, kc, vc, k, v, backend=backend,
                                                     sync_checks=True, **kwargs)), (q, k, v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arg, kwargs", CASES + PAGED)
def test_bad_index_leaves_cache_unchanged(backend, arg, kwargs):
    paged = "block_table" in kwargs
    shape = (4, 16, 2, 16) if paged else (2, 32, 2, 16)
    with torch.no_grad():
        kc, vc = randn(*shape), randn(*shape)
        fn, given = _call(backend, kc, vc, kwargs)
        indices = [t for t in kwargs.values() if isinstance(t, torch.Tensor)]
        rejects((ValueError, TypeError), arg, fn, kc, vc, *given, *indices)


@pytest.mark.parametrize("backend", BACKENDS)
def test_good_indices_at_the_edges(backend):
    """The largest values that fit: seqlens filling the capacity, the last cache row, leftpad
    equal to cache_seqlens (only the new key is visible)."""
    with torch.no_grad():
        kc, vc = randn(3, 32, 2, 16), randn(3, 32, 2, 16)
        fn, _ = _call(backend, kc, vc, dict(cache_seqlens=i32(31, 0), cache_batch_idx=i32(2, 0),
                                            cache_leftpad=i32(31, 0)))
        out = fn()
    assert torch.isfinite(out).all()
