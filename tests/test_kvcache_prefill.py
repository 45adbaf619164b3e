"""Prefill over a KV cache through the Gluon forward (flashkit.ops.triton.prefill) against the
float64 oracle: paged caches (block_table, pages of 16..256 slots, shuffled, a padded table, NaN in
every slot that is not a key), contiguous ones at short and odd query lengths, the features.

The route is forced on (its thresholds at 0) and a spy records the block_table each Gluon call
got, so each case checks that the kernel it meant to test ran. Cases come from test_kvcache.Case
(ragged cache_seqlens: one sequence empty, one filled to the brim; new keys appended first).
"""

from __future__ import annotations

import pytest
import torch
from tests.test_kvcache import MASKS, Case

from flashkit import kvcache
from flashkit.ops.triton import prefill
from flashkit.testing import assert_close_to_oracle

# choices made under _spy's patched thresholds: made anew in each test, forgotten after it
pytestmark = pytest.mark.usefixtures("fresh_plans")


def _spy(monkeypatch):
    """Every prefill takes the Gluon route; returns the list of the block_table (None:
    contiguous) of each Gluon forward call."""
    from flashkit.ops.triton import forward_hopper

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward runs on sm_90")
    monkeypatch.setattr(prefill, "GLUON_PREFILL_MIN_QUERIES", 0)
    monkeypatch.setattr(prefill, "GLUON_PREFILL_MIN_WORK", 0)
    calls, forward = [], forward_hopper.attention_forward
    monkeypatch.setattr(forward_hopper, "attention_forward",
                        lambda *a, **kw: calls.append(kw.get("block_table")) or forward(*a, **kw))
    return calls


def _case(seqlen_q=512, page_size=64, mask="causal", d=128, capacity=1536, **options):
    """bf16, 16 query heads over 2 (GQA 8:1), 3 sequences appending seqlen_q new tokens."""
    return Case(batch=3, nheads=16, nheads_k=2, d=d, capacity=capacity, seqlen_q=seqlen_q,
                seqlen_new=options.pop("seqlen_new", seqlen_q), dtype=torch.bfloat16,
                page_size=page_size, **options, **MASKS[mask])


def _poison(case):
    """NaN in every cache slot that is not one of a sequence's keys after the append (the
    spare pages, the rest of each last page, unused pages) and -1 / a huge page number in the
    block_table entries past each sequence's last page (only used entries may be read)."""
    used = case.seqlens + case.seqlen_new
    valid = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(used.tolist()):
        for p in range(n):
            valid[case.block_table[b, p // case.page_size], p % case.page_size] = True
        pages, width = -(-n // case.page_size), case.block_table.shape[1]
        padding = torch.tensor([-1, 2**30], dtype=torch.int32).repeat(width)
        case.block_table[b, pages:] = padding[:width - pages]
    for cache in (case.k_cache, case.v_cache):
        cache[~valid] = float("nan")


def _check(case, calls, paged_route=True, **kw):
    """out and lse of a Triton call against the oracle (no append check: NaN slots)."""
    oracle_out, oracle_lse, _ = case.expected(torch.float64)
    base_out, base_lse, _ = case.expected(torch.bfloat16)
    out, lse = case.call("triton", "cuda", **kw)
    assert_close_to_oracle("out", out, oracle_out, base_out)
    assert_close_to_oracle("lse", lse, oracle_lse, base_lse)
    if paged_route:
        assert calls and calls[0] is not None, "the paged Gluon forward was not used"
    else:
        assert not calls, "the Gluon forward took a page size it does not handle"


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("mask", ["causal", "full"])
def test_paged_prefill_matches_oracle_on_gpu(page_size, mask, monkeypatch):
    """Every page size (pieces of a key tile, a tile per page, several tiles per page), shuffled
    pages, NaN everywhere but the keys, a padded block_table; 512 queries at d128."""
    calls = _spy(monkeypatch)
    case = _case(page_size=page_size, mask=mask)
    _poison(case)
    _check(case, calls)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 128])
def test_paged_prefill_unspecialized_tile_on_gpu(page_size, monkeypatch):
    """The configured tile (causal 512 at d128: unspecialized) instead of prefill.tile's: the
    consumer issues its own paged loads; NaN everywhere but the keys."""
    from flashkit.ops.triton.configs import gluon_forward_tile

    calls = _spy(monkeypatch)
    monkeypatch.setattr(prefill, "tile", lambda q, params, page_size: gluon_forward_tile(
        q.shape[-1], q.shape[1], params.window_right is not None))
    case = _case(page_size=page_size, mask="causal")
    _poison(case)
    _check(case, calls)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q,mask", [(128, "causal"), (129, "full"), (777, "causal"),
                                           (2048, "causal"), (2048, "full")])
@pytest.mark.parametrize("page_size", [16, 256])
def test_paged_prefill_query_lengths_on_gpu(seqlen_q, mask, page_size, monkeypatch):
    """Query lengths 128..2k, odd ones included (every forward tile: unspecialized, two
    consumers, persistent); the capacity leaves room for the longest append."""
    calls = _spy(monkeypatch)
    case = _case(seqlen_q=seqlen_q, page_size=page_size, mask=mask, capacity=3072)
    _poison(case)
    _check(case, calls)


