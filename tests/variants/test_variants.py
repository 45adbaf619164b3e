"""User variants (score_mod, mask_mod, block_mask) against the float64 oracle, forward and
backward, on the tiled backend and the Triton kernels (interpreted without a GPU)."""

from __future__ import annotations

import functools

import pytest
import torch
import triton
import triton.language as tl
from variant_cases import CAPTURED_GRADS, EXAMPLES, attention, documents, extras

import flashkit
from flashkit import variants
from helpers import check_against_oracle, random_qkv, random_varlen


def _check(backend, name, inputs, grad_names=("q", "k", "v")):
    check_against_oracle(functools.partial(attention, backend, name), inputs,
                         output_names=("out",),
                         oracle_fn=functools.partial(attention, "reference", name),
                         grad_names=grad_names)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_matches_oracle(backend, name):
    """Each built-in example, odd lengths, GQA; the relative-bias table's gradient."""
    seqlen_q, seqlen_k = (29, 29) if name in ("document", "prefix_lm") else (23, 31)
    q, k, v = random_qkv(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=4, nheads_k=2,
                         headdim=16)
    captured = extras(name, 2, 4, seqlen_q, seqlen_k)
    _check(backend, name, dict(q=q, k=k, v=v, **captured), ("q", "k", "v", "table"))


