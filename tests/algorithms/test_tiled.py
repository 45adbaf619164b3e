import math

import pytest
import torch

from flashkit import reference
from flashkit.algorithms.tiled import flash1_forward, flash2_forward

F64 = torch.float64
FORWARDS = [flash1_forward, flash2_forward]


def inputs(batch, seqlen_q, seqlen_k, d=8, dv=6, seed=0):
    """q, k, v in the teaching layout (..., seqlen, d)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*batch, seqlen_q, d, dtype=F64, generator=gen),
            torch.randn(*batch, seqlen_k, d, dtype=F64, generator=gen),
            torch.randn(*batch, seqlen_k, dv, dtype=F64, generator=gen))


def oracle(q, k, v, **kw):
    """flashkit.reference on (batch, heads, s, d) tensors, answered in the same layout."""
    out, lse = reference.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
    return out.transpose(1, 2), lse


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k",
                         [(1, 1), (3, 17), (17, 3), (113, 203), (203, 113), (64, 64)])
@pytest.mark.parametrize("block_q,block_k", [(16, 32), (7, 5)])  # ragged; bigger than seqlen
def test_matches_reference(forward, causal, seqlen_q, seqlen_k, block_q, block_k):
    q, k, v = inputs((2, 3), seqlen_q, seqlen_k, seed=seqlen_q * 1000 + seqlen_k)
    res = forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    out, lse = oracle(q, k, v, causal=causal)
    torch.testing.assert_close(res.out, out, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(res.lse, lse, rtol=1e-12, atol=1e-14)  # -inf rows must match


@pytest.mark.parametrize("forward", FORWARDS)
def test_scale_and_rows_without_keys(forward):
    q, k, v = inputs((1, 2), 20, 9, d=40, dv=24, seed=3)
    res = forward(q, k, v, causal=True, scale=0.3, block_q=8, block_k=4)
    out, lse = oracle(q, k, v, causal=True, softmax_scale=0.3)
    torch.testing.assert_close(res.out, out, rtol=1e-12, atol=1e-14)
    # Causal with Nq > Nk: the first Nq - Nk = 11 rows see no key -> out 0, lse -inf.
    assert torch.equal(res.out[..., :11, :], torch.zeros_like(res.out[..., :11, :]))
    assert torch.isneginf(res.lse[..., :11]).all() and torch.isfinite(res.lse[..., 11:]).all()


def tile_sizes(n, block):
    return [min(block, n - start) for start in range(0, n, block)]


def visible_tiles(seqlen_q, seqlen_k, block_q, block_k, causal):
    """(rows, cols) sizes of the tiles holding at least one visible pair, from the oracle's mask."""
    keep = reference.visible(seqlen_q, seqlen_k, None, 0 if causal else None)
    tiles = []
    for r0, br in zip(range(0, seqlen_q, block_q), tile_sizes(seqlen_q, block_q), strict=True):
        for c0, bc in zip(range(0, seqlen_k, block_k), tile_sizes(seqlen_k, block_k),
                          strict=True):
            if keep[r0:r0 + br, c0:c0 + bc].any():
                tiles.append((br, bc))
    return tiles


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(50, 70), (70, 50), (64, 64)])
def test_hbm_traffic(causal, seqlen_q, seqlen_k):
    d, dv, block_q, block_k, heads = 8, 6, 16, 32, 2
    q, k, v = inputs((heads,), seqlen_q, seqlen_k, d=d, dv=dv)
    tiles = visible_tiles(seqlen_q, seqlen_k, block_q, block_k, causal)
    rows_visited = sum(br for br, _ in tiles)  # sum over visited tiles of Br
    cols_visited = sum(bc for _, bc in tiles)  # sum over visited tiles of Bc

    fa1 = flash1_forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    # K and V once; Q, O, l, m once per visited tile; O, l, m also written once at the start.
    assert fa1.reads == {name: heads * n for name, n in {
        "K": seqlen_k * d, "V": seqlen_k * dv, "Q": rows_visited * d,
        "O": rows_visited * dv, "l": rows_visited, "m": rows_visited}.items()}
    assert fa1.writes == {name: heads * n for name, n in {
        "O": (seqlen_q + rows_visited) * dv, "l": seqlen_q + rows_visited,
        "m": seqlen_q + rows_visited}.items()}

    fa2 = flash2_forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    # Q once; K and V once per visited tile; O and L written once.
    assert fa2.reads == {name: heads * n for name, n in {
        "Q": seqlen_q * d, "K": cols_visited * d, "V": cols_visited * dv}.items()}
    assert fa2.writes == {"O": heads * seqlen_q * dv, "L": heads * seqlen_q}

    if not causal:  # the closed forms of the module docstring
        tr, tc = math.ceil(seqlen_q / block_q), math.ceil(seqlen_k / block_k)
        assert fa1.reads["Q"] == tc * q.numel() and fa1.writes["O"] == (tc + 1) * fa1.out.numel()
        assert fa2.reads["K"] == tr * k.numel() and fa2.reads["V"] == tr * v.numel()

