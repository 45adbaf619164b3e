"""User variants on the GPU: every example with odd lengths, GQA and varlen against the float64
oracle in bf16 and fp16, block masks against the dense mask, and compile counts."""

from __future__ import annotations

import functools
import importlib
import logging

import pytest
import torch
import triton
import triton.language as tl
from variant_cases import CAPTURED_GRADS, EXAMPLES, attention, documents, extras

import flashkit
from flashkit import variants
from helpers import ON_HOPPER, check_against_oracle, random_qkv, random_varlen

pytestmark = pytest.mark.gpu


def _cuda(inputs: dict) -> dict:
    return {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}


def _check(name, inputs, grad_names=("q", "k", "v")):
    check_against_oracle(functools.partial(attention, "triton", name), _cuda(inputs),
                         output_names=("out",),
                         oracle_fn=functools.partial(attention, "reference", name),
                         grad_names=grad_names)


@pytest.mark.parametrize("lengths", [(203, 113), (512, 384)])
@pytest.mark.parametrize("name", sorted(CAPTURED_GRADS))
@pytest.mark.usefixtures("fresh_plans")
def test_captured_gradients_match_oracle(name, lengths, caplog):
    """captured_grad rules on the GPU's atomics: bf16, d128, GQA, odd lengths both ways (on
    sm_90 the Gluon dQ kernel as varlen) and whole tiles (the Gluon dQ kernel as dense)."""
    seqlen_q, seqlen_k = lengths
    q, k, v = random_qkv(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=8, nheads_k=2,
                         headdim=128, dtype=torch.bfloat16)
    with caplog.at_level(logging.DEBUG, logger="flashkit.dispatch"):
        _check(name, dict(q=q, k=k, v=v, **extras(name, 2, 8, seqlen_q, seqlen_k)),
               ("q", "k", "v", CAPTURED_GRADS[name]))
    ran = [r.getMessage() for r in caplog.records if r.name == "flashkit.dispatch"]
    if ON_HOPPER:
        assert any(m.startswith("backward ran gluon") for m in ran), ran


def test_varlen_block_mask_matches_oracle():
    """A causal block mask over packed sequences (0, 1 and odd lengths), bf16, GQA."""
    lengths = [300, 1, 0, 517, 129]
    inputs = _cuda(random_varlen(lengths, lengths, nheads=8, nheads_k=2, headdim=128,
                                 dtype=torch.bfloat16))
    mask = flashkit.create_block_mask(variants.causal_mask(), None, None, sum(lengths),
                                      sum(lengths), device="cuda",
                                      cu_seqlens_q=inputs["cu_seqlens_q"],
                                      cu_seqlens_k=inputs["cu_seqlens_k"])

    def run(backend, **kw):
        return (flashkit.flash_attn_varlen_func(**kw, block_mask=mask, backend=backend),)
    check_against_oracle(functools.partial(run, "triton"), inputs, output_names=("out",),
                         oracle_fn=functools.partial(run, "reference"))


def _check_packed(inputs, mask, score_mod_of, grad_names, caplog) -> list:
    """A varlen call with block_mask over its packed tokens and score_mod_of(the captured
    tensor inputs["captured"]) against the oracle; returns the dispatch's messages."""
    def run(backend, captured, **kw):
        return (flashkit.flash_attn_varlen_func(**kw, block_mask=mask, backend=backend,
                                                score_mod=score_mod_of(captured)),)
    with caplog.at_level(logging.DEBUG, logger="flashkit.dispatch"):
        check_against_oracle(functools.partial(run, "triton"), inputs, output_names=("out",),
                             oracle_fn=functools.partial(run, "reference"),
                             grad_names=grad_names)
    return [r.getMessage() for r in caplog.records if r.name == "flashkit.dispatch"]


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype, headdim", [(torch.bfloat16, 128), (torch.float16, 64),
                                            (torch.bfloat16, 256)])
