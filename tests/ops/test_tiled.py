"""The tiled pure-PyTorch backend against the float64 oracle (docs/design.md section 5).

Through the public API (backend="torch", return_attn_probs=True so lse and its gradient are
checked too) and through flashkit.ops.tiled directly (block sizes). Every output and gradient
must satisfy max|kernel - oracle| <= 2 * max|reference_in_dtype - oracle| + 1e-5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashkit
from flashkit.api import draw_dropout_seed
from flashkit.ops import tiled
from flashkit.ops.params import AttentionParams
from flashkit.reference import attention_with_params
from flashkit.testing import (
    GRAD_FACTOR,
    OUTPUT_FACTOR,
    assert_close_to_oracle,
    dropout_keep_mask,
)
from helpers import (
    DTYPE_IDS,
    DTYPES,
    alibi_slopes,
    api_attention,
    check_against_oracle,
    oracle,
    random_qkv,
    random_varlen,
    sink,
)

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal): awkward lengths, q != k both
# ways, every head dim, GQA ratio 1, 4 and all (MQA), batch 1 and > 1.
SHAPES = [
    (1, 1, 1, 2, 1, 16, False),
    (2, 3, 17, 4, 4, 32, True),
    (2, 17, 3, 4, 1, 40, True),
    (1, 113, 203, 4, 1, 64, False),
    (1, 113, 203, 4, 1, 64, True),
    (2, 203, 113, 8, 2, 80, True),
    (1, 17, 17, 2, 2, 96, False),
    (1, 130, 67, 2, 1, 128, False),
    (2, 33, 65, 4, 1, 192, True),
    (1, 17, 40, 2, 2, 256, False),
]
LARGE_SHAPES = [  # few, and not in float16: CPU half matmuls are slow
    ((1, 1000, 1000, 2, 1, 64, True), torch.bfloat16),
    ((1, 1, 1000, 4, 2, 128, False), torch.float32),
    ((1, 1023, 1024, 2, 2, 32, False), torch.float32),
]


def _id(shape):
    return "b{}-q{}-k{}-h{}/{}-d{}-{}".format(*shape[:6], "causal" if shape[6] else "full")


def _check_shape(shape, dtype, **kwargs):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal = shape
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype=dtype)
    check_against_oracle(api_attention, dict(q=q, k=k, v=v, causal=causal, **kwargs))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_shapes(shape, dtype):
    _check_shape(shape, dtype)


@pytest.mark.parametrize(("shape", "dtype"), LARGE_SHAPES, ids=lambda x: _id(x)
                         if isinstance(x, tuple) else str(x)[6:])
def test_large_shapes(shape, dtype):
    _check_shape(shape, dtype, alibi_slopes=alibi_slopes(shape[3]))


def test_headdim_v_differs():
    q, k, v = random_qkv(2, 19, 33, 4, 2, headdim=32, headdim_v=48)
    check_against_oracle(api_attention, dict(q=q, k=k, v=v, causal=True, sink=sink(4)))


# name -> keyword arguments of flash_attn_func, given (batch, nheads)
FEATURES = {
    "causal": lambda b, h: dict(causal=True),
    "window": lambda b, h: dict(window_size=(8, 3)),
    "window_left": lambda b, h: dict(window_size=(5, -1)),
    "window_right": lambda b, h: dict(window_size=(-1, 4)),
    "diagonal": lambda b, h: dict(window_size=(0, 0)),
    "causal_window": lambda b, h: dict(causal=True, window_size=(32, 0)),
    "alibi": lambda b, h: dict(alibi_slopes=alibi_slopes(h)),
    "alibi_batch": lambda b, h: dict(alibi_slopes=alibi_slopes(h, batch=b)),
    "softcap": lambda b, h: dict(softcap=2.5),
    "sink": lambda b, h: dict(sink=sink(h)),
    "scale": lambda b, h: dict(softmax_scale=0.31),
    "sink_causal": lambda b, h: dict(sink=sink(h) + 2, causal=True),
    "sink_dominant": lambda b, h: dict(sink=sink(h) + 12),
    "large_scores": lambda b, h: dict(softmax_scale=4.0),
    "alibi_softcap_window": lambda b, h: dict(alibi_slopes=alibi_slopes(h, batch=b),
                                              softcap=5.0, window_size=(10, 6)),
    "everything": lambda b, h: dict(causal=True, window_size=(20, 0), softcap=8.0,
                                    alibi_slopes=alibi_slopes(h), sink=sink(h),
                                    softmax_scale=0.2),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("lengths", [(37, 70), (70, 37)], ids=["q<k", "q>k"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features(feature, lengths, dtype):
    batch, nheads = 2, 4
    q, k, v = random_qkv(batch, *lengths, nheads, nheads_k=2, headdim=40, dtype=dtype)
    check_against_oracle(api_attention, dict(q=q, k=k, v=v, **FEATURES[feature](batch, nheads)))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("feature", ["causal", "window", "alibi_batch", "everything"])
def test_varlen(feature, dtype):
    lengths_q, lengths_k = [5, 0, 1, 40, 17, 1], [9, 3, 0, 33, 17, 1]
    inputs = random_varlen(lengths_q, lengths_k, nheads=4, nheads_k=2, headdim=32, dtype=dtype)
    check_against_oracle(api_attention, {**inputs, **FEATURES[feature](len(lengths_q), 4)})


def test_varlen_matches_dense_per_sequence():
    """Each packed sequence gives what the dense kernel gives for it alone."""
    lengths_q, lengths_k = [3, 20, 1], [7, 20, 30]
    inputs = random_varlen(lengths_q, lengths_k, nheads=4, nheads_k=1, headdim=32)
    slopes = alibi_slopes(4, batch=3)
    out = flashkit.flash_attn_varlen_func(**inputs, causal=True, alibi_slopes=slopes,
                                          backend="torch")
    cu_q, cu_k = inputs["cu_seqlens_q"].tolist(), inputs["cu_seqlens_k"].tolist()
    for b in range(3):
        dense = flashkit.flash_attn_func(inputs["q"][None, cu_q[b]:cu_q[b + 1]],
                                         inputs["k"][None, cu_k[b]:cu_k[b + 1]],
                                         inputs["v"][None, cu_k[b]:cu_k[b + 1]], causal=True,
                                         alibi_slopes=slopes[b], backend="torch")
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]], dense[0], rtol=0, atol=1e-6)


def test_empty_rows():
    """Rows that see no key (window past the keys, no sink): out 0, lse -inf, finite gradients."""
    q, k, v = random_qkv(2, 40, 9, 4, 2, headdim=16)
    out, lse = check_against_oracle(api_attention, dict(q=q, k=k, v=v, window_size=(0, 0)))
    assert torch.isneginf(lse[:, :, :31]).all() and torch.isfinite(lse[:, :, 31:]).all()
    assert (out[:, :31] == 0).all()


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_strided_inputs(strided):
    q, k, v = random_qkv(2, 33, 47, 4, 2, headdim=32, strided=strided)
    assert q.is_contiguous() != strided
    check_against_oracle(api_attention, dict(q=q, k=k, v=v, causal=True, sink=sink(4)))


def test_attention_probs():
    """return_attn_probs: the weights match the oracle's, and a gradient through them too."""
    q, k, v = random_qkv(2, 21, 45, 4, 2, headdim=32)

    def kernel(**kw):
        return flashkit.flash_attn_func(**kw, return_attn_probs=True, backend="torch")

    inputs = dict(q=q, k=k, v=v, window_size=(9, 2), alibi_slopes=alibi_slopes(4), sink=sink(4))
    check_against_oracle(kernel, inputs, output_names=("out", "lse", "probs"),
                         oracle_fn=lambda **kw: oracle(**kw, return_probs=True))
    # Longer than one 128 x 128 tile each way, with a band that skips tiles.
    q, k, v = random_qkv(1, 300, 270, 2, 1, headdim=16)
    inputs = dict(q=q, k=k, v=v, window_size=(70, 5), softcap=3.0)
    check_against_oracle(kernel, inputs, output_names=("out", "lse", "probs"),
                         oracle_fn=lambda **kw: oracle(**kw, return_probs=True))


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=DTYPE_IDS[:2])
def test_attention_probs_varlen(dtype):
    inputs = random_varlen([4, 0, 19], [7, 5, 19], nheads=2, headdim=16, dtype=dtype)
    _, _, probs = flashkit.flash_attn_varlen_func(**inputs, causal=True, return_attn_probs=True,
                                                  backend="torch")
    as64 = {n: t.double() if torch.is_tensor(t) and t.is_floating_point() else t
            for n, t in inputs.items()}
    expected = oracle(**as64, causal=True, return_probs=True)[2]
    baseline = oracle(**inputs, causal=True, return_probs=True)[2]
    assert len(probs) == 3
    for b, (p, e, base) in enumerate(zip(probs, expected, baseline, strict=True)):
        assert_close_to_oracle(f"probs[{b}]", p, e, base)


