"""The Gluon forward (flashkit.ops.triton.forward_hopper): which calls take it, which tile the
table gives, and its outputs against the float64 oracle (DESIGN section 5) on every case it
takes, with each schedule of configs.GLUON_FORWARD_TILES' kind (one warpgroup issuing its own
loads; producer warp with one, two or three consumers, with and without ping-pong), dropout
against the oracle with the Triton kernels' own keep-mask."""

from __future__ import annotations

import importlib

import pytest
import torch
from tests.ops.test_triton import DEVICE, make_inputs

from flashkit.ops.params import AttentionParams
from flashkit.ops.triton.configs import GLUON_FORWARD_TILES, gluon_forward_tile
from flashkit.reference import attention_with_params
from flashkit.testing import assert_close_to_oracle, dropout_keep_mask, poison

hopper = importlib.import_module("flashkit.ops.triton.forward_hopper")

# (BLOCK_N, NUM_STAGES, CONSUMERS, SPECIALIZED, PINGPONG)
SCHEDULES = {
    "inline": (64, 3, 1, False, False),
    "producer": (128, 2, 1, True, False),
    "two": (128, 2, 2, True, False),
    "pingpong": (64, 2, 2, True, True),
    "three": (128, 2, 3, True, True),
}
WIDE = (256, 2, 1, False, False)  # d64 only (a 64 x 256 score tile per warpgroup)


def _on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_eligibility():
    """Every feature but varlen and an SDPA bias is taken; those and other head dims are not."""
    q, k, v, _ = make_inputs(1, 100, 37, 2, 1, 64, 64, torch.float16)
    taken = DEVICE == "cuda" and _on_hopper()
    slopes = torch.ones(2, device=q.device)
    for params in (AttentionParams(0.125, None, 0), AttentionParams(0.125, 7, 3),
                   AttentionParams(0.125, None, None, softcap=5.0, alibi_slopes=slopes,
                               sink=slopes), AttentionParams(0.125, dropout_p=0.1)):
        assert hopper.eligible(q, k, v, params, None, None, None) == taken
    assert not hopper.eligible(q, k, v, AttentionParams(0.125, attn_bias=torch.zeros(
        1, 2, 100, 37)), None, None, None)
    q80, k80, v80, _ = make_inputs(1, 64, 64, 2, 2, 80, 80, torch.float16)
    assert not hopper.eligible(q80, k80, v80, AttentionParams(0.125), None, None, None)
    assert not hopper.eligible(q, k, v, AttentionParams(0.125), None, None, (64, 64, 4, 2))


def test_tile_table():
    """Every head dim, band and length has a tile; the first matching row wins."""
    for head_dim in (64, 128):
        for banded in (False, True):
            for seqlen in (1, 1024, 1025, 16384):
                tile = gluon_forward_tile(head_dim, seqlen, banded)
                assert len(tile) == 5 and tile[2] in (1, 2, 3)
    for head_dim, banded, longest, tile in GLUON_FORWARD_TILES:
        if longest is not None:
            assert gluon_forward_tile(head_dim, longest, bool(banded)) == tile
    with pytest.raises(KeyError):
        gluon_forward_tile(80, 1024, False)


def test_launch_config_fits_the_register_file():
    for tile in (*SCHEDULES.values(), WIDE):
        config = hopper.launch_config(tile)
        if tile[3]:  # specialized: producer + consumers within maxnreg * warpgroups
            warpgroups = tile[2] + 1
            assert (hopper.PRODUCER_REGS + tile[2] * config["CONSUMER_REGS"]
                    <= config["maxnreg"] * warpgroups)


def _params(head_dim, window, features, nheads, device):
    left, right = window
    gen = torch.Generator(device="cpu").manual_seed(head_dim + nheads)
    extra = {}
    if "softcap" in features:
        extra["softcap"] = 3.0
    if "alibi" in features:
        extra["alibi_slopes"] = (torch.rand(nheads, generator=gen) * 0.3).to(device)
    if "alibi_batch" in features:
        extra["alibi_slopes"] = (torch.rand(2, nheads, generator=gen) * 0.3).to(device)
    if "sink" in features:
        extra["sink"] = (torch.randn(nheads, generator=gen) * 2).to(device)
    if "dropout" in features:
        extra.update(dropout_p=0.17, dropout_seed=2**40 + 12345 + head_dim)
    return AttentionParams(head_dim ** -0.5 * 1.3, left, right, **extra)


