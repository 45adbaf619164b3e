"""The host-side feature bundle (flashkit.ops.triton.features): AttentionParams as kernel
arguments, and, without launching, that every Gluon launcher passes them where its kernel's
signature expects them (the Gluon kernels cannot run on the CPU, and launch's interpreter check
of constexpr order never sees them)."""

from __future__ import annotations

import dataclasses
import importlib
from types import SimpleNamespace

import pytest
import torch

from flashkit.ops.params import AttentionParams, lse_shape
from flashkit.ops.triton import launch as launch_module
from flashkit.ops.triton.common import LOG2E, SOFTCAP_EXACT, SOFTCAP_FAST, interpreting
from flashkit.ops.triton.features import (
    DENSE_FLAGS,
    FLAGS,
    GRADIENT_FLAGS,
    kernel_features,
    tiles_in_bounds,
)

forward_hopper = importlib.import_module("flashkit.ops.triton.forward_hopper")
backward_hopper = importlib.import_module("flashkit.ops.triton.backward_hopper")

SCALE, SOFTCAP, SEED, DROPOUT_P = 0.125, 5.0, (7 << 32) + 1234, 0.1


def _inputs(varlen: bool, dtype=torch.bfloat16, head_dim=64):
    """q, k, v and params with every built-in feature on: a (3, 0) window, softcap, per-batch
    ALiBi slopes, a bf16 sink, dropout; varlen packs two sequences of 70 and 58 tokens."""
    gen = torch.Generator().manual_seed(0)
    batch, nheads, nheads_k, seqlen = 2, 4, 2, 128
    if varlen:
        shape_q, shape_k = (2 * seqlen, nheads, head_dim), (2 * seqlen, nheads_k, head_dim)
        cu = torch.tensor([0, 70, 128], dtype=torch.int32)
        lengths = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=70, max_seqlen_k=70)
    else:
        shape_q, shape_k = (batch, seqlen, nheads, head_dim), (batch, seqlen, nheads_k, head_dim)
        lengths = {}
    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for shape in (shape_q, shape_k,
                                                                         shape_k))
    params = AttentionParams(
        SCALE, window_left=3, window_right=0, softcap=SOFTCAP,
        alibi_slopes=torch.rand(batch, nheads, generator=gen),
        sink=torch.randn(nheads, generator=gen).to(torch.bfloat16), dropout_p=DROPOUT_P,
        dropout_seed=SEED, **lengths)
    return q, k, v, params