PAGED_FEATURES = {  # name: (Case options, call options)
    "window": (dict(mask="full", window=(300, 40)), {}),
    "softcap_alibi_sink": (dict(mask="causal", softcap=3.0, alibi_slopes=torch.rand(3, 16),
                                sink=torch.randn(16)), {}),
    "rotary_int_seqlens": (dict(mask="causal", rotary="neox", seqlens=[700] * 3),
                           {"int": True}),
    "no_append": (dict(mask="causal", seqlen_new=0), {}),
    "mha_d64": (dict(mask="causal", d=64, nheads_k=16, page_size=16), {}),
    "d256": (dict(mask="full", d=256, page_size=32), {}),
    # 256 queries: prefill.tile's one-consumer specialized tile for paged caches
    "q256_page16_softcap_alibi_sink": (dict(seqlen_q=256, page_size=16, mask="causal",
                                            softcap=3.0, alibi_slopes=torch.rand(16),
                                            sink=torch.randn(16)), {}),
    "q256_page32_window": (dict(seqlen_q=256, page_size=32, mask="full", window=(300, 40)), {}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(PAGED_FEATURES))
def test_paged_prefill_features_on_gpu(name, monkeypatch):
    calls = _spy(monkeypatch)
    options, call = PAGED_FEATURES[name]
    options = dict(options)
    if "nheads_k" in options:  # MHA: its own head counts
        nheads_k = options.pop("nheads_k")
        case = Case(batch=3, nheads=nheads_k, nheads_k=nheads_k, d=options.pop("d"),
                    capacity=1536, seqlen_q=256, seqlen_new=256, dtype=torch.bfloat16,
                    page_size=options.pop("page_size"), **MASKS[options.pop("mask")])
    else:
        case = _case(**options)
    _poison(case)
    kw = {"cache_seqlens": int(case.seqlens[0])} if call.get("int") else {}
    _check(case, calls, **kw)


@pytest.mark.gpu
def test_paged_prefill_odd_page_size_stays_on_decode_kernels_on_gpu(monkeypatch):
    """A page of 48 slots (not a power of two) is the decode kernels' (still exact)."""
    calls = _spy(monkeypatch)
    case = _case(page_size=48, capacity=1536)
    _poison(case)
    _check(case, calls, paged_route=False)


CONTIGUOUS = {  # name: (seqlen_q, Case options)
    "q128_causal_leftpad": (128, dict(mask="causal", leftpad=True)),
    "q255_full": (255, dict(mask="full")),
    "q256_window_rotary": (256, dict(mask="window", rotary="interleaved")),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONTIGUOUS))
def test_contiguous_short_prefill_matches_oracle_on_gpu(name, monkeypatch):
    """The contiguous route below 512 queries (rows permuted through cache_batch_idx, a spare
    row, leftpad): what the thresholds may send there."""
    calls = _spy(monkeypatch)
    seqlen_q, options = CONTIGUOUS[name]
    case = _case(seqlen_q=seqlen_q, page_size=None, **options)
    oracle_out, oracle_lse, k_rot64 = case.expected(torch.float64)
    base_out, base_lse, _ = case.expected(torch.bfloat16)
    k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
    out, lse = case.call("triton", "cuda")
    assert calls == [None], "the contiguous Gluon forward was not used"
    assert_close_to_oracle("out", out, oracle_out, base_out)
    assert_close_to_oracle("lse", lse, oracle_lse, base_lse)
    case.check_append(k_before, v_before, k_rot64)


def test_route_declines_cpu_tensors():
    """No Gluon off CUDA: the decode kernels (or the interpreter) take CPU tensors."""
    q = torch.zeros(1, 512, 2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 2, 64, dtype=torch.bfloat16)
    assert prefill.declines(q, cache, torch.zeros(1, 4, dtype=torch.int32),
                            2**40) == "not a CUDA tensor"


LONG, ONE_CONSUMER = (128, 2, 2, True, True, False), (128, 2, 1, True, False, False)


@pytest.mark.parametrize("seqlen_q,nheads,page_size,tile", [
    (512, 32, None, LONG),  # 128 programs of the long-query tile: about every SM
    (512, 32, 16, LONG),
    (256, 32, None, (64, 3, 1, False, False, False)),  # 64: the configured (unspecialized) tile
    (256, 32, 16, ONE_CONSUMER),  # paged: a producer warp per consumer
    (256, 32, 128, ONE_CONSUMER),
    (2048, 4, None, LONG),  # the configured tile is specialized already
])
def test_prefill_tile_choice(seqlen_q, nheads, page_size, tile, monkeypatch):
    """prefill.tile at d128 causal on a device of 132 SMs (no GPU needed)."""
    from flashkit.ops.triton import forward_hopper

    monkeypatch.setattr(forward_hopper, "programs_per_device",
                        lambda device, consumers: 132 * (2 if consumers == 1 else 1))
    q = torch.empty(1, seqlen_q, nheads, 128, dtype=torch.bfloat16, device="meta")
    params = kvcache.build_params(q, 0.0, None, True, (-1, -1), 0.0, None, False, None, batch=1)
    assert prefill.tile(q, params, page_size) == tile