@pytest.mark.parametrize("lengths", [[300, 1, 0, 517, 206], [300, 1, 0, 517, 129]])
@pytest.mark.usefixtures("fresh_plans")
def test_gluon_kernels_take_a_block_mask_over_packed_tokens(lengths, headdim, dtype, caplog):
    """A causal block mask over varlen's packed tokens with a relative-position score_mod
    (which must see positions within each sequence) and a sink, GQA, an empty and a
    one-token sequence: the Gluon forward runs it as one sequence (1024 tokens, on the tiles,
    and 947, off them), and with the packed total on the backward's tiles the Gluon backward
    too; both against the oracle."""
    inputs = _cuda(random_varlen(lengths, lengths, nheads=8, nheads_k=2, headdim=headdim,
                                 dtype=dtype))
    total = sum(lengths)
    mask = flashkit.create_block_mask(variants.causal_mask(), None, None, total, total,
                                      device="cuda", cu_seqlens_q=inputs["cu_seqlens_q"],
                                      cu_seqlens_k=inputs["cu_seqlens_k"])
    inputs.update(sink=torch.randn(8, device="cuda"),
                  captured=torch.randn(8, 13, device="cuda"))
    ran = _check_packed(inputs, mask, variants.relative_bias, ("q", "k", "v", "sink"), caplog)
    assert any(m.startswith("forward ran gluon") for m in ran), ran
    if total % 128 == 0:
        assert any(m.startswith("backward ran gluon") for m in ran), ran


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("mod", ["relative_bias", "alibi"])
@pytest.mark.usefixtures("fresh_plans")
def test_gluon_backward_learns_captured_tensors_over_packed_tokens(mod, caplog):
    """A score_mod whose captured tensor learns (a relative-position table, ALiBi slopes)
    under a causal block mask over varlen's packed tokens (1024: the backward's tiles): the
    Gluon dQ kernel runs the captured_grad rule at each pair's sequence and positions in it;
    q, k, v and the captured tensor's gradients against the oracle."""
    lengths = [300, 1, 0, 517, 206]
    inputs = _cuda(random_varlen(lengths, lengths, nheads=8, nheads_k=2, headdim=128,
                                 dtype=torch.bfloat16))
    total = sum(lengths)
    mask = flashkit.create_block_mask(variants.causal_mask(), None, None, total, total,
                                      device="cuda", cu_seqlens_q=inputs["cu_seqlens_q"],
                                      cu_seqlens_k=inputs["cu_seqlens_k"])
    make = variants.relative_bias if mod == "relative_bias" else variants.alibi
    inputs["captured"] = (torch.randn(8, 13, device="cuda") if mod == "relative_bias" else
                          torch.rand(8, device="cuda") * 0.1)
    ran = _check_packed(inputs, mask, make, ("q", "k", "v", "captured"), caplog)
    assert any(m.startswith("backward ran gluon") for m in ran), ran


@pytest.mark.parametrize("dtype, headdim", [(torch.bfloat16, 128), (torch.float16, 64)])
@pytest.mark.parametrize("lengths", [(113, 203), (1023, 1023)])
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_matches_oracle(name, lengths, headdim, dtype):
    seqlen_q, seqlen_k = lengths
    if name in ("document", "prefix_lm"):
        seqlen_k = seqlen_q
    q, k, v = random_qkv(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=8, nheads_k=2,
                         headdim=headdim, dtype=dtype)
    _check(name, dict(q=q, k=k, v=v, **extras(name, 2, 8, seqlen_q, seqlen_k)))


@pytest.mark.parametrize("name", EXAMPLES)
def test_varlen_example_matches_oracle(name):
    lengths = [300, 1, 0, 517]
    inputs = random_varlen(lengths, lengths, nheads=8, nheads_k=4, headdim=64,
                           dtype=torch.bfloat16)
    _check(name, dict(**inputs, **extras(name, len(lengths), 8, 517, 517)))