def _on_device(q, k, v, params: AttentionParams):
    """_inputs' tensors on the GPU when there is one (else as they are, for the interpreter)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    moved = {name: getattr(params, name).to(device) for name in
             ("alibi_slopes", "sink", "cu_seqlens_q", "cu_seqlens_k")
             if getattr(params, name) is not None}
    return q.to(device), k.to(device), v.to(device), dataclasses.replace(params, **moved)


SCORE_VALUES = ("qk_scale", "softcap_scale", "stride_ab", "stride_ah")  # the bundle's order


def _expected(params: AttentionParams, varlen: bool, bundled: bool = True) -> dict:
    """The runtime arguments the kernels must receive, by their signature names, computed
    here from the contract rather than by the bundle: the score modifiers' values as one
    `score_values` (bundled), or by their own names (the Gluon forward's signature)."""
    seqlen = 70 if varlen else 128
    scores = dict(qk_scale=SOFTCAP * LOG2E, softcap_scale=SCALE / SOFTCAP, stride_ab=4,
                  stride_ah=1)
    if bundled:
        scores = dict(score_values=tuple(scores[name] for name in SCORE_VALUES))
    return dict(seqlen_q=seqlen, seqlen_k=seqlen, window_left=3, window_right=0, **scores,
                seed_lo=1234, seed_hi=7, dropout_threshold=round(DROPOUT_P * 256),
                dropout_scale=1 / (1 - DROPOUT_P))


def _flags(flags: tuple, varlen: bool, bundled: bool = True) -> dict:
    """The flags of _inputs' call by name (every feature on), the score modifiers as one
    SCORES (bundled) or by their own names."""
    values = dict(HAS_LEFT=True, HAS_RIGHT=True, SCORES=(_softcap(), True), SOFTCAP=_softcap(),
                  ALIBI=True, SINK=True, DROPOUT=True, VARLEN=varlen)
    if not bundled:
        flags = [n for name in flags for n in (("SOFTCAP", "ALIBI") if name == "SCORES"
                                               else (name,))]
    return {name: values[name] for name in flags}


def test_kernel_features_of_every_feature():
    for varlen in (False, True):
        q, k, v, params = _inputs(varlen)
        placeholder = torch.empty(1)
        f = kernel_features(params, q, v, placeholder, torch.float16)
        expected = _expected(params, varlen)
        assert f.band == tuple(expected[n] for n in ("seqlen_q", "seqlen_k", "window_left",
                                                       "window_right"))
        assert f.score_values == pytest.approx(expected["score_values"])
        assert f.score_tensors == (params.alibi_slopes,)
        assert f.sink.dtype == torch.float32 and torch.equal(f.sink, params.sink.float())
        assert f.dropout == pytest.approx(tuple(expected[n] for n in (
            "seed_lo", "seed_hi", "dropout_threshold", "dropout_scale")))
        assert list(f.flags) == list(FLAGS)
        assert f.flags == _flags(FLAGS, varlen)
        for names in (GRADIENT_FLAGS, DENSE_FLAGS):
            subset = kernel_features(params, q, v, placeholder, torch.float16, flags=names)
            assert list(subset.flags) == list(names)
            assert subset.flags == {name: f.flags[name] for name in names}
        assert (f.batch, f.nheads, f.nheads_k, f.head_dim, f.head_dim_v) == (2, 4, 2, 64, 64)
        assert f.varlen == varlen
        if varlen:
            assert f.cu_seqlens == (params.cu_seqlens_q, params.cu_seqlens_k)
            assert f.strides(q) == (0, *q.stride())
            assert lse_shape(q, params) == (4, 256)
        else:
            assert f.cu_seqlens == (placeholder, placeholder)
            assert f.strides(q) == q.stride()
            assert lse_shape(q, params) == (2, 4, 128)
        assert kernel_features(params, q, v, placeholder, float32_sink=False).sink is params.sink


def test_kernel_features_without_features():
    q = torch.randn(1, 5, 2, 16)
    placeholder = torch.empty(1)
    f = kernel_features(AttentionParams(0.25), q, q, placeholder, torch.float32)
    assert f.band == (5, 5, 0, 0)
    assert f.score_values == (0.25, 1.0, 0, 0)  # fp32: natural units
    assert f.score_tensors == (placeholder,) and f.sink is placeholder
    assert f.dropout == (0, 0, 0, 1.0)
    assert f.flags.pop("SCORES") == (0, False) and not any(f.flags.values())
    assert kernel_features(AttentionParams(0.25), q, q, placeholder).score_values == (
        0.25 * LOG2E, 1.0, 0, 0)


@pytest.mark.parametrize("window, has", [((4, 3), (True, True)), ((5, 4), (False, False)),
                                         ((None, 0), (False, True)),
                                         ((0, 2**31 - 1), (True, False))])
def test_window_reaching_every_key_is_unbounded(window, has):
    """seqlen_q 5, seqlen_k 6: left >= 5 or right >= 4 reaches every key from every row."""
    q, k = torch.randn(1, 5, 1, 16), torch.randn(1, 6, 1, 16)
    params = AttentionParams(0.25, window_left=window[0], window_right=window[1])
    f = kernel_features(params, q, k, q)
    assert (f.flags["HAS_LEFT"], f.flags["HAS_RIGHT"]) == has
    assert f.band == (5, 6, window[0] if has[0] else 0, window[1] if has[1] else 0)


def _check_call(kernel, args: tuple, constexprs: dict, expected: dict, flags: dict) -> None:
    """args and constexprs fill kernel's signature exactly (names and order), the feature
    arguments land on the parameters of their names, tensors (or bundles of them) on pointer
    parameters and the flags say what the call has."""
    names = kernel.arg_names
    launch_module._check_constexpr_order(kernel, len(args), constexprs)
    assert len(args) + len(constexprs) == len(names)
    bound = dict(zip(names, args, strict=False))
    for name, value in expected.items():
        assert bound[name] == pytest.approx(value), name
    for name, value in bound.items():
        if name in ("score_args", "mask_args", "packing", "blocks", "grad_args"):
            # a user's modifiers: none here
            assert value == (), name
            continue
        pointer = name[0].isupper() or name.endswith("_desc")
        members = value if isinstance(value, tuple) else (value,)
        assert all(pointer == (not isinstance(m, (int, float))) for m in members), name
    assert {name: constexprs[name] for name in flags} == flags


def _record_launches(monkeypatch) -> list:
    """launch.launch replaced by a recorder: each launch's (kernel, arguments in the kernel's
    signature order, constexprs and the options that are kernel parameters), put in order as
    launch does by the tensor parameters' names."""
    calls = []

    def record(kernel, grid, tensors, scalars, constexprs, tensor_params=(), **options):
        args = tensors + scalars
        if tensor_params:
            args = launch_module._order(kernel, tensor_params, len(tensors), len(scalars))(args)
        calls.append((kernel, args, dict(constexprs, **{
            name: value for name, value in options.items() if name in kernel.arg_names})))
    monkeypatch.setattr(launch_module, "launch", record)
    return calls


def _softcap() -> int:
    """The SOFTCAP flag of the 16-bit inputs here: the fast softcap on a GPU, the exact one in
    the interpreter (features.kernel_features)."""
    return SOFTCAP_EXACT if interpreting() else SOFTCAP_FAST


@pytest.mark.skipif(forward_hopper.gluon is None, reason="a Triton without Gluon")
@pytest.mark.parametrize("varlen", [False, True])
def test_gluon_forward_launcher_fills_the_kernel_signature(varlen, monkeypatch):
    q, k, v, params = _inputs(varlen)
    calls = _record_launches(monkeypatch)
    forward_hopper.attention_forward(q, k, v, params, tile=(64, 2, 1, True, False, False))
    (kernel, args, constexprs), = calls
    assert kernel is forward_hopper._fwd_hopper_kernel
    expected = dict(_expected(params, varlen, bundled=False), nheads=4, group=2)
    _check_call(kernel, args, constexprs, expected, _flags(FLAGS, varlen, bundled=False))
    bound = dict(zip(kernel.arg_names, args, strict=False))
    assert torch.equal(bound["Alibi"], params.alibi_slopes)
    assert bound["Sink"].dtype == torch.float32
    if varlen:
        assert bound["Cu_q"] is params.cu_seqlens_q


@pytest.mark.skipif(forward_hopper.gluon is None, reason="a Triton without Gluon")
def test_gluon_forward_launcher_passes_user_modifiers(monkeypatch):
    """A score_mod's and a mask_mod's functions reach the kernel's SCORE_MOD / MASK_MOD and
    their captured values its score_args / mask_args. The plan's one prepared launch is passed
    each call's own captured tensors: a second call with another table and other document
    ids, through the same plan, launches with those."""
    import dataclasses

    from flashkit import variants
    from flashkit.variants.mods import Variant

    q, k, v, params = _inputs(False)
    calls = _record_launches(monkeypatch)
    plan = {}
    for _ in range(2):
        table, doc = torch.randn(4, 9), torch.zeros(2, 128, dtype=torch.int32)
        score, mask = variants.relative_bias(table), variants.document_mask(doc)
        call = dataclasses.replace(params, variant=Variant(score_mod=score, mask_mod=mask))
        forward_hopper.attention_forward(q, k, v, call, tile=(64, 2, 1, True, False, False),
                                         plan=plan)
        kernel, args, constexprs = calls[-1]
        bound = dict(zip(kernel.arg_names, args, strict=False))
        assert bound["score_args"][0] is table and bound["mask_args"][0] is doc
        assert bound["score_args"][1:] == score.kernel_args()[1:]
        assert constexprs["SCORE_MOD"] is score.jit() and constexprs["MASK_MOD"] is mask.jit()
    assert len(calls) == 2 and list(plan) == ["forward"]


@pytest.mark.skipif(forward_hopper.gluon is None, reason="a Triton without Gluon")
@pytest.mark.parametrize("shared", [True, False])
def test_gluon_forward_launcher_passes_a_block_mask(shared, monkeypatch):
    """A block mask's lists with their blocks per row and log2 of the key tiles per block,
    their batch and head strides (0 where one row serves every batch entry or head) and its
    query rows per block reach the kernel's `blocks`, on the block-mask tile."""
    import dataclasses

    import flashkit
    from flashkit import variants
    from flashkit.ops.triton.configs import GLUON_FORWARD_BLOCK_MASK
    from flashkit.variants.mods import Variant

    q = torch.randn(2, 256, 4, 64, dtype=torch.bfloat16)
    mask = flashkit.create_block_mask(variants.causal_mask(), None if shared else 2,
                                      None if shared else 4, 256, 256, device="cpu")
    params = dataclasses.replace(AttentionParams(SCALE),
                                 variant=Variant(mask_mod=mask.mask_mod, block_mask=mask))
    calls = _record_launches(monkeypatch)
    forward_hopper.attention_forward(q, q, q, params)
    (kernel, args, constexprs), = calls
    blocks = dict(zip(kernel.arg_names, args, strict=False))["blocks"]
    block_n, _, consumers = GLUON_FORWARD_BLOCK_MASK[64][:3]
    assert constexprs["BLOCK_N"] == block_n and constexprs["CONSUMERS"] == consumers
    lists, stride_b, stride_h, rows = blocks
    assert lists == (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                     mask.full_kv_indices, 2, (128 // block_n).bit_length() - 1)
    assert (stride_b, stride_h, rows) == ((0, 0) if shared else (4 * 2, 2)) + (128,)


@pytest.mark.parametrize("block, batch, seqlen_k, why", [
    (128, 2, 256, None), ((128, 64), 2, 256, "block mask blocks 128 x 64"),
    ((64, 128), 2, 256, "block mask blocks 64 x 128"),
    (128, 2, 200, "a block mask with seqlen_k off the 128-key tiles and batch > 1"),
    (128, 1, 200, None)])
def test_gluon_forward_block_mask_declines(block, batch, seqlen_k, why):
    """The Gluon forward takes a block mask whose blocks hold whole tiles and whose keys fill
    whole key tiles, or of one sequence (varlen's packed tokens run as one) at any length; it
    names what it declines."""
    import dataclasses

    import flashkit
    from flashkit import variants
    from flashkit.variants.mods import Variant

    q, k = torch.randn(batch, 256, 2, 128), torch.randn(batch, seqlen_k, 2, 128)
    mask = flashkit.create_block_mask(variants.causal_mask(), None, None, 256, seqlen_k,
                                      device="cpu", BLOCK_SIZE=block)
    params = dataclasses.replace(AttentionParams(SCALE),
                                 variant=Variant(mask_mod=mask.mask_mod, block_mask=mask))
    found = forward_hopper.block_mask_declines(q, k, params)
    assert found == why or found.startswith(why)


@pytest.mark.parametrize("block, heads, dropout, why", [
    (128, None, 0.0, None), ((128, 64), None, 0.0, None),
    ((64, 32), None, 0.0, "block mask blocks 64 x 32"),
    (128, 2, 0.0, None), (128, None, 0.1, "a block mask with dropout")])
def test_gluon_backward_block_mask_declines(block, heads, dropout, why):
    """The Gluon backward takes a dense call's block mask, shared by the heads or one per head,
    without dropout, whose blocks hold whole tiles of its dK/dV and dQ kernels (64 x 64 at
    head dim 128)."""
    import dataclasses

    import flashkit
    from flashkit import variants
    from flashkit.variants.mods import Variant

    q = torch.randn(1, 256, 2, 128)
    mask = flashkit.create_block_mask(variants.causal_mask(), None, heads, 256, 256,
                                      device="cpu", BLOCK_SIZE=block)
    params = dataclasses.replace(AttentionParams(SCALE, dropout_p=dropout),
                                 variant=Variant(mask_mod=mask.mask_mod, block_mask=mask))
    found = backward_hopper.block_mask_declines(q, params)
    assert found == why or found.startswith(why)


@pytest.mark.parametrize("learned", [False, True])
def test_gluon_backward_takes_a_block_mask_over_packed_tokens(learned):
    """A block mask over varlen's packed tokens (the call run as one sequence): the Gluon
    kernels take it, with a gradient for a score_mod's captured tensors too (the dQ kernel runs
    the rule at each pair's sequence and positions in it)."""
    import dataclasses

    import flashkit
    from flashkit import variants
    from flashkit.variants.mods import Variant

    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    mask = flashkit.create_block_mask(variants.causal_mask(), None, None, 256, 256,
                                      device="cpu", cu_seqlens_q=cu, cu_seqlens_k=cu)
    table = torch.randn(2, 9)
    score = variants.relative_bias(table)
    variant = Variant(score_mod=score, mask_mod=mask.mask_mod, block_mask=mask,
                      packing=mask.packing,
                      captured_grads=[torch.zeros_like(table), None] if learned else None)
    params = dataclasses.replace(AttentionParams(SCALE), variant=variant)
    q = torch.randn(1, 256, 2, 128)
    assert forward_hopper.block_mask_declines(q, q, params) is None
    assert backward_hopper.block_mask_declines(q, params) is None


@pytest.mark.skipif(backward_hopper.gluon is None, reason="a Triton without Gluon")
@pytest.mark.parametrize("which", ["dkdv", "dq"])
@pytest.mark.parametrize("heads", [None, 4])
def test_gluon_backward_launchers_pass_a_block_mask(which, heads, monkeypatch):
    """The dQ kernel gets the rows of the finest of the mask's lists whose blocks hold its
    tiles (the 64 x 64 blocks of `fine` here: one row per query block, 4 of 4 key blocks), the
    dK/dV kernel, whose tiles hold 128 queries, the mask's own transposed rows (one per key
    block: 4 of 2 query blocks), each with blocks per row, log2 of the tiles per block, the
    batch and head strides (rows per batch entry and per head; a head stride of 0 for a mask
    shared by the heads) and the rows or keys a list row covers; the dK/dV kernel is told
    whether each head has its own rows (HEAD_LISTS)."""
    import dataclasses

    import flashkit
    from flashkit import variants
    from flashkit.ops.triton.configs import GLUON_BACKWARD_DKDV, GLUON_BACKWARD_DQ
    from flashkit.variants.mods import Variant

    q = torch.randn(2, 256, 4, 64, dtype=torch.bfloat16)
    mask = flashkit.create_block_mask(variants.causal_mask(), 2, heads, 256, 256, device="cpu",
                                      BLOCK_SIZE=(128, 64))
    params = dataclasses.replace(AttentionParams(SCALE),
                                 variant=Variant(mask_mod=mask.mask_mod, block_mask=mask))
    calls = _record_launches(monkeypatch)
    lse = torch.zeros(lse_shape(q, params))
    per_head = 1 if heads is None else heads  # list rows per batch entry, per list row
    if which == "dkdv":
        backward_hopper.attention_backward_dkdv(q, q, q, q, lse, torch.zeros_like(lse), params,
                                                torch.empty_like(q), torch.empty_like(q))
        block_m, block_n = GLUON_BACKWARD_DKDV[64][:2]
        assert (block_m, block_n) == (128, 64) and mask.finest(block_m, block_n) is mask
        expected = ((mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks,
                     mask.full_q_indices, 2, (128 // block_m).bit_length() - 1),
                    4 * per_head, 0 if heads is None else 4, 64)
    else:
        backward_hopper.attention_backward_dq(q, q, q, q, q, lse, torch.zeros_like(lse), None,
                                              params, torch.empty_like(q))
        block_m, block_n = GLUON_BACKWARD_DQ[64][:2]
        fine = mask.fine
        assert fine.BLOCK_SIZE == (64, 64) and mask.finest(block_m, block_n) is fine
        expected = ((fine.kv_num_blocks, fine.kv_indices, fine.full_kv_num_blocks,
                     fine.full_kv_indices, 4, (64 // block_n).bit_length() - 1),
                    4 * per_head, 0 if heads is None else 4, 64)
    (kernel, args, constexprs), = calls
    if which == "dkdv":
        assert constexprs["HEAD_LISTS"] == (heads is not None)
    assert dict(zip(kernel.arg_names, args, strict=False))["blocks"] == expected


@pytest.mark.skipif(backward_hopper.gluon is None, reason="a Triton without Gluon")
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("which", ["dkdv", "dq"])
def test_gluon_backward_launchers_fill_the_kernel_signatures(varlen, which, monkeypatch):
    q, k, v, params = _on_device(*_inputs(varlen))
    calls = _record_launches(monkeypatch)
    lse = torch.zeros(lse_shape(q, params), device=q.device)
    delta = torch.zeros_like(lse)
    if which == "dkdv":
        backward_hopper.attention_backward_dkdv(q, q, k, v, lse, delta, params,
                                                torch.empty_like(k), torch.empty_like(v))
    else:
        backward_hopper.attention_backward_dq(q, q, k, v, q, lse, delta, None, params,
                                              torch.empty_like(q))
    # a varlen dK/dV call aligns lse and delta in a kernel of its own first
    *before, (kernel, args, constexprs) = calls
    assert [call[0] for call in before] == (
        [backward_hopper._align_rows_kernel] if varlen and which == "dkdv" else [])
    assert kernel is getattr(backward_hopper, f"_bwd_{which}_hopper_kernel")
    heads = dict(nheads=4, nheads_k=2) if which == "dkdv" else dict(nheads=4, group=2)
    expected = dict(_expected(params, varlen), softmax_scale=SCALE, **heads)
    _check_call(kernel, args, constexprs, expected, _flags(GRADIENT_FLAGS, varlen))
    assert dict(zip(kernel.arg_names, args, strict=False))["ScoreTensors"] == (
        params.alibi_slopes,)
    assert constexprs["ONE_KEY_ZERO"] is False


@pytest.mark.skipif(backward_hopper.gluon is None, reason="a Triton without Gluon")
@pytest.mark.parametrize("which", ["dkdv", "dq"])
def test_gluon_backward_launchers_pass_user_modifiers(which, monkeypatch):
    """A score_mod's function, derivative and captured values and a mask_mod's reach the Gluon
    backward kernels' parameters of their names, each call's own through the plan's one
    prepared launch."""
    import dataclasses

    from flashkit import variants
    from flashkit.variants.mods import Variant

    q, k, v, params = _inputs(False)
    score = variants.relative_bias(torch.randn(4, 9))
    mask = variants.document_mask(torch.zeros(2, 128, dtype=torch.int32))
    params = dataclasses.replace(params, variant=Variant(score_mod=score, mask_mod=mask))
    calls = _record_launches(monkeypatch)
    lse = torch.zeros(lse_shape(q, params))
    plan = {}
    if which == "dkdv":
        backward_hopper.attention_backward_dkdv(q, q, k, v, lse, torch.zeros_like(lse), params,
                                                torch.empty_like(k), torch.empty_like(v),
                                                plan=plan)
    else:
        backward_hopper.attention_backward_dq(q, q, k, v, q, lse, torch.zeros_like(lse), None,
                                              params, torch.empty_like(q), plan=plan)
    (kernel, args, constexprs), = calls
    bound = dict(zip(kernel.arg_names, args, strict=False))
    assert bound["score_args"] == score.kernel_args()
    assert bound["mask_args"] == mask.kernel_args()
    assert constexprs["SCORE_MOD"] is score.jit() and constexprs["MASK_MOD"] is mask.jit()
    assert constexprs["SCORE_GRAD"] is score.jit_grad()
    assert list(plan) == [which]


def test_flag_subsets_keep_the_vocabulary_order():
    for subset in (GRADIENT_FLAGS, DENSE_FLAGS):
        assert [name for name in FLAGS if name in subset] == list(subset)


def test_tiles_in_bounds_only_where_every_tile_ends_within_the_sequence():
    """The positions a modifier sees go unclamped (common.mod_positions) only where every query
    (key) tile of a launch ends within the sequence: dense lengths on whole tiles, and on whole
    blocks of a block mask (each listed block runs all its tiles); never varlen, nor a block
    mask over packed tokens (there a modifier sees positions within each sequence)."""
    def bounds(seqlen_q, seqlen_k, block_size=None, packing=(), varlen=False):
        f = SimpleNamespace(varlen=varlen, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        variant = None
        if block_size is not None or packing:
            mask = None if block_size is None else SimpleNamespace(BLOCK_SIZE=block_size)
            variant = SimpleNamespace(block_mask=mask, packing=packing)
        params = SimpleNamespace(variant=variant)
        return tiles_in_bounds(f, params, 64, 128)

    assert bounds(256, 256) == (True, True)
    assert bounds(200, 256) == (False, True)
    assert bounds(256, 320) == (True, False)  # a last key tile of 64 keys
    assert bounds(256, 384, (128, 256)) == (True, False)  # the last block's second tile
    assert bounds(256, 512, (128, 256)) == (True, True)
    assert bounds(192, 512, (128, 128)) == (False, True)  # 64-row tiles, 128-row blocks
    assert bounds(256, 256, varlen=True) == (False, False)
    assert bounds(256, 256, (128, 128), packing=(object(), )) == (False, False)
