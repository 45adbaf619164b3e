"""The Gluon forward (flashkit.ops.triton.forward_hopper): which calls take it, which tile the
table gives, and its outputs against the float64 oracle (docs/design.md section 5) on every case it
takes, dense and varlen (packed sequences, lengths 0 and 1, a contiguous cache through
seqused_k), at head dims 64, 128 and 256, with each schedule of configs.GLUON_FORWARD_TILES'
kind (one warpgroup issuing its own loads; producer warp with one, two or three consumers, with
and without ping-pong, persistent), dropout against the oracle with the Triton kernels' own
keep-mask and, bit for bit, against the Triton varlen kernel's dropped elements."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from tests.ops.test_triton import DEVICE, make_inputs

from flashkit.ops.params import AttentionParams
from flashkit.ops.triton.common import LOG2E
from flashkit.ops.triton.configs import (
    GLUON_FORWARD_TILES,
    gluon_forward_tile,
    tile_config,
)
from flashkit.reference import attention_with_params
from flashkit.testing import assert_close_to_oracle, dropout_keep_mask, poison
from flashkit.variants import library
from flashkit.variants.mods import ScoreMod, Variant
from helpers import ON_HOPPER

hopper = importlib.import_module("flashkit.ops.triton.forward_hopper")
triton_forward = importlib.import_module("flashkit.ops.triton.forward")  # the module

# (BLOCK_N, NUM_STAGES, CONSUMERS, SPECIALIZED, PINGPONG, PERSISTENT)
SCHEDULES = {
    "inline": (64, 3, 1, False, False, False),
    "producer": (128, 2, 1, True, False, False),
    "two": (128, 2, 2, True, False, False),
    "pingpong": (64, 2, 2, True, True, False),
    "three": (128, 2, 3, True, True, False),
    "persistent": (128, 2, 2, True, True, True),
    "persistent_three": (64, 2, 3, True, False, True),
}
WIDE = (256, 2, 1, False, False, False)  # d64 only (a 64 x 256 score tile per warpgroup)
# Head dim 256 (a 64 x 256 fp32 O is 128 registers per thread; 32 KB per 64-key K or V buffer):
# the schedules whose shared memory fits besides the configured one.
D256_SCHEDULES = {
    "inline": (64, 2, 1, False, False, False),
    "two": (64, 2, 2, True, False, False),
    "narrow": (32, 4, 2, True, True, False),
    "persistent": (64, 2, 2, True, True, True),
}


def test_eligibility():
    """Every feature and varlen are taken (varlen only where the caller of gluon_declines says
    it takes it), head dims 64, 128 and 256; an SDPA bias and other head dims are not."""
    q, k, v, _ = make_inputs(1, 100, 37, 2, 1, 64, 64, torch.float16)
    taken = DEVICE == "cuda" and ON_HOPPER
    slopes = torch.ones(2, device=q.device)
    for params in (AttentionParams(0.125, None, 0), AttentionParams(0.125, 7, 3),
                   AttentionParams(0.125, None, None, softcap=5.0, alibi_slopes=slopes,
                               sink=slopes), AttentionParams(0.125, dropout_p=0.1)):
        assert hopper.eligible(q, k, v, params, None, None, None) == taken
    packed = [x[0] for x in (q, k, v)]
    cu = torch.tensor([0, 37], dtype=torch.int32, device=q.device)
    varlen = AttentionParams(0.125, None, 0, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=37,
                             max_seqlen_k=37)
    assert hopper.eligible(*packed, varlen, None, None, None) == taken
    assert hopper.gluon_declines(*packed, varlen) is not None
    assert not hopper.eligible(q, k, v, AttentionParams(0.125, attn_bias=torch.zeros(
        1, 2, 100, 37)), None, None, None)
    q80, k80, v80, _ = make_inputs(1, 64, 64, 2, 2, 80, 80, torch.float16)
    assert not hopper.eligible(q80, k80, v80, AttentionParams(0.125), None, None, None)
    q256, k256, v256, _ = make_inputs(1, 64, 64, 2, 2, 256, 256, torch.float16)
    assert hopper.eligible(q256, k256, v256, AttentionParams(0.125), None, None, None) == taken
    assert (hopper.gluon_declines(q256, k256, v256, AttentionParams(0.125)) is None) == taken
    assert not hopper.eligible(q, k, v, AttentionParams(0.125), None, None, (64, 64, 4, 2))


def test_tile_table():
    """Every head dim, band and length has a tile; the first matching row wins."""
    for head_dim in (64, 128, 256):
        for banded in (False, True):
            for seqlen in (1, 1024, 1025, 16384):
                tile = gluon_forward_tile(head_dim, seqlen, banded)
                assert len(tile) == 6 and tile[2] in (1, 2, 3)
    for head_dim, banded, longest, tile in GLUON_FORWARD_TILES:
        if longest is not None:
            assert gluon_forward_tile(head_dim, longest, bool(banded)) == tile
    with pytest.raises(KeyError):
        gluon_forward_tile(80, 1024, False)


def test_launch_config_fits_the_register_file():
    for tile in (*SCHEDULES.values(), WIDE, *D256_SCHEDULES.values()):
        config = hopper.launch_config(tile)
        if tile[3]:  # specialized: producer + consumers within maxnreg * warpgroups
            warpgroups = tile[2] + 1
            assert (hopper.PRODUCER_REGS + tile[2] * config["CONSUMER_REGS"]
                    <= config["maxnreg"] * warpgroups)


def test_launch_key_of_descriptors_determines_tritons_specialisation():
    """launch's key of a TMA descriptor argument (launch.tensor_key) determines Triton's
    specialisation of it (so equal keys launch the same compiled kernel): descriptors over views
    of several lengths, head counts, head dims, dtypes and boxes, as flash_descriptor makes."""
    import itertools

    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from flashkit.ops.triton.launch import tensor_key

    spec = lambda a: native_specialize_impl(BaseBackend, a, False, True, True)  # noqa: E731
    descriptors = [hopper.flash_descriptor(torch.empty(1, tokens, heads, d, dtype=dtype), rows,
                                           box)
                   for tokens, heads in ((64, 1), (200, 3), (4096, 16))
                   for d in (64, 128) for dtype in (torch.float16, torch.bfloat16)
                   for rows, box in ((64, None), (128, None), (128, 16))]
    for a, b in itertools.combinations(descriptors, 2):
        assert (tensor_key(a) == tensor_key(b)) <= (spec(a) == spec(b)), (tensor_key(a), spec(a))
    assert len({tensor_key(a) for a in descriptors}) == len({spec(a) for a in descriptors})


def _params(head_dim, window, features, nheads, device, batch=2, **varlen):
    left, right = window
    gen = torch.Generator(device="cpu").manual_seed(head_dim + nheads)
    extra = {}
    if "softcap" in features:
        extra["softcap"] = 3.0
    if "alibi" in features:
        extra["alibi_slopes"] = (torch.rand(nheads, generator=gen) * 0.3).to(device)
    if "alibi_batch" in features:
        extra["alibi_slopes"] = (torch.rand(batch, nheads, generator=gen) * 0.3).to(device)
    if "sink" in features:
        extra["sink"] = (torch.randn(nheads, generator=gen) * 2).to(device)
    if "dropout" in features:
        extra.update(dropout_p=0.17, dropout_seed=2**40 + 12345 + head_dim)
    return AttentionParams(head_dim ** -0.5 * 1.3, left, right, **extra, **varlen)


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


def _run_case(case, tile, heads_major=False):
    """The case's forward against the oracle; heads_major: q, k, v with SDPA's (batch, heads,
    seqlen, d) memory seen as (batch, seqlen, heads, d), which the kernel reads in place."""
    dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_k, window, features = case
    q, k, v, _ = make_inputs(2, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim,
                             dtype, "cuda")
    if heads_major:
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    params = _params(head_dim, window, features, nheads, "cuda")
    assert hopper.eligible(q, k, v, params, None, None, None)
    check_forward(q, k, v, params, tile)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_gluon_forward_matches_oracle(case):
    """Every case with the configured tiles (what forward.py dispatches to)."""
    _run_case(case, None)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("case", [GPU_CASES[i] for i in (1, 6, 10, 19, 20, 22, 24)], ids=str)
def test_gpu_gluon_schedules_match_oracle(case, schedule):
    """Each schedule on causal GQA, rows without keys, a two-sided window, every feature,
    ALiBi on both sides of the diagonal, dropout (tiles of 64 and 128 keys)."""
    _run_case(case, SCHEDULES[schedule])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", [GPU_CASES[i] for i in (10, 15, 23)], ids=str)
def test_gpu_gluon_wide_tile_matches_oracle(case):
    """d64's 256-key tile (two Philox chunks per dropout draw)."""
    _run_case(case, WIDE)