@pytest.mark.parametrize("block", [128, (128, 64)])
@pytest.mark.parametrize("seqlen", [1000, 2048])
def test_block_mask_matches_oracle(seqlen, block):
    doc = documents(seqlen, batch=2).cuda()
    mask = flashkit.create_block_mask(variants.document_mask(doc, causal=True), 2, None,
                                      seqlen, seqlen, device="cuda", BLOCK_SIZE=block)
    dense = torch.zeros(2, 1, seqlen, seqlen, dtype=torch.bool, device="cuda")
    i = torch.arange(seqlen, device="cuda")
    dense[:, 0] = (doc[:, :, None] == doc[:, None, :]) & (i[:, None] >= i[None, :])
    bq, bk = mask.BLOCK_SIZE
    n_q, n_k = -(-seqlen // bq), -(-seqlen // bk)
    padded = torch.zeros(2, 1, n_q * bq, n_k * bk, dtype=torch.bool, device="cuda")
    padded[..., :seqlen, :seqlen] = dense
    tiles = padded.view(2, 1, n_q, bq, n_k, bk)
    assert torch.equal(mask.to_dense() > 0, tiles.any(5).any(3))
    q, k, v = random_qkv(batch=2, seqlen_q=seqlen, nheads=8, nheads_k=2, headdim=128,
                         dtype=torch.bfloat16)

    def run(backend, q, k, v):
        return (flashkit.flash_attn_func(q, k, v, block_mask=mask, backend=backend),)
    check_against_oracle(functools.partial(run, "triton"), _cuda(dict(q=q, k=k, v=v)),
                         output_names=("out",), oracle_fn=functools.partial(run, "reference"))


def _compiled() -> int:
    """Kernels compiled so far by the forwards (portable, sm_90 Gluon) and the portable
    backward (every device)."""
    kernels = [importlib.import_module("flashkit.ops.triton.forward")._fwd_kernel,
               importlib.import_module("flashkit.ops.triton.forward_hopper")._fwd_hopper_kernel,
               importlib.import_module("flashkit.ops.triton.backward")._bwd_kernel]
    return sum(len(caches[0]) for kernel in kernels for caches in kernel.device_caches.values())


@pytest.mark.parametrize("lengths", [(1001, 1501, 1701), (2048, 1920)])
def test_new_length_compiles_nothing(lengths):
    """The same variant at a new length (same divisibility class) reuses its kernels: odd
    lengths, and lengths on the tiles whose tile counts differ in their divisibility by 16
    (2048 / 128 = 16, 1920 / 128 = 15), which the kernels do not specialise on."""
    table = torch.randn(8, 2 * 6 + 1, device="cuda")
    mod = variants.relative_bias(table)
    for seqlen in lengths:
        q, k, v = random_qkv(batch=1, seqlen_q=seqlen, nheads=8, headdim=64,
                             dtype=torch.bfloat16)
        q, k, v = (x.cuda().requires_grad_() for x in (q, k, v))
        flashkit.flash_attn_func(q, k, v, score_mod=mod).sum().backward()
        if seqlen == lengths[0]:
            before = _compiled()
    assert _compiled() == before


@triton.jit
def _same_document(b, h, q_idx, kv_idx, ids, stride_b, stride_h):
    """Document ids per batch entry and head (stride_h 0: one row for every head)."""
    row = ids + b * stride_b + h * stride_h
    return tl.load(row + q_idx) == tl.load(row + kv_idx)


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.usefixtures("fresh_plans")
def test_gluon_forward_runs_user_modifiers(caplog):
    """On sm_90 the Gluon kernels take a score_mod (with gradients for its captured tensors
    in the backward), a mask_mod and a block mask shared by the heads whose blocks hold whole
    tiles (the backward's tiles are smaller than the forward's), and the forward names why it
    declines one of other blocks."""
    q, k, v = (x.cuda().requires_grad_() for x in random_qkv(
        batch=1, seqlen_q=512, nheads=8, headdim=128, dtype=torch.bfloat16))
    doc = documents(512, batch=1).cuda()
    masks = {block: flashkit.create_block_mask(variants.document_mask(doc), 1, None, 512, 512,
                                               device="cuda", BLOCK_SIZE=block)
             for block in (128, (128, 64))}
    table, learned = torch.randn(8, 9).cuda(), torch.randn(8, 9, device="cuda",
                                                         requires_grad=True)
    calls = {"score_mod": dict(score_mod=variants.relative_bias(table)),
             "learned table": dict(score_mod=variants.relative_bias(learned)),
             "mask_mod": dict(mask_mod=variants.document_mask(doc)),
             "block_mask": dict(block_mask=masks[128]),
             "small blocks": dict(block_mask=masks[(128, 64)])}
    ran = {}
    for name, kwargs in calls.items():
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="flashkit.dispatch"):
            flashkit.flash_attn_func(q, k, v, **kwargs).sum().backward()
        ran[name] = [r.getMessage() for r in caplog.records if r.name == "flashkit.dispatch"]
    for name in ("score_mod", "learned table", "mask_mod", "block_mask"):
        assert ran[name][0].startswith("forward ran gluon"), name
    assert ran["small blocks"][0].startswith("forward ran triton; declined: ")
    assert "; gluon: block mask blocks 128 x 64" in ran["small blocks"][0]
    for name in ("score_mod", "learned table", "mask_mod", "block_mask", "small blocks"):
        assert ran[name][-1].startswith("backward ran gluon"), name


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype, headdim", [(torch.bfloat16, 128), (torch.float16, 64),
                                            (torch.bfloat16, 256)])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("seqlen_q", [333, 512])