def check_forward(q, k, v, params, tile):
    """Gluon forward into NaN-poisoned buffers vs the oracle; out and lse by section 5's rule.
    Dropout: the oracle drops what the Triton kernels' keep-mask drops."""
    out = poison(torch.empty_like(q))
    lse = poison(torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32,
                             device=q.device))
    out, lse = hopper.attention_forward(q, k, v, params, out=out, lse=lse, tile=tile)
    mask = None
    if params.dropout_p > 0:
        mask = dropout_keep_mask(params.dropout_seed, q.shape[0], q.shape[2], q.shape[1],
                                 k.shape[1], params.dropout_p, backend="triton", device=q.device)
    oracle = attention_with_params(q.double(), k.double(), v.double(), params, mask)
    baseline = attention_with_params(q, k, v, params, mask)
    assert_close_to_oracle("out", out, oracle[0], baseline[0])
    assert_close_to_oracle("lse", lse, oracle[1], baseline[1])


GPU_CASES = [  # (dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_k, window, features)
    (torch.bfloat16, 128, 64, 64, 2, 2, (None, 0), ()),
    (torch.bfloat16, 128, 1088, 1088, 4, 1, (None, 0), ()),
    (torch.float16, 128, 640, 640, 4, 4, (None, None), ()),
    (torch.bfloat16, 64, 1152, 1152, 4, 2, (None, 0), ()),
    (torch.bfloat16, 128, 1, 1, 2, 2, (None, None), ()),
    (torch.float16, 64, 3, 17, 2, 1, (None, 0), ()),
    (torch.bfloat16, 128, 203, 113, 4, 2, (None, 0), ()),  # rows before the diagonal: lse -inf
    (torch.bfloat16, 64, 113, 1000, 4, 4, (None, 0), ()),
    (torch.float16, 128, 1000, 1023, 2, 2, (None, None), ()),
    (torch.bfloat16, 128, 1023, 1023, 2, 1, (100, 0), ()),
    (torch.bfloat16, 64, 517, 700, 2, 2, (7, 3), ()),
    (torch.float16, 128, 333, 300, 2, 2, (0, 0), ()),
    (torch.bfloat16, 64, 300, 333, 2, 2, (5, None), ()),
    (torch.bfloat16, 128, 260, 260, 2, 2, (None, 40), ()),
    (torch.bfloat16, 128, 777, 777, 4, 2, (None, 0), ("softcap", )),
    (torch.float16, 64, 500, 650, 2, 2, (None, None), ("alibi", )),
    (torch.bfloat16, 128, 650, 500, 2, 2, (None, 0), ("alibi_batch", )),
    (torch.bfloat16, 128, 300, 300, 4, 4, (None, None), ("sink", )),
    (torch.float16, 64, 203, 203, 2, 2, (None, 0), ("sink", )),
    (torch.bfloat16, 128, 1024, 1024, 2, 1, (256, 0), ("softcap", "alibi", "sink")),
    (torch.bfloat16, 128, 1000, 1500, 2, 2, (None, None), ("alibi", )),  # both sides' tiles
    (torch.float16, 64, 1300, 700, 2, 1, (300, 200), ("alibi", "softcap")),
    (torch.bfloat16, 128, 700, 700, 4, 2, (None, None), ("dropout", )),
    (torch.float16, 64, 1000, 1023, 2, 2, (None, 0), ("dropout", )),
    (torch.bfloat16, 128, 203, 600, 2, 1, (64, 5), ("dropout", "alibi", "sink", "softcap")),
]


def _run_case(case, tile):
    dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_k, window, features = case
    q, k, v, _ = make_inputs(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim,
                             dtype, "cuda")
    params = _params(head_dim, window, features, nheads, "cuda")
    assert hopper.eligible(q, k, v, params, None, None, None)
    check_forward(q, k, v, params, tile)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_gluon_forward_matches_oracle(case):
    """Every case with the configured tiles (what forward.py dispatches to)."""
    _run_case(case, None)


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("case", [GPU_CASES[i] for i in (1, 6, 10, 19, 20, 22, 24)], ids=str)
def test_gpu_gluon_schedules_match_oracle(case, schedule):
    """Each schedule on causal GQA, rows without keys, a two-sided window, every feature,
    ALiBi on both sides of the diagonal, dropout (tiles of 64 and 128 keys)."""
    _run_case(case, SCHEDULES[schedule])


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", [GPU_CASES[i] for i in (10, 15, 23)], ids=str)
def test_gpu_gluon_wide_tile_matches_oracle(case):
    """d64's 256-key tile (two Philox chunks per dropout draw)."""
    _run_case(case, WIDE)

