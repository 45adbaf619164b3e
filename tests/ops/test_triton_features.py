"""The Triton backend's dropout and varlen against the float64 oracle (docs/design.md section 5).

Through the public API (backend="triton"), so lse and its gradient are checked too. Dropout: the
oracle takes the keep-mask `flashkit.testing.dropout_keep_mask(..., backend="triton")` rebuilds
with the kernels' own Philox helper. Without CUDA the kernels run in the interpreter at small
sizes in fp32, fp16 and bf16 (bf16 through the interpreter shim, see test_triton.py); the `gpu`
tests run real sizes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import flashkit
from flashkit.api import draw_dropout_seed
from flashkit.ops import triton as triton_backend
from flashkit.ops.triton import dropout
from flashkit.testing import assert_close_to_oracle, dropout_keep_mask
from helpers import alibi_slopes, api_attention, check_against_oracle, cu_seqlens, oracle

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
SEED = 1234  # torch seed each dropout call starts from, so the test knows the call's seed


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype):
    return (randn(batch, seqlen_q, nheads, head_dim, dtype=dtype),
            randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype),
            randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype))


def varlen_qkv(lengths_q, lengths_k, nheads, nheads_k, head_dim, dtype):
    return dict(q=randn(sum(lengths_q), nheads, head_dim, dtype=dtype),
                k=randn(sum(lengths_k), nheads_k, head_dim, dtype=dtype),
                v=randn(sum(lengths_k), nheads_k, head_dim, dtype=dtype),
                cu_seqlens_q=cu_seqlens(lengths_q).to(DEVICE),
                cu_seqlens_k=cu_seqlens(lengths_k).to(DEVICE),
                max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))


FEATURES = {  # name -> kwargs(batch, nheads) for flash_attn_func / flash_attn_varlen_func
    "plain": lambda b, h: {},
    "causal": lambda b, h: dict(causal=True),
    "window_alibi": lambda b, h: dict(window_size=(9, 4),
                                      alibi_slopes=alibi_slopes(h, batch=b).to(DEVICE)),
    "softcap_sink": lambda b, h: dict(softcap=3.0, sink=randn(h)),
    "everything": lambda b, h: dict(causal=True, window_size=(20, 0), softcap=8.0,
                                    alibi_slopes=alibi_slopes(h).to(DEVICE), sink=randn(h),
                                    softmax_scale=0.2),
}


def triton_call(**inputs):
    """(out, lse, probs) of the public API on the Triton backend, the dropout seed drawn after
    torch.manual_seed(SEED)."""
    torch.manual_seed(SEED)
    fn = flashkit.flash_attn_varlen_func if "cu_seqlens_q" in inputs else flashkit.flash_attn_func
    return fn(**inputs, return_attn_probs=True, backend="triton")


def call_seed() -> int:
    torch.manual_seed(SEED)
    return draw_dropout_seed()


# ---- dropout --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_dropout_matches_oracle(feature, dtype):
    """out, lse, the dropped probabilities and every gradient equal the oracle's given the
    kernels' keep-mask: forward and both backward kernels drew the same mask."""
    if dtype != torch.float32 and feature not in ("causal", "everything"):
        pytest.skip("fp16 and bf16 cover two features; the rest run in fp32 (CI time)")
    batch, nheads, seqlen_q, seqlen_k, p = 2, 2, 37, 45, 0.3
    q, k, v = qkv(batch, seqlen_q, seqlen_k, nheads, 1, 16, dtype)
    inputs = dict(q=q, k=k, v=v, dropout_p=p, **FEATURES[feature](batch, nheads))
    mask = dropout_keep_mask(call_seed(), batch, nheads, seqlen_q, seqlen_k, p, backend="triton")
    check_against_oracle(triton_call, inputs, output_names=("out", "lse", "probs"),
                         oracle_fn=lambda **kw: oracle(**kw, dropout_mask=mask,
                                                       return_probs=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_dropout_varlen_matches_oracle(dtype):
    lengths_q, lengths_k, nheads, p = [7, 0, 1, 30, 5], [12, 4, 0, 30, 1], 2, 0.25
    inputs = varlen_qkv(lengths_q, lengths_k, nheads, 1, 16, dtype)
    inputs.update(dropout_p=p, **FEATURES["everything"](5, nheads))
    mask = dropout_keep_mask(call_seed(), 5, nheads, 30, 30, p, backend="triton")
    check_against_oracle(triton_call, inputs,
                         oracle_fn=lambda **kw: oracle(**kw, dropout_mask=mask))
    probs = triton_call(**inputs)[2]
    as64 = {n: t.double() if torch.is_tensor(t) and t.is_floating_point() else t
            for n, t in inputs.items()}
    expected = oracle(**as64, dropout_mask=mask, return_probs=True)[2]
    baseline = oracle(**inputs, dropout_mask=mask, return_probs=True)[2]
    for b, (got, want, base) in enumerate(zip(probs, expected, baseline, strict=True)):
        assert_close_to_oracle(f"probs[{b}]", got, want, base)


def philox_draws(seed, batch, nheads, seqlen_q, seqlen_k):
    """The documented draw of every (b, h, i, j) by an independent numpy Philox4x32-7:
    key = seed, counter (g, i, h, b); column j takes call g = 8 (j // 128) + j % 8 and byte
    c = (j % 128) // 8 of it, bits 8 (c % 4) .. + 7 of word c // 4."""
    mask32 = np.uint64(0xFFFFFFFF)
    calls = 8 * math.ceil(seqlen_k / 128)
    b, h, i, g = np.meshgrid(np.arange(batch), np.arange(nheads), np.arange(seqlen_q),
                             np.arange(calls), indexing="ij")
    c = [x.astype(np.uint64) for x in (g, i, h, b)]
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    for _ in range(7):
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & mask32, (p0 >> np.uint64(32)) ^ c[3] ^ k1,
             p0 & mask32]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask32, (k1 + np.uint64(0xBB67AE85)) & mask32
    words = np.stack(c)  # [4, b, h, i, calls]
    j = np.arange(seqlen_k)
    byte = (j % 128) // 8
    # [b, h, i, seqlen_k]: column j's word of its call
    chosen = np.moveaxis(words[byte // 4, ..., 8 * (j // 128) + j % 8], 0, -1)
    return (chosen >> (8 * (byte % 4)).astype(np.uint64)) & np.uint64(0xFF)


@pytest.mark.parametrize("seed", [0, 2**31 + 5, 2**61 + 12345], ids=str)
def test_keep_mask_is_the_documented_philox(seed):
    """Every element of the kernels' mask is the draw dropout.py documents, compared >= round(p
    256); so the mask is a pure function of (seed, b, h, i, j), whatever the tiles."""
    p = 0.3
    mask = dropout_keep_mask(seed, 2, 3, 19, 270, p, backend="triton")
    expected = philox_draws(seed, 2, 3, 19, 270) >= round(p * 256)
    assert np.array_equal(mask.cpu().numpy(), expected)


@triton.jit
def _philox_pair_kernel(Out, Rows, Calls, seed_lo, seed_hi, off_b, off_h, N: tl.constexpr):
    """Out [2, 4, N] uint32: dropout.philox_calls and tl.philox (n_rounds=7) of the same calls."""
    offs = tl.arange(0, N)
    rows, calls = tl.load(Rows + offs), tl.load(Calls + offs)
    ours = dropout.philox_calls(seed_lo, seed_hi, off_b, off_h, rows, calls)
    seed = (seed_hi.to(tl.uint64) << 32) | seed_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
    zero = calls * 0
    theirs = tl.philox(seed, calls, rows, zero + off_h.to(tl.uint32), zero + off_b.to(tl.uint32),
                       n_rounds=7)
    for w in tl.static_range(4):
        tl.store(Out + w * N + offs, ours[w])
        tl.store(Out + (4 + w) * N + offs, theirs[w])


@pytest.mark.parametrize("seed", [0, 2**32 - 1, 2**61 + 12345], ids=str)
def test_philox_core_is_tl_philox(seed):
    """dropout.philox_calls' own rounds (one wide multiply per product on the GPU) give tl.philox's
    Philox4x32-7 words bit for bit, on counters spanning the whole 32-bit range."""
    n = 256
    gen = torch.Generator().manual_seed(seed % 1000)
    rows, calls = (torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64)
                   .to(torch.int32).to(DEVICE) for _ in range(2))
    seed_lo, seed_hi, _, _, _ = dropout.dropout_args(0.5, seed)
    out = torch.empty(2, 4, n, dtype=torch.int32, device=DEVICE)
    _philox_pair_kernel[(1,)](out, rows.view(torch.uint32), calls.view(torch.uint32), seed_lo,
                              seed_hi, 2**31 - 7, 12345, N=n)
    assert torch.equal(out[0], out[1])


@triton.jit(do_not_specialize=["off_b", "threshold"])  # on the GPU an int 1 is a constexpr
def _transposed_keep_kernel(Out, seed_lo, seed_hi, off_b, off_h, threshold, start_n,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Out [BLOCK_N, BLOCK_M] int8: dropout_keep_t of rows [0, BLOCK_M), keys start_n + ..."""
    keep = dropout.dropout_keep_t(seed_lo, seed_hi, off_b, off_h, tl.arange(0, BLOCK_M),
                                  start_n, threshold, BLOCK_N)
    offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tl.store(Out + offs, keep.to(tl.int8))


@pytest.mark.parametrize("threshold", [0, 1, 77, 127, 128, 129, 200, 255, 256])
def test_packed_transposed_keep_equals_the_mask(threshold):
    """dropout_keep_t (packed decisions, compared four bytes at a time) is keep_mask's tile,
    transposed, for tiles of 8..256 keys at every offset in a 256-column span and thresholds
    at the bytes' edges (256: p rounds to 1, nothing kept)."""
    seed = 2**40 + 99
    seed_lo, seed_hi, _, _, _ = dropout.dropout_args(0.5, seed)
    draws = torch.from_numpy(philox_draws(seed, 2, 3, 16, 256)[1, 2].astype(np.int64))
    expected = (draws >= threshold).to(DEVICE)  # [16 rows, 256 keys] of batch 1, head 2
    for block_n in (8, 16, 32, 64, 128, 256):
        for start_n in range(0, 256, block_n):
            out = torch.empty(block_n, 16, dtype=torch.int8, device=DEVICE)
            _transposed_keep_kernel[(1,)](out, seed_lo, seed_hi, 1, 2, threshold, start_n,
                                          BLOCK_M=16, BLOCK_N=block_n)
            want = expected[:, start_n:start_n + block_n].T
            assert torch.equal(out.bool(), want), (block_n, start_n)


@triton.jit
def _bytes_ge_kernel(Out, Words, Thresholds, N_WORDS: tl.constexpr, N_T: tl.constexpr):
    """Out [N_T, N_WORDS] uint32: dropout.bytes_ge(word, threshold) for every pair."""
    t = tl.load(Thresholds + tl.arange(0, N_T))[:, None]
    words = tl.load(Words + tl.arange(0, N_WORDS))[None, :]
    offs = tl.arange(0, N_T)[:, None] * N_WORDS + tl.arange(0, N_WORDS)[None, :]
    tl.store(Out + offs, dropout.bytes_ge(words, t))


def test_bytes_ge_is_a_bytewise_compare():
    """bytes_ge's high bit of byte c says byte c >= threshold for every byte value (each at
    every position, beside neighbours that would borrow) and every threshold 0..256."""
    values = np.arange(256, dtype=np.uint32)
    words = values | np.roll(values, 1) << 8 | np.roll(values, 7) << 16 | (255 - values) << 24
    thresholds = np.arange(512, dtype=np.int32).clip(max=256)  # 257 thresholds, padded
    out = torch.empty(512, 256, dtype=torch.uint32, device=DEVICE)
    _bytes_ge_kernel[(1,)](out, torch.from_numpy(words.view(np.int32)).to(DEVICE),
                           torch.from_numpy(thresholds).to(DEVICE), N_WORDS=256, N_T=512)
    got = out.cpu().view(torch.int32).numpy().view(np.uint32)
    for c in range(4):
        byte = (words >> np.uint32(8 * c)) & np.uint32(0xFF)
        want = byte[None, :] >= thresholds[:, None]
        assert np.array_equal((got >> np.uint32(8 * c + 7)) & np.uint32(1) == 1, want), c


def quantized(p):
    """The drop probability the kernels realise: round(p * 256) / 256 (dropout.py)."""
    return round(p * 256) / 256


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_binomial_bounds(p):
    """Keep rate 1 - q within 5 sigma over 2**17 draws (q = p quantized to 1/256, the 8-bit
    draws), and heads draw independent streams: two heads agree on p^2 + (1-p)^2 of the
    elements, also within 5 sigma."""
    mask = dropout_keep_mask(2**40 + 17, 2, 2, 64, 512, p, backend="triton").cpu()
    n = mask.numel()
    assert abs(mask.float().mean().item() - (1 - quantized(p))) <= 5 * math.sqrt(p * (1 - p) / n)
    agree = (mask[:, 0] == mask[:, 1]).float().mean().item()
    expected = p * p + (1 - p) * (1 - p)
    assert abs(agree - expected) <= 5 * math.sqrt(expected * (1 - expected) / (n // 2))


def test_dropout_bitwise_reproducible_and_seeds_differ():
    """The same seed gives bitwise the same output and gradients; another seed (differing only
    above bit 32, too) another mask."""
    q, k, v = qkv(1, 33, 33, 2, 1, 16, torch.float32)
    dout = randn(1, 33, 2, 16)

    def run(seed):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(seed)
        out = flashkit.flash_attn_func(*leaves, dropout_p=0.4, causal=True, backend="triton")
        return (out, *torch.autograd.grad(out, leaves, dout))

    first, second, other = run(7), run(7), run(8)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])
    low = dropout_keep_mask(5, 1, 1, 16, 64, 0.5, backend="triton")
    high = dropout_keep_mask(5 + 2**40, 1, 1, 16, 64, 0.5, backend="triton")
    assert not torch.equal(low, high)


# ---- varlen -----------------------------------------------------------------------------------

# Lengths 0 and 1 inside one batch, seqlen_q != seqlen_k both ways per sequence.
LENGTHS_Q, LENGTHS_K = [5, 0, 1, 40, 17, 1, 3], [9, 3, 0, 33, 17, 1, 20]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_varlen_matches_oracle(feature, dtype):
    if dtype != torch.float32 and feature not in ("causal", "everything"):
        pytest.skip("fp16 and bf16 cover two features; the rest run in fp32 (CI time)")
    inputs = varlen_qkv(LENGTHS_Q, LENGTHS_K, 4, 2, 16, dtype)
    check_against_oracle(lambda **kw: api_attention(backend="triton", **kw),
                         {**inputs, **FEATURES[feature](len(LENGTHS_Q), 4)})


def test_varlen_equals_dense_per_sequence():
    """Each packed sequence gives bitwise what a dense call on it alone gives: out, lse and the
    gradients (MQA, causal, per-sequence ALiBi slopes, a sink)."""
    inputs = varlen_qkv(LENGTHS_Q, LENGTHS_K, 2, 1, 16, torch.float32)
    batch = len(LENGTHS_Q)
    features = dict(causal=True, alibi_slopes=alibi_slopes(2, batch=batch).to(DEVICE))
    sink = randn(2)
    leaves = {n: inputs[n].clone().requires_grad_() for n in "qkv"}
    out, lse, _ = flashkit.flash_attn_varlen_func(**{**inputs, **leaves}, **features, sink=sink,
                                                  return_attn_probs=True, backend="triton")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(leaves.values()), dout)
    cu_q, cu_k = inputs["cu_seqlens_q"].tolist(), inputs["cu_seqlens_k"].tolist()
    for b in range(batch):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        dense = [inputs[n][None, s].clone().requires_grad_()
                 for n, s in zip("qkv", (sq, sk, sk), strict=True)]
        o, l, _ = flashkit.flash_attn_func(*dense, causal=True,
                                           alibi_slopes=features["alibi_slopes"][b], sink=sink,
                                           return_attn_probs=True, backend="triton")
        dense_grads = torch.autograd.grad(o, dense, dout[None, sq])
        assert torch.equal(out[sq], o[0]) and torch.equal(lse[:, sq], l[0])
        for name, g, s, dg in zip("qkv", grads, (sq, sk, sk), dense_grads, strict=True):
            assert torch.equal(g[s], dg[0]), f"d{name} of sequence {b}"


def test_varlen_attention_probs():
    inputs = varlen_qkv([4, 0, 19], [7, 5, 19], 2, 2, 16, torch.float32)
    _, _, probs = flashkit.flash_attn_varlen_func(**inputs, causal=True, return_attn_probs=True,
                                                  backend="triton")
    as64 = {n: t.double() if torch.is_tensor(t) and t.is_floating_point() else t
            for n, t in inputs.items()}
    expected = oracle(**as64, causal=True, return_probs=True)[2]
    baseline = oracle(**inputs, causal=True, return_probs=True)[2]
    assert [tuple(p.shape) for p in probs] == [(2, 4, 7), (2, 0, 5), (2, 19, 19)]
    for b, (got, want, base) in enumerate(zip(probs, expected, baseline, strict=True)):
        assert_close_to_oracle(f"probs[{b}]", got, want, base)


# ---- malformed input: a clear error before any launch ------------------------------------------

def _varlen_args(**change):
    args = dict(varlen_qkv([3, 5], [4, 5], 2, 1, 16, torch.float32))
    args.update(change)
    return args


MALFORMED = {  # name -> (call, error type, message pattern)
    "cu_seqlens_not_int32": (lambda: _varlen_args(
        cu_seqlens_q=torch.tensor([0, 3, 8], device=DEVICE)), TypeError, "cu_seqlens_q.*int32"),
    "cu_seqlens_decreasing": (lambda: _varlen_args(
        cu_seqlens_k=torch.tensor([0, 6, 5, 9], dtype=torch.int32, device=DEVICE)),
        ValueError, "cu_seqlens_k"),
    "cu_seqlens_batch_mismatch": (lambda: _varlen_args(
        cu_seqlens_k=torch.tensor([0, 9], dtype=torch.int32, device=DEVICE), max_seqlen_k=9),
        ValueError, "cu_seqlens_k.*sequences"),
    "cu_seqlens_wrong_total": (lambda: _varlen_args(
        cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)),
        ValueError, "cu_seqlens_q: last entry 7"),
    "cu_seqlens_not_from_zero": (lambda: _varlen_args(
        cu_seqlens_q=torch.tensor([1, 3, 8], dtype=torch.int32, device=DEVICE)),
        ValueError, "cu_seqlens_q: expected 0 first"),
    "max_seqlen_too_small": (lambda: _varlen_args(max_seqlen_q=4), ValueError, "max_seqlen_q"),
    "alibi_wrong_shape": (lambda: _varlen_args(alibi_slopes=torch.rand(3, device=DEVICE)),
                          ValueError, "alibi_slopes: expected shape"),
    "window_below_minus_one": (lambda: _varlen_args(window_size=(-2, 0)), ValueError,
                               "window_size"),
    "dropout_one": (lambda: _varlen_args(dropout_p=1.0), ValueError, r"dropout_p.*\[0, 1\)"),
    "dropout_negative": (lambda: _varlen_args(dropout_p=-0.1), ValueError, "dropout_p"),
    "sink_wrong_shape": (lambda: _varlen_args(sink=torch.zeros(3, device=DEVICE)), ValueError,
                         r"sink: expected shape \(2,\)"),
    "sink_wrong_dtype": (lambda: _varlen_args(sink=torch.zeros(2, dtype=torch.int32,
                                                               device=DEVICE)),
                         TypeError, "sink: expected a floating dtype"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_input_raises_before_launch(case, monkeypatch):
    make, error, pattern = MALFORMED[case]

    def launched(*args, **kwargs):
        raise AssertionError("a kernel launched on malformed input")

    monkeypatch.setattr(triton_backend, "forward", launched)
    # sync_checks: CUDA cu_seqlens are otherwise checked by a device-side assertion, which
    # fails the call asynchronously (and the process's CUDA context with it), not by a
    # ValueError before the launch
    with pytest.raises(error, match=pattern):
        flashkit.flash_attn_varlen_func(**make(), backend="triton", sync_checks=True)


# ---- GPU: real sizes, bf16 (skipped without CUDA) ----------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("feature", ["plain", "causal", "everything"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_dropout(feature, head_dim, dtype):
    batch, nheads, seqlen_q, seqlen_k, p = 2, 4, 1000, 1023, 0.17
    q, k, v = qkv(batch, seqlen_q, seqlen_k, nheads, 2, head_dim, dtype)
    inputs = dict(q=q, k=k, v=v, dropout_p=p, **FEATURES[feature](batch, nheads))
    mask = dropout_keep_mask(call_seed(), batch, nheads, seqlen_q, seqlen_k, p, backend="triton")
    check_against_oracle(triton_call, inputs, output_names=("out", "lse", "probs"),
                         oracle_fn=lambda **kw: oracle(**kw, dropout_mask=mask,
                                                       return_probs=True))


@pytest.mark.gpu
def test_gpu_keep_rate_large():
    """2**26 draws at real offsets (seqlen 8k): the rate within 5 sigma of the quantized 1 - p
    (that fine, the quantization itself shows: 26/256 = 0.1016 is 30 sigma from 0.1)."""
    p = 0.1
    mask = dropout_keep_mask(2**60 + 3, 2, 4, 8192, 1024, p, backend="triton")
    n = mask.numel()
    assert abs(mask.float().mean().item() - (1 - quantized(p))) <= 5 * math.sqrt(p * (1 - p) / n)


GPU_LENGTHS_Q = [1000, 0, 1, 517, 2048, 3, 300]
GPU_LENGTHS_K = [1000, 7, 0, 1031, 2048, 3, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_varlen(feature, head_dim, dtype):
    inputs = varlen_qkv(GPU_LENGTHS_Q, GPU_LENGTHS_K, 8, 2, head_dim, dtype)
    check_against_oracle(lambda **kw: api_attention(backend="triton", **kw),
                         {**inputs, **FEATURES[feature](len(GPU_LENGTHS_Q), 8)})


@pytest.mark.gpu
def test_gpu_varlen_dropout():
    nheads, p = 8, 0.2
    inputs = varlen_qkv(GPU_LENGTHS_Q, GPU_LENGTHS_K, nheads, 2, 128, torch.bfloat16)
    inputs.update(dropout_p=p, **FEATURES["everything"](len(GPU_LENGTHS_Q), nheads))
    mask = dropout_keep_mask(call_seed(), len(GPU_LENGTHS_Q), nheads, 2048, 2048, p,
                             backend="triton")
    check_against_oracle(lambda **kw: triton_call(**kw)[:2], inputs,
                         oracle_fn=lambda **kw: oracle(**kw, dropout_mask=mask))