def test_bounded_scores_fix_the_row_max_where_the_dtype_holds_it():
    """A fixed row max (SOFTCAP_BOUNDED) for the hardware tanh without ALiBi or a sink, up to
    c = 34.6 (bf16) and 5.2 (fp16); the running max past those, for the exact tanh, with ALiBi
    or a sink. The same for a score_mod's declared bound, with no built-in softcap beside it;
    a score_mod without a bound keeps the running max."""
    fast, exact = hopper.SOFTCAP_FAST, hopper.SOFTCAP_FAST - 1
    slopes = torch.ones(2)
    for dtype, c, features, taken in ((torch.bfloat16, 34.6, {}, True),
                                      (torch.bfloat16, 34.7, {}, False),
                                      (torch.float16, 5.19, {}, True),
                                      (torch.float16, 5.21, {}, False),
                                      (torch.float32, 1.0, {}, False),
                                      (torch.bfloat16, 3.0, dict(alibi_slopes=slopes), False),
                                      (torch.bfloat16, 3.0, dict(sink=slopes), False)):
        offset = 15.0 if dtype == torch.float16 else 0.0
        params = AttentionParams(0.125, softcap=c, **features)
        got = hopper.bounded_scores(params, dtype, c * LOG2E, fast)
        assert got == ((hopper.SOFTCAP_BOUNDED, c * LOG2E - offset) if taken else (fast, 0.0))
        assert hopper.bounded_scores(params, dtype, c * LOG2E, exact) == (exact, 0.0)
        bounded = Variant(ScoreMod(library._softcap, c, bound=c))
        params = AttentionParams(0.125, variant=bounded, **features)
        got = hopper.bounded_scores(params, dtype, 0.125 * LOG2E, 0)
        assert got == ((hopper.SOFTCAP_BOUNDED, pytest.approx(c * LOG2E - offset)) if taken
                       else (0, 0.0)), (dtype, c, features)
        with_softcap = AttentionParams(0.125, softcap=c, variant=bounded, **features)
        assert hopper.bounded_scores(with_softcap, dtype, c * LOG2E, fast) == (fast, 0.0)
    unbounded = AttentionParams(0.125, variant=Variant(ScoreMod(library._softcap, 3.0)))
    assert hopper.bounded_scores(unbounded, torch.bfloat16, 0.125 * LOG2E, 0) == (0, 0.0)