# --- flashkit.ops.tiled called directly ---------------------------------------------------

def _run_tiled(q, k, v, params, dout, block_m, block_n):
    out, lse = tiled.forward(q, k, v, params, block_m=block_m, block_n=block_n)
    grads = tiled.backward(dout, q, k, v, out, lse, params, block_m=block_m, block_n=block_n)
    return (out, lse, *grads)


def _run_oracle(q, k, v, params, dout):
    """(out, lse, dq, dk, dv, dsink or None) of the oracle, in the dtype of its inputs."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v, params.sink) if t is not None]
    out, lse = attention_with_params(*leaves[:3],
                                     dataclasses.replace(params, sink=(leaves + [None])[3]))
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return (out, lse, *grads, *[None] * (4 - len(grads)))


def _as64(params):
    return dataclasses.replace(params, **{
        name: getattr(params, name).double() for name in ("alibi_slopes", "sink")
        if getattr(params, name) is not None})


def check_tiled_direct(q, k, v, params, block_m, block_n):
    """flashkit.ops.tiled.forward/backward with the given tiles against the oracle, by the rule.
    The forward writes out in the inputs' dtype and the backward reads it, as through the API."""
    dout = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype).double()
    got = _run_tiled(q, k, v, params, dout.to(q.dtype),
                     block_m, block_n)
    expected = _run_oracle(q.double(), k.double(), v.double(), _as64(params), dout)
    baseline = _run_oracle(q, k, v, params, dout)
    for name, g, e, b in zip(["out", "lse", "dq", "dk", "dv", "dsink"], got, expected, baseline,
                             strict=True):
        if name == "dsink" and params.sink is None:
            assert g is None
            continue
        assert_close_to_oracle(name, g, e, b,
                               factor=GRAD_FACTOR if name.startswith("d") else OUTPUT_FACTOR)


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=DTYPE_IDS[:2])
@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (16, 128), (32, 64), (64, 32),
                                                  (128, 16), (128, 128)])
