"""The shard layouts and the ring planner, without processes: pure index arithmetic.

The planner's promise: over the W steps of the ring, its calls (each a sub-block with a window)
cover every visible (query, key) pair of the global mask exactly once and nothing else.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import flashkit.distributed as fd
from flashkit.distributed.layout import segments
from flashkit.distributed.plan import plan_block, ring_plans
from flashkit.reference import alibi_distance, visible


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(layout, world):
    x = torch.randn(3, world * 2 * 5, 2)
    shards = [fd.shard(x, 1, r, world, layout) for r in range(world)]
    assert all(s.shape == (3, 10, 2) for s in shards)
    assert torch.equal(fd.unshard(shards, 1, layout), x)


def test_zigzag_shard_holds_chunks_r_and_mirror():
    x = torch.arange(16)  # W = 4: 8 chunks of 2
    assert fd.shard(x, 0, 1, 4, "zigzag").tolist() == [2, 3, 12, 13]  # chunks 1 and 6
    assert fd.shard(x, 0, 3, 4, "zigzag").tolist() == [6, 7, 8, 9]  # chunks 3 and 4
    assert segments("zigzag", 1, 4, 4) == [(0, 2, 2), (2, 12, 2)]


def test_varlen_shard_round_trip():
    cu = torch.tensor([0, 8, 8, 12, 28], dtype=torch.int32)  # lengths 8, 0, 4, 16; W = 2
    x = torch.randn(28, 3)
    shards, locals_ = zip(*(fd.shard_varlen(x, cu, r, 2, "zigzag") for r in range(2)),
                          strict=True)
    assert locals_[0].tolist() == [0, 4, 4, 6, 14]
    assert torch.equal(fd.unshard_varlen(list(shards), locals_[0], "zigzag"), x)


@pytest.mark.parametrize("bad, match", [
    (lambda: fd.shard(torch.zeros(6), 0, 0, 2, "zigzag"), "does not split into 4"),
    (lambda: fd.shard(torch.zeros(6), 0, 2, 2, "contiguous"), "rank: expected 0 <= rank"),
    (lambda: fd.shard(torch.zeros(6), 0, 0, 2, "striped"), "layout: expected one of"),
])
def test_layout_helpers_reject(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def _global_indices(segs) -> torch.Tensor:
    return torch.cat([torch.arange(s.start, s.start + s.length) for s in segs]
                     + [torch.zeros(0, dtype=torch.long)])


def _coverage(calls, sq, sk) -> torch.Tensor:
    """How many times the calls compute each (local query, local key) pair."""
    count = torch.zeros(sq, sk, dtype=torch.int)
    for c in calls:
        assert c.q.start < c.q.stop and c.k.start < c.k.stop, f"empty call {c}"
        count[c.q, c.k] += visible(c.q.stop - c.q.start, c.k.stop - c.k.start,
                                   c.window_left, c.window_right).int()
    return count


WINDOWS = [(None, None), (None, 0), (3, 0), (0, 0), (2, 5), (None, 4), (9, None), (1, -1)]


def _check_alibi_distances(calls, distance: torch.Tensor) -> None:
    """Each call's own ALiBi distance, signed and offset as planned, is the global one."""
    for c in calls:
        sq, sk = c.q.stop - c.q.start, c.k.stop - c.k.start
        own = visible(sq, sk, c.window_left, c.window_right)
        rebuilt = c.alibi_sign * alibi_distance(sq, sk) + c.alibi_offset
        assert torch.equal(rebuilt[own], distance[c.q, c.k][own]), c


@pytest.mark.parametrize("alibi", [False, True], ids=["", "alibi"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_plan_covers_the_global_mask_exactly_once(layout, world, window, alibi):
    for shard_q, shard_k in [(6, 6), (2, 8), (10, 4), (0, 4)]:
        mask = visible(world * shard_q, world * shard_k, *window)
        distance = alibi_distance(world * shard_q, world * shard_k)
        for rank, src in itertools.product(range(world), repeat=2):
            q_segs = segments(layout, rank, world, shard_q)
            k_segs = segments(layout, src, world, shard_k)
            calls = plan_block(q_segs, k_segs, world * (shard_k - shard_q), *window, alibi)
            rows, cols = _global_indices(q_segs), _global_indices(k_segs)
            want = mask[rows][:, cols].int()
            assert torch.equal(_coverage(calls, shard_q, shard_k), want), (rank, src, calls)
            if alibi:
                _check_alibi_distances(calls, distance[rows][:, cols])


@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_causal_is_one_balanced_call_per_step(world):
    """Zigzag + causal: every rank makes one call per step, with the same work at every step."""
    n = 8
    for rank in range(world):
        plans = ring_plans("zigzag", rank, world, [n], [n], None, 0)
        assert all(len(calls) == 1 for calls in plans)
        own = plans[0][0]
        assert (own.q, own.k, own.window_left, own.window_right) == (slice(0, n), slice(0, n),
                                                                      None, 0)
        areas = [(c.q.stop - c.q.start) * (c.k.stop - c.k.start) for (c,) in plans[1:]]
        assert areas == [n * n // 2] * (world - 1)  # half a block, no mask: full tiles only


def test_contiguous_causal_skips_future_shards():
    plans = ring_plans("contiguous", 1, 4, [8], [8], None, 0)  # rank 1 holds src 1, 0, 3, 2
    assert [len(c) for c in plans] == [1, 1, 0, 0]
    assert plans[1][0].window_left is None and plans[1][0].window_right is None


def test_varlen_plans_each_sequence_at_its_offset():
    plans = ring_plans("contiguous", 0, 2, [3, 0, 5], [3, 0, 5], None, 0)
    own = plans[0]
    assert [(c.q, c.k) for c in own] == [(slice(0, 3), slice(0, 3)), (slice(3, 8), slice(3, 8))]
    assert plans[1] == ()  # rank 0 sees nothing of rank 1's later tokens