@pytest.mark.usefixtures("fresh_plans")
def test_gluon_kernels_walk_a_block_mask(seqlen_q, per_head, headdim, dtype, caplog):
    """A document mask (per batch entry, or per batch entry and head) as a block mask with its
    mask_mod, a score_mod and built-in ALiBi and a sink on top, GQA, odd query length: the
    Gluon forward's listed tiles against the oracle, which materialises the mask; with whole
    tiles (seqlen_q 512) the Gluon backward's too, a mask per head walked head after head of
    each GQA group by the dK/dV kernel."""
    batch, nheads, seqlen_k = 2, 8, 512
    doc = torch.cat([documents(seqlen_k, batch=batch)[:, None]] * (nheads if per_head else 1), 1)
    if per_head:  # other documents per head: shift the ids along the positions
        doc = torch.stack([d.roll(37 * h, dims=-1) for h, d in enumerate(doc.unbind(1))], 1)
    doc = doc.cuda()
    mod = flashkit.MaskMod(_same_document, doc, doc.stride(0), doc.stride(1) if per_head else 0)
    mask = flashkit.create_block_mask(mod, batch, nheads if per_head else None, seqlen_q,
                                      seqlen_k, device="cuda")
    q, k, v = random_qkv(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads,
                         nheads_k=2, headdim=headdim, dtype=dtype)
    sink, slopes, table = torch.randn(nheads), torch.rand(nheads).cuda(), torch.randn(nheads, 13)

    def run(backend, q, k, v, sink, table):
        return (flashkit.flash_attn_func(
            q, k, v, alibi_slopes=slopes, sink=sink, backend=backend, mask_mod=mod,
            block_mask=mask, score_mod=variants.relative_bias(table)),)
    with caplog.at_level(logging.DEBUG, logger="flashkit.dispatch"):
        check_against_oracle(functools.partial(run, "triton"),
                             _cuda(dict(q=q, k=k, v=v, sink=sink, table=table)),
                             output_names=("out",),
                             oracle_fn=functools.partial(run, "reference"),
                             grad_names=("q", "k", "v", "sink"))
    ran = [r.getMessage() for r in caplog.records if r.name == "flashkit.dispatch"]
    if seqlen_q == 512:
        assert any(m.startswith("backward ran gluon") for m in ran), ran


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.usefixtures("fresh_plans")
def test_a_planned_variant_reads_each_calls_own_tensors():
    """Calls of one variant share a launch plan whose direct launches (from the third call on)
    are passed each call's captured tensors and block-mask lists: two document masks of the
    same geometry and two bias tables, alternated over four steps, each step against the
    oracle, forward and backward, with the Gluon kernels' direct launches taken."""
    from flashkit.ops.triton import dispatch

    batch, nheads, seqlen = 2, 8, 512
    docs = [documents(seqlen, batch=batch).cuda() for _ in range(2)]
    masks = [flashkit.create_block_mask(variants.document_mask(d, causal=True), batch, None,
                                        seqlen, seqlen, device="cuda") for d in docs]
    tables = [torch.randn(nheads, 13) for _ in range(2)]
    for step in range(4):
        q, k, v = random_qkv(batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, nheads=nheads,
                             nheads_k=2, headdim=128, dtype=torch.bfloat16)

        def run(backend, q, k, v, table, mask=masks[step % 2]):
            return (flashkit.flash_attn_func(q, k, v, backend=backend, block_mask=mask,
                                             score_mod=variants.relative_bias(table)),)
        check_against_oracle(functools.partial(run, "triton"),
                             _cuda(dict(q=q, k=k, v=v, table=tables[step % 2])),
                             output_names=("out",),
                             oracle_fn=functools.partial(run, "reference"))
    launches = [p for plan in dispatch._plans.values() if plan.kernel == "gluon"
                for p in plan.launches.values()]
    assert len(launches) == 3 and all(p._direct is not None for p in launches), launches


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype, headdim", [(torch.bfloat16, 128), (torch.float16, 64),
                                            (torch.bfloat16, 256)])
@pytest.mark.parametrize("lengths", [(203, 461), (640, 640)])
def test_gluon_kernels_combine_modifiers_with_builtin_features(lengths, headdim, dtype):
    """score_mod after softcap and ALiBi, mask_mod inside a causal window, a sink, GQA, odd
    lengths (the Gluon backward as varlen) and whole tiles: the Gluon forward and backward
    against the oracle, the sink's gradient too."""
    seqlen_q, seqlen_k = lengths
    q, k, v = random_qkv(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=8, nheads_k=2,
                         headdim=headdim, dtype=dtype)
    sink, slopes, table = torch.randn(8), torch.rand(8).cuda(), torch.randn(8, 13)

    def run(backend, q, k, v, sink, table):
        return (flashkit.flash_attn_func(
            q, k, v, causal=True, window_size=(97, -1), softcap=20.0, alibi_slopes=slopes,
            sink=sink, backend=backend, score_mod=variants.relative_bias(table),
            mask_mod=variants.sliding_window_with_globals(40, 3)),)
    check_against_oracle(functools.partial(run, "triton"),
                         _cuda(dict(q=q, k=k, v=v, sink=sink, table=table)),
                         output_names=("out",), oracle_fn=functools.partial(run, "reference"),
                         grad_names=("q", "k", "v", "sink"))