def test_block_sizes(block_m, block_n, dtype):
    """Every tiling gives the oracle's answer; the window and the uneven lengths cut tiles."""
    q, k, v = random_qkv(2, 150, 97, 4, 2, headdim=32, dtype=dtype)
    params = AttentionParams(softmax_scale=0.2, window_left=40, window_right=7, softcap=6.0,
                             alibi_slopes=alibi_slopes(4, batch=2), sink=sink(4))
    check_tiled_direct(q, k, v, params, block_m, block_n)


def test_block_sizes_agree():
    """Different tilings differ only by float32 rounding."""
    q, k, v = random_qkv(1, 100, 77, 2, 1, headdim=16)
    params = AttentionParams(softmax_scale=0.25, window_right=0, sink=sink(2))
    dout = torch.randn(1, 100, 2, 16)
    results = [_run_tiled(q, k, v, params, dout, bm, bn) for bm, bn in [(16, 128), (128, 16),
                                                                          (32, 64)]]
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=DTYPE_IDS[:2])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_dropout(layout, dtype):
    """Dropout against the oracle given the keep-mask the backend drew (rebuilt from its seed)."""
    p, nheads = 0.3, 4
    if layout == "dense":
        q, k, v = random_qkv(2, 41, 29, nheads, 2, headdim=32, dtype=dtype)
        inputs = dict(q=q, k=k, v=v)
        batch, seqlen_q, seqlen_k = 2, 41, 29
    else:
        inputs = random_varlen([7, 0, 30], [12, 4, 30], nheads, 2, headdim=32, dtype=dtype)
        batch, seqlen_q, seqlen_k = 3, 30, 30
    inputs.update(dropout_p=p, causal=True, sink=sink(nheads), alibi_slopes=alibi_slopes(nheads))

    torch.manual_seed(1234)
    seed = draw_dropout_seed()
    mask = dropout_keep_mask(seed, batch, nheads, seqlen_q, seqlen_k, p)
    assert 0.6 < mask.float().mean() < 0.8

    def kernel(**kw):
        torch.manual_seed(1234)  # the call draws the same seed again
        if layout == "varlen":
            return api_attention(**kw)
        return flashkit.flash_attn_func(**kw, return_attn_probs=True, backend="torch")

    outputs = ("out", "lse") if layout == "varlen" else ("out", "lse", "probs")
    check_against_oracle(kernel, inputs, output_names=outputs,
                         oracle_fn=lambda **kw: oracle(**kw, dropout_mask=mask,
                                                       return_probs=layout == "dense"))