@pytest.mark.parametrize("name", sorted(CAPTURED_GRADS))
def test_triton_captured_gradients_match_oracle(name):
    """The Triton backward's captured_grad rules (a relative-position table, ALiBi slopes, a
    per-token bias) against the oracle's autograd: odd lengths both ways, GQA, q and the
    captured tensor only (dk, dv as above)."""
    q, k, v = random_qkv(batch=2, seqlen_q=37, seqlen_k=21, nheads=4, nheads_k=2, headdim=16)
    captured = extras(name, 2, 4, 37, 21)
    _check("triton", name, dict(q=q, k=k, v=v, **captured), ("q", CAPTURED_GRADS[name]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["document", "relative_bias"])
def test_varlen_example_matches_oracle(backend, name):
    """Indices are positions within each sequence, b the sequence (lengths 1, 0 and odd); the
    relative-bias table's gradient."""
    inputs = random_varlen([9, 1, 20], [9, 1, 20], nheads=2, headdim=16)
    captured = extras(name, 3, 2, 20, 20)
    _check(backend, name, dict(**inputs, **captured), ("q", "k", "v", "table"))


def test_modifiers_combine_with_builtin_features():
    """score_mod after softcap and ALiBi, mask_mod inside the causal band, a sink: Triton."""
    q, k, v = random_qkv(batch=1, seqlen_q=19, seqlen_k=27, nheads=2, headdim=16)
    sink, slopes, table = torch.randn(2), torch.rand(2), torch.randn(2, 13)

    def run(backend, q, k, v, sink, table):
        return (flashkit.flash_attn_func(
            q, k, v, causal=True, softcap=4.0, alibi_slopes=slopes, sink=sink, backend=backend,
            score_mod=variants.relative_bias(table),
            mask_mod=variants.sliding_window_with_globals(4, 2)),)
    check_against_oracle(functools.partial(run, "triton"),
                         dict(q=q, k=k, v=v, sink=sink, table=table), output_names=("out",),
                         oracle_fn=functools.partial(run, "reference"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_block_mask_matches_oracle(backend):
    """A document block mask (per batch entry, shared by heads), GQA, odd length, 16-blocks."""
    seqlen = 45
    doc = documents(seqlen, batch=2)
    mask = flashkit.create_block_mask(variants.document_mask(doc, causal=True), 2, None,
                                      seqlen, seqlen, device="cpu", BLOCK_SIZE=16)
    assert 0 < mask.sparsity() < 1
    q, k, v = random_qkv(batch=2, seqlen_q=seqlen, nheads=4, nheads_k=2, headdim=16)

    def run(backend, q, k, v):
        return (flashkit.flash_attn_func(q, k, v, block_mask=mask, backend=backend),)
    check_against_oracle(functools.partial(run, backend), dict(q=q, k=k, v=v),
                         output_names=("out",), oracle_fn=functools.partial(run, "reference"))


def _assert_block_states(mask, dense):
    """Every block of mask is empty where dense sees nothing, full where it sees everything in
    range (a block past the end never), partial elsewhere; the transposed lists agree."""
    bq, bk = mask.BLOCK_SIZE
    seqlen_q, seqlen_k = dense.shape
    state = mask.to_dense()[0, 0]
    assert state.shape == (-(-seqlen_q // bq), -(-seqlen_k // bk))
    for r in range(state.shape[0]):
        for c in range(state.shape[1]):
            tile = dense[r * bq:(r + 1) * bq, c * bk:(c + 1) * bk]
            whole = tile.shape == (bq, bk)
            expected = 0 if not tile.any() else (2 if tile.all() and whole else 1)
            assert state[r, c] == expected, (mask.BLOCK_SIZE, r, c)
    kv_listed = (mask.kv_num_blocks + mask.full_kv_num_blocks).sum()
    q_listed = (mask.q_num_blocks + mask.full_q_num_blocks).sum()
    assert kv_listed == q_listed == (state > 0).sum() * 2


@pytest.mark.parametrize("block, lengths", [(16, (70, 53)), ((32, 16), (70, 53)),
                                            (128, (300, 270)), ((128, 64), (300, 270))])
def test_block_mask_states_match_dense_mask(block, lengths):
    """Empty blocks see nothing, full blocks see everything in range, partial the rest; a
    block past the end is never full; the transposed lists agree. Blocks over 64 tokens carry
    the same lists at 64-token blocks (`fine`), which the kernels whose tiles divide them walk
    (BlockMask.finest)."""
    seqlen_q, seqlen_k = lengths
    window = variants.sliding_window_with_globals(9, 3)
    mask = flashkit.create_block_mask(window, None, 2, seqlen_q, seqlen_k, device="cpu",
                                      BLOCK_SIZE=block)
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    dense = (i - j).abs() <= 9
    dense |= (i < 3) | (j < 3)
    _assert_block_states(mask, dense)
    bq, bk = mask.BLOCK_SIZE
    if max(bq, bk) <= 64:
        assert mask.fine is None and mask.finest(16, 16) is mask
        return
    fine = mask.fine
    assert fine.BLOCK_SIZE == (min(bq, 64), min(bk, 64)) and fine.fine is None
    _assert_block_states(fine, dense)
    assert mask.finest(*fine.BLOCK_SIZE) is fine and mask.finest(128, 16) is mask
    assert fine.kv_num_blocks.shape[:2] == mask.kv_num_blocks.shape[:2] == (1, 2)


# --- bad modifiers -----------------------------------------------------------------------

@triton.jit
def _three_args(score, b, h):
    return score


@triton.jit
def _returns_number(score, b, h, q_idx, kv_idx):
    return 1.0


@triton.jit
def _float_mask(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx) * 1.0


@triton.jit
def _bias(score, b, h, q_idx, kv_idx, table):
    return score + tl.load(table + h)


@triton.jit
def _bias_one(score, b, h, q_idx, kv_idx, table):
    return 1.0


def _qkv():
    return random_qkv(batch=1, seqlen_q=8, nheads=2, headdim=16)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(score_mod=_three_args), TypeError, "score_mod: _three_args"),
    (dict(score_mod=_returns_number), TypeError, "score_mod: must return a floating-point"),
    (dict(mask_mod=_float_mask), TypeError, "mask_mod: must return a bool"),
    (dict(mask_mod=variants.softcap(2.0)), TypeError, "mask_mod: got a ScoreMod"),
    (dict(score_mod=variants.ScoreMod(_bias, torch.zeros(2, device="meta"))), ValueError,
     "score_mod: captured tensor 0 is on meta"),
    (dict(score_mod=variants.ScoreMod(_bias, torch.zeros(2, dtype=torch.complex64))),
     TypeError, "score_mod: captured tensor 0 has dtype"),
    (dict(score_mod=variants.ScoreMod(_bias, "table")), TypeError, "captured value 0"),
    (dict(score_mod=variants.ScoreMod(_bias, torch.zeros(2, 2).t())), ValueError,
     "contiguous"),
    (dict(block_mask=object()), TypeError, "block_mask: expected a flashkit.BlockMask"),
])
def test_bad_modifiers_rejected(kwargs, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        flashkit.flash_attn_func(q, k, v, backend="torch", **kwargs)


@pytest.mark.parametrize("bound", [0, -1.0, float("inf"), float("nan"), True, "3"])
def test_bad_bound_rejected(bound):
    with pytest.raises(ValueError, match="score_mod: bound must be a positive finite number"):
        variants.ScoreMod(_bias, torch.zeros(2), bound=bound)
    assert variants.ScoreMod(_bias, torch.zeros(2), bound=3).bound == 3.0


def test_bound_is_part_of_the_kernel_key():
    """Launch plans hold the fixed row max a bound gives: modifiers that differ only in their
    bound must not share one."""
    keys = {variants.ScoreMod(_bias, 1.0, bound=bound).kernel_key() for bound in (None, 3, 4)}
    assert len(keys) == 3


@pytest.mark.parametrize("dtype, approx", [(torch.bfloat16, True), (torch.float16, True),
                                           (torch.float32, False)])
def test_softcap_takes_the_builtin_softcaps_tanh_by_dtype(monkeypatch, dtype, approx):
    """softcap(cap) runs the tanh softcap= runs for the call's inputs: the GPU's own for 16-bit
    ones, the exact one for float32; approx= given fixes it for every dtype."""
    seen, real = [], flashkit.api.run_backend

    def spy(q, k, v, params, *args):
        seen.append(params)
        return real(q, k, v, params, *args)
    monkeypatch.setattr(flashkit.api, "run_backend", spy)
    q, k, v = (t.to(dtype) for t in _qkv())
    mod = variants.softcap(4.0)
    for _ in range(2):  # the call, then the same call kept
        flashkit.flash_attn_func(q, k, v, score_mod=mod, backend="reference")
    approx_fn = variants.softcap(4.0, approx=True).fn
    assert [p.variant.score_mod.fn is approx_fn for p in seen] == [approx, approx]
    assert all(p.variant.score_mod.bound == 4.0 for p in seen)
    for fixed in (True, False):
        mod = variants.softcap(4.0, approx=fixed)
        assert mod.for_dtype(dtype) is mod and (mod.fn is approx_fn) == fixed


@pytest.mark.parametrize("window", [0, 1, 5, 40, 1 << 31])
def test_library_window_masks_keep_what_their_definitions_say(window):
    """The window masks, written as comparisons with each row's bounds, against |i - j| <=
    window written out in torch: window 0, one, inside, past the length, and past the 2^30 cap."""
    i = torch.arange(37)[:, None]
    j = torch.arange(37)[None, :]
    zero = torch.zeros((), dtype=torch.int64)

    def keep(mod):
        return mod.twin(torch.float32, i.device)(zero, zero, i, j, *mod.torch_captured())

    near = (i - j).abs() <= window
    assert torch.equal(keep(variants.causal_window(window)), near & (j <= i))
    globals_ = (i < 3) | (j < 3)
    assert torch.equal(keep(variants.sliding_window_with_globals(window, 3)), near | globals_)


def test_block_mask_must_fit_the_call():
    q, k, v = _qkv()
    mask = flashkit.create_block_mask(variants.causal_mask(), 1, 2, 8, 16, device="cpu",
                                      BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="block_mask: built for"):
        flashkit.flash_attn_func(q, k, v, block_mask=mask)
    mask = flashkit.create_block_mask(variants.causal_mask(), 1, 2, 8, 8, device="cpu",
                                      BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="block_mask: causal and window_size"):
        flashkit.flash_attn_func(q, k, v, block_mask=mask, causal=True)
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        flashkit.create_block_mask(variants.causal_mask(), 1, 2, 8, 8, device="cpu",
                                   BLOCK_SIZE=24)


def test_kept_variant_calls_skip_the_checks_and_keep_nothing_alive(monkeypatch):
    """An equal call with the same modifier objects reuses the params the first one checked
    and bound (attach runs once) and reads the captured tensors' contents anew; another
    modifier object, length or scalar argument is checked again; a refused call is never
    kept; and what is kept lives with the modifier: the last user reference to a modifier
    frees it and its captured tensors."""
    import gc
    import weakref

    from flashkit.variants import mods
    attached = []
    attach = mods.attach
    monkeypatch.setattr(mods, "attach", lambda *a: attached.append(None) or attach(*a))
    q, k, v = _qkv()
    table = torch.randn(2)
    mod = variants.ScoreMod(_bias, table, grad=_bias_one)

    def call(score_mod, x=q, **kwargs):
        return flashkit.flash_attn_func(x, k[:, :x.shape[1]], v[:, :x.shape[1]],
                                        score_mod=score_mod, backend="triton", **kwargs)

    first = call(mod)
    assert len(attached) == 1
    torch.testing.assert_close(call(mod), first, rtol=0, atol=0)
    assert len(attached) == 1  # kept
    table.add_(1.0)  # in place: the kept call reads the new contents
    moved = call(mod)
    assert len(attached) == 1
    torch.testing.assert_close(moved, call(variants.ScoreMod(_bias, table.clone(),
                                                             grad=_bias_one)),
                               rtol=0, atol=0)
    assert len(attached) == 2  # another modifier object
    call(mod, q[:, :5])
    call(mod, causal=True)
    assert len(attached) == 4  # another length, another scalar argument
    mask = flashkit.create_block_mask(variants.causal_mask(), 1, 2, 8, 8, device="cpu",
                                      BLOCK_SIZE=16)
    for _ in range(2):
        call(mod, block_mask=mask)
    assert len(attached) == 5
    for _ in range(2):  # refused each time, never kept
        with pytest.raises(ValueError, match="block_mask: causal and window_size"):
            call(mod, block_mask=mask, causal=True)
    assert len(attached) == 7

    alive = weakref.ref(table), weakref.ref(mod), weakref.ref(mask)
    del mod, mask, table
    flashkit.flash_attn_func(q, k, v, backend="triton")  # the last params seen is another's
    gc.collect()
    assert all(ref() is None for ref in alive)


def test_triton_backward_needs_what_it_cannot_derive():
    """The Triton backward differentiates score_mod through its grad= function and captured
    tensors through its captured_grad= rule: both refused before any launch when missing,
    naming score_mod."""
    q, k, v = (x.requires_grad_() for x in _qkv())
    with pytest.raises(NotImplementedError, match="score_mod: backend 'triton' differentiates"):
        flashkit.flash_attn_func(q, k, v, backend="triton",
                                 score_mod=variants.ScoreMod(_bias, torch.zeros(2)))
    table = torch.zeros(2, 13, requires_grad=True)
    with pytest.raises(NotImplementedError, match="captured_grad rule"):
        flashkit.flash_attn_func(q, k, v, backend="triton", score_mod=variants.ScoreMod(
            _bias, table, grad=_bias_one))
    with pytest.raises(TypeError, match="captured_grad: _bias_one"):
        flashkit.flash_attn_func(q, k, v, backend="triton", score_mod=variants.ScoreMod(
            _bias, table, grad=_bias_one, captured_grad=_bias_one))


def test_plain_function_modifiers_run_everywhere():
    """A FlexAttention-style plain def (operators only) is decorated by flashkit."""
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    q, k, v = _qkv()
    expected = flashkit.flash_attn_func(q.double(), k.double(), v.double(), causal=True,
                                        backend="reference")
    for backend in ("torch", "triton"):
        out = flashkit.flash_attn_func(q, k, v, mask_mod=causal, backend=backend)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_varlen_block_mask_matches_oracle(backend):
    """A block mask over the packed tokens (FlexAttention's document masking over a packed
    batch): per-sequence prefix-LM and a window with global tokens, q and k lengths apart,
    sequences of 0 and 1 tokens, GQA, 16-blocks that straddle sequence starts."""
    lens_q, lens_k = [9, 1, 20, 0, 37], [12, 1, 20, 3, 30]
    inputs = random_varlen(lens_q, lens_k, nheads=4, nheads_k=2, headdim=16)
    cu_q, cu_k = inputs["cu_seqlens_q"], inputs["cu_seqlens_k"]
    prefix = torch.tensor([3, 0, 7, 1, 11], dtype=torch.int32)

    @triton.jit
    def prefix_window(b, h, q_idx, kv_idx, prefix):
        near = (kv_idx <= q_idx) & (q_idx - kv_idx <= 6)
        return near | (kv_idx < tl.load(prefix + b))
    mask = flashkit.create_block_mask(variants.MaskMod(prefix_window, prefix), None, None,
                                      sum(lens_q), sum(lens_k), device="cpu", BLOCK_SIZE=16,
                                      cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert 0 < mask.sparsity() < 1

    def run(backend, q, k, v, **rest):
        return (flashkit.flash_attn_varlen_func(q, k, v, **rest, block_mask=mask,
                                                backend=backend),)
    check_against_oracle(functools.partial(run, backend), inputs, output_names=("out",),
                         oracle_fn=functools.partial(run, "reference"))


def test_kept_varlen_calls_with_a_block_mask_check_changed_cu_seqlens(monkeypatch):
    """A varlen call with a block mask over the packed tokens is kept by the mask with its
    cu_seqlens' identities and versions: an equal call with the same tensors, unchanged, checks
    and binds nothing again and gives the same results; one whose cu_seqlens was written in
    place is checked again, and refused: the mask was built over its old values. What is kept
    lives with the mask: its last user reference frees it."""
    import gc
    import weakref

    from flashkit import checks
    from flashkit.variants import mods
    attached, attach = [], mods.attach
    monkeypatch.setattr(mods, "attach", lambda *a: attached.append(None) or attach(*a))
    checked, varlen_values = [], checks.varlen_values
    monkeypatch.setattr(checks, "varlen_values",
                        lambda *a, **kw: checked.append(None) or varlen_values(*a, **kw))
    lens = [9, 20, 3]
    inputs = random_varlen(lens, lens, nheads=2, nheads_k=1, headdim=16)
    cu = inputs["cu_seqlens_q"]
    inputs["cu_seqlens_k"] = cu
    mask = flashkit.create_block_mask(variants.causal_mask(), None, None, sum(lens), sum(lens),
                                      device="cpu", BLOCK_SIZE=16, cu_seqlens_q=cu,
                                      cu_seqlens_k=cu)

    def call(block_mask):
        return flashkit.flash_attn_varlen_func(**inputs, block_mask=block_mask,
                                               backend="triton")

    first = call(mask)
    assert len(attached) == len(checked) == 1
    torch.testing.assert_close(call(mask), first, rtol=0, atol=0)
    assert len(attached) == len(checked) == 1  # kept
    cu[1] = 10  # in place: lengths 10, 19, 3
    with pytest.raises(ValueError, match="block_mask: built over a cu_seqlens_q written in"):
        call(mask)
    assert len(checked) == 2
    alive = weakref.ref(mask)
    del mask
    q, k, v = (inputs[name] for name in ("q", "k", "v"))
    flashkit.flash_attn_func(q[None], k[None], v[None], backend="triton")  # another's params
    gc.collect()
    assert alive() is None


def test_varlen_block_mask_states_match_dense_mask():
    """Blocks over the packed axes: a pair is visible iff both tokens share a sequence and
    mask_mod says so at the sequence's own positions."""
    lens_q, lens_k = [5, 0, 21, 2], [7, 4, 18, 2]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lens_q, lens_k))
    mask = flashkit.create_block_mask(variants.causal_mask(), None, None, sum(lens_q),
                                      sum(lens_k), device="cpu", BLOCK_SIZE=16,
                                      cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    dense = torch.zeros(sum(lens_q), sum(lens_k), dtype=torch.bool)
    for b in range(len(lens_q)):
        i = torch.arange(lens_q[b])[:, None]
        j = torch.arange(lens_k[b])[None, :]
        dense[cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]] = i >= j
    state = mask.to_dense()[0, 0]
    for r in range(state.shape[0]):
        for c in range(state.shape[1]):
            tile = dense[r * 16:(r + 1) * 16, c * 16:(c + 1) * 16]
            expected = 0 if not tile.any() else (2 if tile.all() and tile.shape == (16, 16)
                                                 else 1)
            assert state[r, c] == expected, (r, c)
    q = torch.randn(sum(lens_q), 2, 16)
    with pytest.raises(ValueError, match="block_mask: built over packed"):
        flashkit.flash_attn_func(q[None], q[None], q[None], block_mask=mask)
    plain = flashkit.create_block_mask(variants.causal_mask(), None, None, sum(lens_q),
                                       sum(lens_q), device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="block_mask: a varlen call needs"):
        flashkit.flash_attn_varlen_func(q, q, q, cu_q, cu_q, 21, 21, block_mask=plain)