# (dtype, head_dim, softcap, window): at each dtype's bound for the fixed row max and past it
SOFTCAP_BOUND_CASES = [
    (torch.bfloat16, 128, 34.0, (None, None)),
    (torch.bfloat16, 64, 34.0, (None, 0)),
    (torch.bfloat16, 128, 50.0, (None, 0)),
    (torch.float16, 128, 5.0, (None, 0)),
    (torch.float16, 64, 5.0, (None, None)),
    (torch.float16, 128, 30.0, (None, None)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("written", ["softcap=", "score_mod"])
@pytest.mark.parametrize("schedule", [None, "inline", "persistent"])
@pytest.mark.parametrize("case", SOFTCAP_BOUND_CASES, ids=str)
def test_gpu_gluon_softcap_saturated_rows_match_oracle(case, schedule, written):
    """Softcaps at the fixed row max's bound (bounded_scores) and past it, on rows whose every
    score is far below 0 (q . k shifted by -800: tanh near -1, so P = 2^(s - m) near 2^-98 in
    bf16 at c = 34) beside rows of ordinary scores; 300 rows, 700 keys (a key tail). Built in,
    and as the library's score_mod with the GPU's tanh (its bound c)."""
    dtype, head_dim, softcap, (left, right) = case
    q, k, v, _ = make_inputs(2, 300, 700, 4, 2, head_dim, head_dim, dtype, "cuda")
    q[:, ::2, :, :8] = 10.0  # even rows: q . k = -800 + O(10) against every key
    k[..., :8] = -10.0
    if written == "softcap=":
        params = AttentionParams(head_dim ** -0.5 * 1.3, left, right, softcap=softcap)
    else:
        params = AttentionParams(head_dim ** -0.5 * 1.3, left, right,
                                 variant=Variant(library.softcap(softcap, approx=True)))
    check_forward(q, k, v, params, SCHEDULES.get(schedule))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("written", ["softcap=", "score_mod"])
@pytest.mark.parametrize("dtype, softcap", [(torch.bfloat16, 30.0), (torch.float16, 5.0)])
def test_gpu_gluon_bounded_rows_of_one_key_return_its_value(dtype, softcap, written):
    """Under the fixed row max no P is exactly 1: a causal row 0 (one key) returns that key's v
    exactly only if l sums the rounded P the P V wgmma multiplies (_softmax_step); v in
    [1, 2) puts a rounding of P at a whole ulp of out. Every row against the oracle too."""
    q, k, v, _ = make_inputs(2, 300, 300, 4, 2, 128, 128, dtype, "cuda")
    v = (v.abs() % 1 + 1).to(dtype)
    if written == "softcap=":  # (the flag and qk_scale the launcher passes bounded_scores)
        params = AttentionParams(128 ** -0.5, None, 0, softcap=softcap)
        flag, qk_scale = hopper.SOFTCAP_FAST, softcap * LOG2E
    else:
        params = AttentionParams(128 ** -0.5, None, 0,
                                 variant=Variant(library.softcap(softcap, approx=True)))
        flag, qk_scale = 0, 128 ** -0.5 * LOG2E
    assert hopper.bounded_scores(params, dtype, qk_scale, flag)[0] == hopper.SOFTCAP_BOUNDED
    out, _ = hopper.attention_forward(q, k, v, params)
    assert torch.equal(out[:, 0], v[:, 0].repeat_interleave(2, dim=1))
    check_forward(q, k, v, params, None)


def at_head_dim(case, head_dim):
    """A case of GPU_CASES, TAIL_CASES or VARLEN_CASES at another head dim."""
    return (case[0], head_dim, *case[2:])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("schedule", [None, *sorted(D256_SCHEDULES)])
@pytest.mark.parametrize("case", [at_head_dim(c, 256) for c in GPU_CASES], ids=str)
def test_gpu_gluon_d256_matches_oracle(case, schedule):
    """Head dim 256: every case (each feature, window, GQA, awkward length) with the configured
    tile and each schedule that fits its shared memory."""
    _run_case(case, D256_SCHEDULES.get(schedule))



def non_finite_(x):
    """Fill x in place with NaN, inf and -inf in turn (rows a kernel must not let through)."""
    flat = x.view(-1)
    for i, value in enumerate((float("nan"), float("inf"), float("-inf"))):
        flat[i::3] = value
    return x


TAIL_CASES = [  # (dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_k, window, features)
    (torch.bfloat16, 128, 203, 300, 2, 1, (None, 0), ()),
    (torch.float16, 64, 1000, 1023, 2, 2, (None, None), ("softcap", )),
    (torch.bfloat16, 128, 517, 700, 2, 2, (7, 3), ("sink", )),
]


TAIL_SCHEDULES = [(case, tile) for case in TAIL_CASES for tile in SCHEDULES.values()] + [
    (at_head_dim(case, 256), tile) for case in TAIL_CASES for tile in D256_SCHEDULES.values()]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize(("case", "tile"), TAIL_SCHEDULES, ids=str)
def test_gpu_gluon_next_batch_entry_does_not_leak(case, tile):
    """Dense, seqlen_k not a multiple of the key tile: entry b's last tile reads entry b + 1's
    first rows. With NaN/inf in entry 1's q, k and v, entries 0 and 2 still equal the oracle
    on their finite data (P = 0 there, and V's rows past the end are zeroed: 0 * NaN in P V
    would be NaN)."""
    dtype, head_dim, seqlen_q, seqlen_k, nheads, nheads_k, window, features = case
    q, k, v, _ = make_inputs(3, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, head_dim,
                             dtype, "cuda")
    for x in (q, k, v):
        non_finite_(x[1])
    params = _params(head_dim, window, features, nheads, "cuda")
    out = poison(torch.empty_like(q))
    lse = poison(torch.empty(3, nheads, seqlen_q, dtype=torch.float32, device="cuda"))
    out, lse = hopper.attention_forward(q, k, v, params, out=out, lse=lse, tile=tile)
    finite = [0, 2]
    qf, kf, vf = (x[finite] for x in (q, k, v))
    oracle = attention_with_params(qf.double(), kf.double(), vf.double(), params)
    baseline = attention_with_params(qf, kf, vf, params)
    assert_close_to_oracle("out", out[finite], oracle[0], baseline[0])
    assert_close_to_oracle("lse", lse[finite], oracle[1], baseline[1])


PERSISTENT = {name: tile for name, tile in (*SCHEDULES.items(), *(
    (f"d256_{name}", tile) for name, tile in D256_SCHEDULES.items())) if tile[5]}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("programs", [1, 5])
@pytest.mark.parametrize("schedule", sorted(PERSISTENT))
@pytest.mark.parametrize("case", [GPU_CASES[i] for i in (1, 10, 19, 22)], ids=str)
def test_gpu_gluon_persistent_programs_take_many_items(case, schedule, programs, monkeypatch):
    """A persistent grid of 1 or 5 programs: each walks many (query tile, head) items, so the
    K/V ring, Q's buffer and the ping-pong turns carry over from item to item (with the
    configured grid of one program per SM the test shapes give most programs one item)."""
    monkeypatch.setattr(hopper, "programs_per_device", lambda device, consumers: programs)
    tile = PERSISTENT[schedule]
    _run_case(at_head_dim(case, 256) if schedule.startswith("d256") else case, tile)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("case", [GPU_CASES[i] for i in (1, 10, 22)], ids=str)
def test_gpu_gluon_heads_major_inputs_match_oracle(case, schedule, monkeypatch):
    """q, k, v in SDPA's heads-major memory, read in place through their 2-D views (batch *
    heads * seqlen, d) under each schedule; a persistent grid of 5 programs, each walking
    many items."""
    monkeypatch.setattr(hopper, "programs_per_device", lambda device, consumers: 5)
    _run_case(case, SCHEDULES[schedule], heads_major=True)


# ---- varlen -------------------------------------------------------------------------------------

LENGTHS_Q = [1000, 0, 1, 517, 130, 3, 300, 64]  # lengths 0 and 1, odd, q < k and q > k
LENGTHS_K = [1000, 7, 0, 1031, 64, 3, 1, 200]

VARLEN_CASES = [  # (dtype, head_dim, nheads, nheads_k, window, features)
    (torch.bfloat16, 128, 4, 1, (None, 0), ()),
    (torch.float16, 64, 4, 2, (None, None), ()),
    (torch.bfloat16, 64, 2, 2, (7, 3), ("alibi_batch", )),
    (torch.bfloat16, 128, 4, 2, (100, 0), ("softcap", "sink")),
    (torch.float16, 128, 2, 2, (None, None), ("alibi", "sink")),  # both sides' ALiBi tiles
    (torch.bfloat16, 128, 4, 2, (None, None), ("dropout", )),
    (torch.float16, 64, 2, 1, (64, 5), ("dropout", "alibi_batch", "sink", "softcap")),
]


def cu_seqlens(lengths, device="cuda"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def varlen_inputs(lengths_q, lengths_k, case):
    """Packed q (total_q, h, d), k and v (total_k, hk, d) and the case's varlen params."""
    dtype, head_dim, nheads, nheads_k, window, features = case
    gen = torch.Generator(device="cuda").manual_seed(sum(lengths_q) + head_dim)
    q, k, v = (torch.randn(sum(lengths), heads, head_dim, dtype=dtype, device="cuda",
                           generator=gen)
               for lengths, heads in ((lengths_q, nheads), (lengths_k, nheads_k),
                                      (lengths_k, nheads_k)))
    params = _params(head_dim, window, features, nheads, "cuda", batch=len(lengths_q),
                     cu_seqlens_q=cu_seqlens(lengths_q), cu_seqlens_k=cu_seqlens(lengths_k),
                     max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    return q, k, v, params


def varlen_mask(params, nheads):
    """The Triton kernels' keep-mask (sequences, nheads, max_q, max_k), or None."""
    if params.dropout_p == 0:
        return None
    return dropout_keep_mask(params.dropout_seed, params.cu_seqlens_q.numel() - 1, nheads,
                             params.max_seqlen_q, params.max_seqlen_k, params.dropout_p,
                             backend="triton", device="cuda")


def run_varlen(q, k, v, params, tile, seqused_k=None):
    """The Gluon forward (asserted to be what forward.py picks) into NaN-poisoned out (total_q,
    h, d) and lse (h, total_q)."""
    assert hopper.eligible(q, k, v, params, None, None, None)
    out = poison(torch.empty_like(q))
    lse = poison(torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device))
    return hopper.attention_forward(q, k, v, params, out=out, lse=lse, tile=tile,
                                    seqused_k=seqused_k)


def check_varlen(case, tile, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K):
    """Every sequence against the float64 oracle (reference.attention_with_params on each
    packed sequence as its own dense problem)."""
    q, k, v, params = varlen_inputs(lengths_q, lengths_k, case)
    out, lse = run_varlen(q, k, v, params, tile)
    mask = varlen_mask(params, q.shape[1])
    oracle = attention_with_params(q.double(), k.double(), v.double(), params, mask)
    baseline = attention_with_params(q, k, v, params, mask)
    assert_close_to_oracle("out", out, oracle[0], baseline[0])
    assert_close_to_oracle("lse", lse, oracle[1], baseline[1])


gpu_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")


@pytest.mark.gpu
@gpu_hopper
@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
def test_gpu_gluon_varlen_matches_oracle(case):
    """The configured tile (by the longest sequence) on every case."""
    check_varlen(case, None)


@pytest.mark.gpu
@gpu_hopper
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
def test_gpu_gluon_varlen_schedules_match_oracle(case, schedule):
    check_varlen(case, SCHEDULES[schedule])


@pytest.mark.gpu
@gpu_hopper
@pytest.mark.parametrize("case", [VARLEN_CASES[i] for i in (2, 6)], ids=str)
def test_gpu_gluon_varlen_wide_tile_matches_oracle(case):
    check_varlen(case, WIDE)


@pytest.mark.gpu
@gpu_hopper
@pytest.mark.parametrize("schedule", [None, *sorted(D256_SCHEDULES)])
@pytest.mark.parametrize("case", [at_head_dim(c, 256) for c in VARLEN_CASES], ids=str)
def test_gpu_gluon_varlen_d256_matches_oracle(case, schedule):
    check_varlen(case, D256_SCHEDULES.get(schedule))


@pytest.mark.gpu
@gpu_hopper
@pytest.mark.parametrize("schedule", sorted(PERSISTENT))
@pytest.mark.parametrize("case", [VARLEN_CASES[i] for i in (0, 3, 6)], ids=str)
def test_gpu_gluon_varlen_persistent_programs_take_many_items(case, schedule, monkeypatch):
    """Varlen through 3 persistent programs: items past a sequence's end (lengths 0, 1, 3)
    take no tiles and store nothing between items that do."""
    monkeypatch.setattr(hopper, "programs_per_device", lambda device, consumers: 3)
    tile = PERSISTENT[schedule]
    check_varlen(at_head_dim(case, 256) if schedule.startswith("d256") else case, tile)


@pytest.mark.gpu
@gpu_hopper
@pytest.mark.parametrize("schedule", ["inline", "three"])
def test_gpu_gluon_varlen_single_rows(schedule):
    """Sequences of one query row, one key, empty ones, all in one batch (causal GQA)."""
    check_varlen(VARLEN_CASES[0], SCHEDULES[schedule], [1, 1, 0, 1, 2, 1], [1, 5, 3, 0, 1, 1])


@pytest.mark.gpu
@gpu_hopper
@pytest.mark.parametrize("schedule", [None, "inline", "three"])
def test_gpu_gluon_varlen_ragged_long(schedule):
    """Long ragged causal sequences (bench_features' ragged kind) with short ones between."""
    check_varlen(VARLEN_CASES[0], SCHEDULES.get(schedule), [2733, 1, 1654, 3265, 17, 4932],
                 [2733, 1, 1654, 3265, 17, 4932])


@pytest.mark.gpu
@gpu_hopper
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_gpu_gluon_varlen_dropout_mask_is_the_triton_kernels(schedule):
    """Bit for bit: with v one-hot over keys (v[j] = e_j, seqlen_k <= d), out[i, j] is 0
    exactly where the key is dropped. The Gluon forward, the Triton varlen kernel and
    dropout_keep_mask drop the same elements in every sequence."""
    lengths_q, lengths_k = [300, 0, 77, 1, 129], [128, 5, 0, 100, 128]
    q, _, _, params = varlen_inputs(lengths_q, lengths_k,
                                    (torch.bfloat16, 128, 2, 1, (None, None), ("dropout", )))
    eye = torch.eye(128, dtype=q.dtype, device="cuda")
    v = torch.cat([eye[:n] for n in lengths_k])[:, None, :]  # (total_k, 1, 128)
    k = torch.zeros_like(v)  # uniform attention: every kept probability is > 0
    gluon_out, _ = run_varlen(q, k, v, params, SCHEDULES[schedule])
    triton_out, _ = triton_forward.attention_forward(q, k, v, params,
                                                     tile=tile_config("forward", 128, 2, False))
    mask = varlen_mask(params, 2)
    cu_q = params.cu_seqlens_q.tolist()
    for b, (len_q, len_k) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        rows = slice(cu_q[b], cu_q[b + 1])
        dropped = mask[b, :, :len_q, :len_k].transpose(0, 1).logical_not()  # (len_q, h, len_k)
        for name, out in (("gluon", gluon_out), ("triton", triton_out)):
            assert torch.equal(out[rows, :, :len_k] == 0, dropped), f"{name} sequence {b}"


@pytest.mark.gpu
@gpu_hopper
@pytest.mark.parametrize("schedule", ["inline", "two", "three"])
def test_gpu_gluon_seqused_k_reads_a_contiguous_cache(schedule):
    """seqused_k: sequence b's keys are the first seqused_k[b] slots of its cache row, the
    cache (batch, capacity, hk, d) passed flattened with cu_seqlens_k = capacity * b. Causal,
    q shorter than its keys, slots past the used ones hold NaN and inf (a torch.empty cache):
    TMA reads them with the tile that crosses a sequence's end, and they must weigh 0."""
    case = (torch.bfloat16, 128, 4, 2, (None, 0), ("softcap", ))
    lengths_q, used, capacity = [3, 200, 0, 1, 64], [700, 200, 5, 1, 0], 768
    q, _, _, params = varlen_inputs(lengths_q, used, case)
    gen = torch.Generator(device="cuda").manual_seed(7)
    k_cache, v_cache = (torch.randn(len(used), capacity, 2, 128, dtype=q.dtype, device="cuda",
                                    generator=gen) for _ in range(2))
    for b, n in enumerate(used):
        non_finite_(k_cache[b, n:])
        non_finite_(v_cache[b, n:])
    seqused_k = torch.tensor(used, dtype=torch.int32, device="cuda")
    cache_params = dataclasses.replace(
        params, cu_seqlens_k=capacity * torch.arange(len(used) + 1, dtype=torch.int32,
                                                     device="cuda"), max_seqlen_k=capacity)
    out, lse = run_varlen(q, k_cache.view(-1, 2, 128), v_cache.view(-1, 2, 128), cache_params,
                          SCHEDULES[schedule], seqused_k=seqused_k)
    k, v = (torch.cat([c[b, :n] for b, n in enumerate(used)]) for c in (k_cache, v_cache))
    oracle = attention_with_params(q.double(), k.double(), v.double(), params)
    baseline = attention_with_params(q, k, v, params)
    assert_close_to_oracle("out", out, oracle[0], baseline[0])
    assert_close_to_oracle("lse", lse, oracle[1], baseline[1])


@pytest.mark.gpu
@gpu_hopper
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_gpu_gluon_varlen_non_finite_sequence_does_not_leak(schedule):
    """A packed sequence whose q, k and v are NaN/inf: the sequences before it (whose last key
    tiles read its rows) and after it equal the oracle on their finite data."""
    case = (torch.bfloat16, 128, 4, 2, (None, None), ("alibi_batch", ))
    lengths_q, lengths_k, bad = [70, 3, 200, 1, 129], [100, 1000, 33, 5, 130], 1
    q, k, v, params = varlen_inputs(lengths_q, lengths_k, case)
    cu_q, cu_k = params.cu_seqlens_q.tolist(), params.cu_seqlens_k.tolist()
    non_finite_(q[cu_q[bad]:cu_q[bad + 1]])
    non_finite_(k[cu_k[bad]:cu_k[bad + 1]])
    non_finite_(v[cu_k[bad]:cu_k[bad + 1]])
    out, lse = run_varlen(q, k, v, params, SCHEDULES[schedule])
    oracle = attention_with_params(q.double(), k.double(), v.double(), params)
    baseline = attention_with_params(q, k, v, params)
    rows = torch.cat([torch.arange(cu_q[b], cu_q[b + 1]) for b in range(len(lengths_q))
                      if b != bad]).cuda()
    assert_close_to_oracle("out", out[rows], oracle[0][rows], baseline[0][rows])
    assert_close_to_oracle("lse", lse[:, rows], oracle[1][:, rows], baseline[1][:, rows])