def test_dropout_reproducible():
    q, k, v = random_qkv(1, 20, 20, 2, 2, headdim=16)
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(flashkit.flash_attn_func(q, k, v, dropout_p=0.5, backend="torch"))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert not torch.equal(outs[0], flashkit.flash_attn_func(q, k, v, dropout_p=0.5,
                                                             backend="torch"))


def test_sink_with_one_visible_key():
    """A sink and one visible key: P is near 1 and dP - D cancels, where D = rowsum(dO * O) reads
    O rounded to bf16; dq still meets the rule (this case once broke it by 1.23x)."""
    torch.manual_seed(353976348)
    q, k, v = random_qkv(2, 1, 5, 1, 1, headdim=40, dtype=torch.bfloat16)
    check_against_oracle(api_attention, dict(q=q, k=k, v=v, causal=True, softmax_scale=1.0,
                                             sink=sink(1)))


# --- randomised differential test ----------------------------------------------------------

@st.composite
def attention_cases(draw):
    """(seed, shape and dtype, flash_attn_func keywords with tensors still to be drawn)."""
    batch = draw(st.integers(1, 2))
    nheads_k = draw(st.integers(1, 2))
    nheads = nheads_k * draw(st.sampled_from([1, 2, 3]))
    shape = (batch, draw(st.integers(1, 70)), draw(st.integers(1, 70)), nheads, nheads_k,
             draw(st.sampled_from([16, 24, 40, 64])))
    kwargs = dict(causal=draw(st.booleans()),
                  window_size=(draw(st.integers(-1, 30)), draw(st.integers(-1, 30))),
                  softcap=draw(st.sampled_from([0.0, 0.0, 1.5, 20.0])),
                  alibi_slopes=draw(st.sampled_from([None, "head", "batch"])),
                  sink=draw(st.sampled_from([None, 1.0, 5.0])))
    if draw(st.booleans()):
        kwargs["softmax_scale"] = draw(st.floats(0.05, 1.0))
    return draw(st.integers(0, 2**31 - 1)), shape, draw(st.sampled_from(DTYPES)), kwargs


@settings(max_examples=100, deadline=None)
@given(attention_cases())
def test_random_against_oracle(case):
    seed, (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim), dtype, kwargs = case
    torch.manual_seed(seed)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype=dtype)
    if kwargs["alibi_slopes"] is not None:
        kwargs["alibi_slopes"] = alibi_slopes(nheads, batch if kwargs["alibi_slopes"] == "batch"
                                              else None)
    if kwargs["sink"] is not None:
        kwargs["sink"] = sink(nheads) * kwargs["sink"]
    check_against_oracle(api_attention, dict(q=q, k=k, v=v, **kwargs))


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), seqlen_q=st.integers(1, 90), seqlen_k=st.integers(1, 90),
       window_left=st.one_of(st.none(), st.integers(0, 40)),
       window_right=st.one_of(st.none(), st.integers(-20, 40)),
       block_m=st.sampled_from([16, 32, 64]), block_n=st.sampled_from([16, 32, 64]),
       features=st.sets(st.sampled_from(["softcap", "alibi", "sink"])),
       dtype=st.sampled_from(DTYPES[:2]))
def test_random_tilings(seed, seqlen_q, seqlen_k, window_left, window_right, block_m, block_n,
                        features, dtype):
    """Many tiles per row and column: bands that start, end and vanish inside tiles (a negative
    window_right is the SDPA entry's top-left causal), against the oracle."""
    torch.manual_seed(seed)
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, headdim=16, dtype=dtype)
    params = AttentionParams(softmax_scale=0.3, window_left=window_left,
                             window_right=window_right,
                             softcap=4.0 if "softcap" in features else 0.0,
                             alibi_slopes=alibi_slopes(4, 2) if "alibi" in features else None,
                             sink=sink(4) if "sink" in features else None)
    check_tiled_direct(q, k, v, params, block_m, block_n)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1),
       lengths=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1,
                        max_size=5),
       causal=st.booleans(), features=st.sets(st.sampled_from(["alibi", "sink", "window"])))
def test_random_varlen(seed, lengths, causal, features):
    torch.manual_seed(seed)
    lengths_q, lengths_k = (list(x) for x in zip(*lengths, strict=True))
    inputs = random_varlen(lengths_q, lengths_k, nheads=4, nheads_k=2, headdim=16)
    inputs["causal"] = causal
    if "alibi" in features:
        inputs["alibi_slopes"] = alibi_slopes(4, batch=len(lengths))
    if "sink" in features:
        inputs["sink"] = sink(4)
    if "window" in features:
        inputs["window_size"] = (6, 3)
    check_against_oracle(api_attention, inputs)
