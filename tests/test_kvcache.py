"""flash_attn_with_kvcache against the float64 oracle on each sequence's gathered keys.

Each case builds a "logical" cache per sequence (capacity slots), lays it out contiguously (rows
permuted through cache_batch_idx) or in shuffled pages, appends new keys at ragged lengths and
checks (1) out and lse against flashkit.reference by the docs/design.md section 5 rule, (2) that the
cache holds exactly the new (rotated) keys at their slots and that nothing else changed.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashkit import checks, kvcache, reference
from flashkit.kvcache import flash_attn_with_kvcache
from flashkit.ops.params import AttentionParams
from flashkit.testing import assert_close_to_oracle, poison

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The Triton tests on CPU tensors run in the interpreter; the `gpu` ones run the compiled
# kernels on CUDA copies of the same cases (bf16, d128, the Hopper tiles).
interpreted = pytest.mark.skipif(not INTERPRET, reason="CPU tensors: needs TRITON_INTERPRET=1")


@pytest.fixture(params=["key_tiles", "key_subtiles"])
def decode_loop(request, monkeypatch):
    """Run a Triton test on each loop of the decode kernel, whatever the split lengths, pages,
    rotary and programs per SM: _key_tiles (subtiles 1) and _key_subtiles (the tile's
    sub-tiles everywhere)."""
    from flashkit.ops.triton import decode

    if request.param == "key_subtiles":
        monkeypatch.setattr(decode, "CAP_LIFT_PER_SM", 1 << 30)
    for table in (decode.DECODE_INTERPRETER, decode.DECODE_SM90):
        tile = table["decode"]
        monkeypatch.setitem(table, "decode", tile._replace(subtiles=1) if request.param ==
                            "key_tiles" else tile._replace(subtiled_from=0))


def rotate_half_reference(x, cos, sin, positions, interleaved):
    """flash-attn's apply_rotary_emb_torch: x * cos + rotate_half(x) * sin on the first dims."""
    ro = 2 * cos.shape[1]
    c, s = cos[positions][:, :, None], sin[positions][:, :, None]  # (b, n, 1, ro / 2)
    if interleaved:
        c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
        x1, x2 = x[..., 0:ro:2], x[..., 1:ro:2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
        x1, x2 = x[..., :ro // 2], x[..., ro // 2:ro]
        rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x[..., :ro] * c.to(x.dtype) + rotated * s.to(x.dtype), x[..., ro:]), -1)


class Case:
    """Inputs of one call, their logical per-sequence caches, and the expected results."""

    def __init__(self, *, batch=3, seqlen_q=1, seqlen_new=1, nheads=4, nheads_k=2, d=32,
                 capacity=64, page_size=None, rotary=None, causal=False, window=(-1, -1),
                 dtype=torch.float32, leftpad=False, seqlens=None, **extra):
        self.dtype, self.causal, self.window, self.extra = dtype, causal, window, extra
        self.seqlen_new = seqlen_new
        rand = lambda *shape: torch.randn(*shape, dtype=dtype)  # noqa: E731
        self.q = rand(batch, seqlen_q, nheads, d)
        self.k_new = rand(batch, seqlen_new, nheads_k, d) if seqlen_new else None
        self.v_new = rand(batch, seqlen_new, nheads_k, d) if seqlen_new else None
        logical_k, logical_v = rand(batch, capacity, nheads_k, d), rand(batch, capacity,
                                                                        nheads_k, d)
        if seqlens is None:  # ragged, one empty cache, one filled to the brim
            seqlens = torch.randint(0, capacity - seqlen_new + 1, (batch,))
            seqlens[0], seqlens[-1] = 0, capacity - seqlen_new
        self.seqlens = torch.as_tensor(seqlens, dtype=torch.int32)
        self.leftpad = None
        if leftpad:
            self.leftpad = (torch.rand(batch) * (self.seqlens + 1)).to(torch.int32)
        self.cos = self.sin = None
        self.interleaved = rotary == "interleaved"
        if rotary:
            angles = torch.rand(capacity + seqlen_q, d // 4, dtype=torch.float64) * 2 * math.pi
            self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)
        self.page_size = page_size
        if page_size is None:  # rows in a shuffled order, plus one spare row
            self.batch_idx = torch.randperm(batch + 1)[:batch].to(torch.int32)
            self.k_cache = rand(batch + 1, capacity, nheads_k, d)
            self.v_cache = rand(batch + 1, capacity, nheads_k, d)
            self.k_cache[self.batch_idx.long()] = logical_k
            self.v_cache[self.batch_idx.long()] = logical_v
            self.block_table = None
        else:  # shuffled pages, two spare ones
            pages = capacity // page_size
            perm = torch.randperm(batch * pages + 2)
            self.block_table = perm[:batch * pages].reshape(batch, pages).to(torch.int32)
            self.batch_idx = None
            self.k_cache = rand(batch * pages + 2, page_size, nheads_k, d)
            self.v_cache = rand(batch * pages + 2, page_size, nheads_k, d)
            self.k_cache[self.block_table.long()] = logical_k.unflatten(1, (pages, page_size))
            self.v_cache[self.block_table.long()] = logical_v.unflatten(1, (pages, page_size))

    def logical(self, cache):
        """(batch, capacity, hk, d): each sequence's slots, read back through the layout."""
        if self.block_table is None:
            return cache[self.batch_idx.long()]
        pages = self.block_table.long().clamp(0, cache.shape[0] - 1)  # padding: never read
        return cache[pages].flatten(1, 2)

    def call(self, backend, device="cpu", **kw):
        """(out, lse) on the CPU from a call on `device` (on copies of the inputs there; the
        caches' new contents are copied back)."""
        on = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        kw = {"causal": self.causal, "window_size": self.window, "cache_seqlens": self.seqlens,
              "cache_batch_idx": self.batch_idx, "cache_leftpad": self.leftpad,
              "block_table": self.block_table, **self.extra, **kw}
        k_cache, v_cache = on(self.k_cache), on(self.v_cache)
        out, lse = flash_attn_with_kvcache(
            on(self.q), k_cache, v_cache, on(self.k_new), on(self.v_new), on(self.cos),
            on(self.sin), rotary_interleaved=self.interleaved, return_softmax_lse=True,
            backend=backend, **{name: on(value) for name, value in kw.items()})
        self.k_cache.copy_(k_cache)
        self.v_cache.copy_(v_cache)
        return out.cpu(), lse.cpu()

    def expected(self, dtype):
        """(out, lse, new keys) of the materialised computation in `dtype` on the logical cache,
        taken before the call (the caches are mutated by it)."""
        batch, seqlen_q = self.q.shape[:2]
        first = self.seqlens.long()  # rotary positions are absolute slots (flash-attn)
        q, k_new = self.q.to(dtype), None
        if self.k_new is not None:
            k_new = self.k_new.to(dtype)
        if self.cos is not None:
            cos, sin = self.cos.to(dtype), self.sin.to(dtype)
            local = self.causal or tuple(self.window) != (-1, -1)
            q_pos = first[:, None] + (torch.arange(seqlen_q) if local else 0)
            q_pos = q_pos.expand(batch, seqlen_q)
            q = rotate_half_reference(q, cos, sin, q_pos, self.interleaved)
            k_pos = first[:, None] + torch.arange(self.seqlen_new)
            k_new = rotate_half_reference(k_new, cos, sin, k_pos, self.interleaved)
        logical_k, logical_v = (self.logical(c).to(dtype) for c in (self.k_cache, self.v_cache))
        outs, lses = [], []
        for b in range(batch):
            start = 0 if self.leftpad is None else int(self.leftpad[b])
            n = int(self.seqlens[b])
            parts_k, parts_v = [logical_k[b, start:n]], [logical_v[b, start:n]]
            if k_new is not None:
                parts_k.append(k_new[b])
                parts_v.append(self.v_new[b].to(dtype))
            extra = dict(self.extra)
            extra.pop("num_splits", None)
            slopes = extra.pop("alibi_slopes", None)
            if slopes is not None:
                slopes = slopes[b] if slopes.dim() == 2 else slopes
            sink = extra.pop("sink", None)
            sink = None if sink is None else sink.to(dtype)
            keys, values = torch.cat(parts_k)[None], torch.cat(parts_v)[None]
            if keys.shape[1] == 0:  # no key at all: out 0, lse = the sink's logit or -inf
                out = torch.zeros_like(q[b:b + 1])
                lse = torch.full((1, q.shape[2], seqlen_q), -math.inf, dtype=dtype)
                if sink is not None:
                    lse[:] = sink[None, :, None]
            else:
                out, lse = reference.attention(q[b:b + 1], keys, values, causal=self.causal,
                                               window_size=self.window, alibi_slopes=slopes,
                                               sink=sink, **extra)
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses), k_new

    def check(self, backend, device="cpu", **kw):
        k_before, v_before = self.k_cache.clone(), self.v_cache.clone()
        oracle_out, oracle_lse, k_rot64 = self.expected(torch.float64)
        base_out, base_lse, _ = self.expected(self.dtype)
        out, lse = self.call(backend, device, **kw)
        assert_close_to_oracle("out", out, oracle_out, base_out)
        assert_close_to_oracle("lse", lse, oracle_lse, base_lse)
        self.check_append(k_before, v_before, k_rot64)

    def check_append(self, k_before, v_before, k_rot64):
        """The new slots hold the new (rotated) values; every other element is unchanged."""
        written = torch.zeros(self.k_cache.shape[:2], dtype=torch.bool)
        if self.k_new is not None:
            for b in range(self.q.shape[0]):
                for p in range(int(self.seqlens[b]), int(self.seqlens[b]) + self.seqlen_new):
                    row, slot = (int(self.batch_idx[b]), p) if self.block_table is None else (
                        int(self.block_table[b, p // self.page_size]), p % self.page_size)
                    written[row, slot] = True
                    t = p - int(self.seqlens[b])
                    assert torch.equal(self.v_cache[row, slot], self.v_new[b, t])
                    k_expected = k_rot64[b, t].to(self.dtype)
                    if self.cos is None:
                        assert torch.equal(self.k_cache[row, slot], k_expected)
                    else:  # rotated in float32 by the module: within one rounding of float64
                        torch.testing.assert_close(self.k_cache[row, slot], k_expected)
        assert torch.equal(self.k_cache[~written], k_before[~written])
        assert torch.equal(self.v_cache[~written], v_before[~written])


MASKS = {"full": {}, "causal": {"causal": True}, "window": {"window": (5, 2)}}
LAYOUTS = {"contiguous": None, "paged16": 16, "paged32": 32}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
@pytest.mark.parametrize("nheads_k", [1, 2, 4])
@pytest.mark.parametrize("mask", list(MASKS))
def test_torch_backend_matches_oracle(layout, num_splits, rotary, nheads_k, mask):
    Case(page_size=LAYOUTS[layout], rotary=rotary, nheads_k=nheads_k, num_splits=num_splits,
         **MASKS[mask]).check("torch")


@pytest.mark.parametrize("seqlen_q, seqlen_new", [(1, 0), (1, 1), (3, 3), (5, 2), (2, 7)])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_query_and_append_lengths(seqlen_q, seqlen_new, mask, layout):
    Case(seqlen_q=seqlen_q, seqlen_new=seqlen_new, page_size=LAYOUTS[layout], num_splits=3,
         **MASKS[mask]).check("torch")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtypes(dtype):
    Case(dtype=dtype, seqlen_q=2, seqlen_new=2, rotary="neox", causal=True,
         num_splits=2).check("torch")


@pytest.mark.parametrize("feature", ["softcap", "alibi", "alibi_batch", "sink", "leftpad",
                                     "scale", "headdim_40"])
def test_features(feature):
    nheads, batch = 4, 3
    kw = {"softcap": {"softcap": 3.0},
          "alibi": {"alibi_slopes": torch.rand(nheads)},
          "alibi_batch": {"alibi_slopes": torch.rand(batch, nheads)},
          "sink": {"sink": torch.randn(nheads)},
          "leftpad": {"leftpad": True, "rotary": "interleaved"},
          "scale": {"softmax_scale": 0.3},
          "headdim_40": {"d": 40, "rotary": "neox"}}[feature]
    for mask in MASKS.values():
        Case(batch=batch, nheads=nheads, seqlen_q=2, seqlen_new=2, num_splits=3, **kw,
             **mask).check("torch")


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(1, 3), nheads_k=st.sampled_from([1, 2]), group=st.integers(1, 3),
       d=st.sampled_from([8, 16, 24]), pages=st.integers(1, 4), page_size=st.sampled_from(
           [None, 16, 32]), seqlen_q=st.integers(1, 4), seqlen_new=st.integers(0, 4),
       num_splits=st.integers(1, 5), mask=st.sampled_from(list(MASKS)),
       rotary=st.sampled_from([None, "interleaved", "neox"]))
def test_random_configurations(batch, nheads_k, group, d, pages, page_size, seqlen_q,
                               seqlen_new, num_splits, mask, rotary):
    if rotary and not seqlen_new:
        rotary = None  # the rotary embedding needs new keys (tested in test_errors)
    Case(batch=batch, nheads=nheads_k * group, nheads_k=nheads_k, d=d, capacity=32 * pages,
         page_size=page_size, seqlen_q=seqlen_q, seqlen_new=seqlen_new, num_splits=num_splits,
         rotary=rotary, **MASKS[mask]).check("torch")


def test_none_seqlens_means_a_full_cache():
    case = Case(seqlens=[64, 64, 64], seqlen_new=0)
    out = flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache,
                                  cache_batch_idx=case.batch_idx)
    torch.testing.assert_close(out, case.call("reference")[0])


def test_reference_backend_and_int_seqlens():
    case = Case(seqlens=[9, 9, 9], causal=True)
    case.check("reference")
    out = flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, cache_seqlens=10,
                                  cache_batch_idx=case.batch_idx, causal=True)
    expected = flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache,
                                       cache_seqlens=torch.full((3,), 10, dtype=torch.int32),
                                       cache_batch_idx=case.batch_idx, causal=True,
                                       backend="reference")
    torch.testing.assert_close(out, expected)


def test_any_page_size_from_16():
    Case(page_size=24, capacity=72, seqlen_q=2, seqlen_new=2, causal=True,
         num_splits=2).check("torch")


def test_unused_block_table_entries_are_never_read():
    case = Case(page_size=16, seqlens=[3, 20, 0], capacity=64)
    case.block_table[0, 1:] = -1  # pages past a sequence's length may be padding
    case.block_table[2, 1:] = 10**6
    case.check("torch")


def test_decoding_loop_matches_one_prefill():
    """Appending one token at a time and attending gives what one causal pass over all gives."""
    batch, steps, h, d = 2, 6, 4, 16
    q, k, v = (torch.randn(batch, steps, h, d, dtype=torch.float64) for _ in range(3))
    k_cache = torch.zeros(4, 16, h, d, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    block_table = torch.tensor([[2], [0]], dtype=torch.int32)
    outs = [flash_attn_with_kvcache(q[:, t:t + 1], k_cache, v_cache, k[:, t:t + 1],
                                    v[:, t:t + 1], cache_seqlens=t, block_table=block_table,
                                    causal=True, num_splits=2)
            for t in range(steps)]
    expected, _ = reference.attention(q, k, v, causal=True)
    torch.testing.assert_close(torch.cat(outs, 1), expected)


# --- errors: each names the argument, and nothing is read or written out of bounds ---------

def _inputs(page_size=None):
    q = torch.randn(2, 1, 4, 16)
    if page_size is None:
        cache = torch.randn(3, 32, 2, 16)
        table = None
    else:
        cache = torch.randn(4, page_size, 2, 16)
        table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    new = torch.randn(2, 1, 2, 16)
    return q, cache, cache.clone(), new, new.clone(), table


def _call(q, kc, vc, k=None, v=None, **kw):
    return flash_attn_with_kvcache(q, kc, vc, k, v, **kw)


@pytest.mark.parametrize("case, match", [
    ("block_table_out_of_range", "block_table"),
    ("block_table_negative", "block_table"),
    ("block_table_int64", "block_table"),
    ("block_table_rows", "block_table"),
    ("seqlens_beyond_capacity", "cache_seqlens"),
    ("seqlens_beyond_after_append", "cache_seqlens"),
    ("seqlens_negative", "cache_seqlens"),
    ("seqlens_int64", "cache_seqlens"),
    ("paged_seqlens_beyond", "cache_seqlens"),
    ("page_size_8", "page_size"),
    ("batch_idx_out_of_range", "cache_batch_idx"),
    ("batch_idx_paged", "cache_batch_idx"),
    ("leftpad_beyond_seqlens", "cache_leftpad"),
    ("k_shape", "k:"),
    ("k_without_v", "k, v"),
    ("v_cache_shape", "v_cache"),
    ("headdim", "head dim"),
    ("heads", "nheads_k"),
    ("rotary_without_k", "rotary_cos"),
    ("rotary_too_short", "rotary_cos"),
    ("rotary_sin_missing", "rotary_sin"),
    ("num_splits", "num_splits"),
    ("dtype", "dtype"),
])
@pytest.mark.parametrize("after_accepted", [False, True], ids=["first", "after_accepted"])
def test_errors(case, match, after_accepted, monkeypatch):
    """Each bad argument is refused, on a first call and after an accepted call of the same
    shapes (whose checks are kept: the index values are still read every call, and a tensor
    that differs in a kept fact is checked again)."""
    monkeypatch.setattr(kvcache, "_KEPT_CALLS", {})
    paged = case.startswith(("block_table", "paged", "page_size", "batch_idx_paged"))
    q, kc, vc, k, v, table = _inputs(page_size=16 if paged else None)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    kw = {"cache_seqlens": lens, "block_table": table}
    args = (q, kc, vc, k, v)
    if after_accepted:
        _call(q, kc.clone(), vc.clone(), k, v, **kw)
        assert len(kvcache._KEPT_CALLS) == 1
    if case == "block_table_out_of_range":
        table[1, 0] = 4
    elif case == "block_table_negative":
        table[0, 0] = -1
    elif case == "block_table_int64":
        kw["block_table"] = table.long()
    elif case == "block_table_rows":
        kw["block_table"] = table[:1]
    elif case == "seqlens_beyond_capacity":
        kw["cache_seqlens"] = torch.tensor([3, 33], dtype=torch.int32)
        args = (q, kc, vc)
    elif case == "seqlens_beyond_after_append":
        kw["cache_seqlens"] = torch.tensor([3, 32], dtype=torch.int32)
    elif case == "seqlens_negative":
        kw["cache_seqlens"] = torch.tensor([-1, 2], dtype=torch.int32)
    elif case == "seqlens_int64":
        kw["cache_seqlens"] = lens.long()
    elif case == "paged_seqlens_beyond":
        kw["cache_seqlens"] = 32  # 2 pages of 16: full, so the append overflows
    elif case == "page_size_8":
        q, kc, vc, k, v, table = _inputs(page_size=8)
        args, kw["block_table"] = (q, kc, vc, k, v), table
    elif case == "batch_idx_out_of_range":
        kw["cache_batch_idx"] = torch.tensor([0, 3], dtype=torch.int32)
    elif case == "batch_idx_paged":
        kw["cache_batch_idx"] = torch.tensor([0, 1], dtype=torch.int32)
    elif case == "leftpad_beyond_seqlens":
        kw["cache_leftpad"] = torch.tensor([4, 0], dtype=torch.int32)
    elif case == "k_shape":
        args = (q, kc, vc, k[:, :, :1], v)
    elif case == "k_without_v":
        args = (q, kc, vc, k, None)
    elif case == "v_cache_shape":
        args = (q, kc, vc[:, :16], k, v)
    elif case == "headdim":
        args = (q[..., :8], kc, vc, k, v)
    elif case == "heads":
        args = (q[:, :, :3], kc, vc, k, v)
    elif case == "rotary_without_k":
        args = (q, kc, vc)
        kw.update(rotary_cos=torch.ones(64, 4), rotary_sin=torch.zeros(64, 4))
    elif case == "rotary_too_short":
        kw.update(rotary_cos=torch.ones(5, 4), rotary_sin=torch.zeros(5, 4))
    elif case == "rotary_sin_missing":
        kw.update(rotary_cos=torch.ones(64, 4))
    elif case == "num_splits":
        kw["num_splits"] = -1
    elif case == "dtype":
        args = (q, kc.double(), vc, k, v)
    kc_before = args[1].clone()
    with pytest.raises((ValueError, TypeError), match=match):
        _call(*args, **kw)
    assert torch.equal(args[1], kc_before), "a rejected call must not write the cache"


def test_requires_grad_is_refused():
    q, kc, vc, k, v, _ = _inputs()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="no backward"):
        _call(q.requires_grad_(), kc, vc, k, v, cache_seqlens=3)
    for _ in range(2):  # accepted (and kept) under no_grad, refused again with grad on
        with torch.no_grad():
            _call(q, kc, vc, k, v, cache_seqlens=lens)
        with pytest.raises(NotImplementedError, match="no backward"):
            _call(q, kc, vc, k, v, cache_seqlens=lens)


def test_kept_calls_skip_the_checks_and_match(monkeypatch):
    """An equal call (same tensors' facts and scalars) skips the argument checks and gives the
    first call's result; a call with the caches aliased, or strided so their slots overlap,
    is checked (and refused) again."""
    monkeypatch.setattr(kvcache, "_KEPT_CALLS", {})
    q, kc, vc, k, v, _ = _inputs()
    lens = torch.tensor([3, 5], dtype=torch.int32)
    caches = [(kc.clone(), vc.clone()) for _ in range(2)]
    first = _call(q, *caches[0], k, v, cache_seqlens=lens, causal=True)
    calls = []
    monkeypatch.setattr(checks, "kvcache_tensors", lambda *a: calls.append(a))
    again = _call(q, *caches[1], k, v, cache_seqlens=lens, causal=True)
    assert calls == [] and torch.equal(first, again)
    assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1], strict=True))
    monkeypatch.undo()
    monkeypatch.setattr(kvcache, "_KEPT_CALLS", {0: 0})  # anything kept so far is gone
    _call(q, kc, vc, k, v, cache_seqlens=lens, causal=True)
    with pytest.raises(ValueError, match="^v_cache: is the same memory as k_cache"):
        _call(q, kc, kc, k, v, cache_seqlens=lens, causal=True)
    overlapping = kc[:1].expand(3, -1, -1, -1)
    with pytest.raises(ValueError, match="^k_cache: is written in place but its elements"):
        _call(q, overlapping, vc, k, v, cache_seqlens=lens, causal=True)


def test_poisoned_spare_cache_does_not_leak():
    """NaN in every slot outside the valid keys never reaches the output."""
    case = Case(page_size=16, seqlen_q=2, seqlen_new=2, causal=True, num_splits=3)
    valid = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool)
    for b in range(3):
        for p in range(int(case.seqlens[b])):
            valid[case.block_table[b, p // 16], p % 16] = True
    case.k_cache[~valid] = float("nan")
    case.v_cache[~valid] = float("nan")
    out, lse = case.call("torch")
    assert not out.isnan().any() and not lse.isnan().any()


# --- the Triton kernels (interpreted on CPU) ----------------------------------------------------

def _combos():
    """Every layout x mask x rotary once, cycling splits 1, 2, 3, 8 and kv heads 1, 2, 4."""
    for n, (layout, mask, rotary) in enumerate(itertools.product(
            LAYOUTS, MASKS, [None, "interleaved", "neox"])):
        yield layout, mask, rotary, [1, 2, 3, 8][n % 4], [1, 2, 4][n % 3]


@interpreted
@pytest.mark.parametrize("layout, mask, rotary, num_splits, nheads_k", list(_combos()))
@pytest.mark.usefixtures("decode_loop")
def test_triton_matches_oracle(layout, mask, rotary, num_splits, nheads_k):
    Case(page_size=LAYOUTS[layout], rotary=rotary, nheads_k=nheads_k, num_splits=num_splits,
         d=16, capacity=64, **MASKS[mask]).check("triton")


@interpreted
@pytest.mark.parametrize("feature", ["softcap", "alibi_batch", "sink", "leftpad", "prefill",
                                     "fp16", "bf16", "headdim_40", "auto_splits", "page24"])
@pytest.mark.usefixtures("decode_loop")
def test_triton_features(feature):
    kw = {"softcap": {"softcap": 3.0, "num_splits": 3},
          "alibi_batch": {"alibi_slopes": torch.rand(3, 4), "num_splits": 2},
          "sink": {"sink": torch.randn(4), "num_splits": 3},
          "leftpad": {"leftpad": True, "rotary": "neox", "num_splits": 2},
          "prefill": {"seqlen_q": 9, "seqlen_new": 9, "nheads_k": 1, "num_splits": 2},
          "fp16": {"dtype": torch.float16, "num_splits": 2, "page_size": 16},
          "bf16": {"dtype": torch.bfloat16, "num_splits": 3, "rotary": "neox"},
          "headdim_40": {"d": 40, "rotary": "interleaved"},
          "auto_splits": {"num_splits": 0, "page_size": 16},
          "page24": {"page_size": 24, "num_splits": 2}}[feature]
    kw = {"d": 16, "capacity": 48, "seqlen_q": 2, "seqlen_new": 2, **kw}
    for mask in ("causal", "window"):
        Case(**kw, **MASKS[mask]).check("triton")


@interpreted
@pytest.mark.parametrize("per_tile", [True, False])
def test_triton_page_lookup_per_tile_and_per_row(per_tile, monkeypatch):
    """Pages a multiple of the 32-key tile: the block-table entry read once per key tile
    (decode.PAGE_TILE_LOOKUP) or per key row."""
    from flashkit.ops.triton import decode

    monkeypatch.setattr(decode, "PAGE_TILE_LOOKUP", per_tile)
    for mask in ("causal", "window"):
        Case(page_size=64, capacity=128, d=16, seqlen_q=2, seqlen_new=2, num_splits=3,
             **MASKS[mask]).check("triton")


@interpreted
def test_triton_refuses_float64_before_touching_the_cache():
    case = Case(dtype=torch.float64)
    k_before = case.k_cache.clone()
    with pytest.raises(NotImplementedError, match="float64"):
        case.call("triton")
    assert torch.equal(case.k_cache, k_before)


@interpreted
@pytest.mark.parametrize("shape", [(1, 1, 32, 128), (3, 2, 4, 16), (2, 5, 3, 24)])
@pytest.mark.parametrize("num_splits", [1, 2, 7])
def test_partials_tile_their_buffer(shape, num_splits):
    """decode.Partials: with splits, out_part (S, b, sq, h, dv) and lse_part (S, b, h, sq), read
    through their strides and lse_part's offset, cover one float32 buffer exactly once; with one
    split they are out and lse themselves, the split stride 0."""
    from flashkit.ops.triton import decode

    batch, seqlen_q, nheads, head_dim_v = shape
    out = torch.randn(shape).to(torch.bfloat16)
    lse = torch.randn(batch, nheads, seqlen_q)
    parts = decode.Partials.of(out, lse, num_splits)
    out_part = parts.out.as_strided((num_splits, *shape), parts.out_strides)
    lse_part = parts.lse.as_strided((num_splits, batch, nheads, seqlen_q), parts.lse_strides,
                                    parts.lse_offset)
    if num_splits == 1:
        assert parts.out is out and parts.lse is lse and parts.lse_offset == 0
        assert torch.equal(out_part[0], out) and torch.equal(lse_part[0], lse)
        return
    assert parts.out is parts.lse and parts.out.dtype == torch.float32
    buffer = parts.out
    buffer.fill_(0)
    out_part += 1  # each element once: every slot ends at exactly 1
    lse_part += 1
    assert buffer.numel() == out_part.numel() + lse_part.numel()
    assert torch.equal(buffer, torch.ones_like(buffer))


@interpreted
@pytest.mark.usefixtures("decode_loop")
def test_triton_writes_every_output_element():
    """Poisoned out/lse buffers: any row the kernels skip stays NaN and fails."""
    from flashkit.ops.triton import decode

    case = Case(page_size=16, capacity=48, d=16, seqlen_q=2, seqlen_new=0, causal=True)
    zeros = torch.zeros(3, dtype=torch.int32)
    params = AttentionParams(softmax_scale=0.25, window_right=0)
    for num_splits in (1, 4):
        out, lse = poison(torch.empty(3, 2, 4, 16)), poison(torch.empty(3, 4, 2))
        decode.forward(case.q, case.k_cache, case.v_cache, case.seqlens, zeros, zeros,
                       case.block_table, params, num_splits, out=out, lse=lse)
        assert not out.isnan().any() and not lse.isnan().any()


def check_split_counts(device, splits, **kw):
    """A step without new keys (the same call twice has the same result) at forced split
    counts, each call made twice and checked against the oracle: the split partials and their
    merge leave no state behind between calls."""
    for num_splits in splits:
        case = Case(seqlen_new=0, num_splits=num_splits, **kw)
        for _ in range(2):
            case.check("triton", device)


@interpreted
@pytest.mark.usefixtures("decode_loop")
def test_triton_split_counts_twice():
    """96 keys in 32-key tiles: 2 and 3 splits share them, 7 leave splits empty."""
    check_split_counts("cpu", (2, 3, 7), d=16, capacity=96, seqlen_q=2, nheads=8, nheads_k=2,
                       page_size=16, causal=True)


# Auto num_splits on the H200's tile and 132 SMs, q length 1, 32 query heads, d128: (batch, cache
# length, kv heads) -> (splits, key sub-tiles). One-tile splits at short caches, one program per
# SM where two would cut the keys into splits of under SHORT_SPLIT_TILES tiles, two per SM for
# long splits, none from 0.8 x 132 programs (b4 MHA, b32 GQA: 128), whole rounds of resident
# programs between one and two rounds (b16 MHA: 512 programs, 396 places) in splits of at least
# round_split_tiles = 16 tiles (none at 1k keys); sub-tiles only for splits of at least 4 key tiles.
H200_AUTO_SPLITS = {(1, 1024, 4): (16, 1), (1, 4096, 4): (32, 1), (1, 16384, 4): (32, 4),
                    (1, 65536, 4): (31, 4), (4, 1024, 4): (8, 1), (4, 4096, 4): (8, 4),
                    (4, 16384, 4): (8, 4), (16, 16384, 4): (4, 4), (1, 1024, 32): (4, 4),
                    (1, 16384, 32): (8, 4), (3, 4096, 32): (4, 4), (4, 4096, 32): (1, 4),
                    (32, 4096, 4): (1, 4), (16, 1024, 32): (1, 4), (16, 2048, 32): (2, 4),
                    (16, 4096, 32): (3, 4), (8, 16384, 32): (1, 4), (64, 1024, 32): (1, 4)}


def test_auto_num_splits_on_the_h200_tile(monkeypatch):
    from flashkit.ops.triton import decode

    monkeypatch.setattr(decode, "interpreting", lambda: False)
    monkeypatch.setattr(decode, "_launch_facts", lambda device: (132, True))
    for (batch, seqlen_k, nheads_k), expected in H200_AUTO_SPLITS.items():
        q = torch.empty(batch, 1, 32, 128, device="meta")
        tile, _, _, splits = decode.launch_shape(q, nheads_k, 0, 0, seqlen_k)
        assert (splits, tile.subtiles) == expected, (batch, seqlen_k, nheads_k, splits)
        assert splits <= min(decode.MAX_SPLITS, -(-seqlen_k // tile.block_n))
    # The prefill tile (128 queries of 8 heads per kv head, 160 programs) splits for whole
    # rounds at any length: the decode tile's round_split_tiles is not its rule
    q = torch.empty(5, 128, 32, 128, device="meta")
    assert [decode.launch_shape(q, 4, 0, 0, n)[3] for n in (1024, 4096)] == [4, 4]
    # Explicit splits: the same rule; an unknown length keeps the sub-tiles
    q = torch.empty(1, 1, 32, 128, device="meta")
    assert decode.launch_shape(q, 4, 0, 2, 512)[0].subtiles == 4
    assert decode.launch_shape(q, 4, 0, 3, 512)[0].subtiles == 1
    assert decode.launch_shape(q, 4, 0, 3, None)[0].subtiles == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's tile table")
def test_a_tile_out_of_shared_memory_shrinks_and_is_remembered(monkeypatch):
    """A launch that runs out of shared memory (a float32 d64 paged prefill tile asked sm_90 for
    289 KiB) runs again with fewer stages, then fewer keys per tile; the tile that ran is kept
    for the next call, which launches it at once; the result is the oracle's."""
    from triton.runtime.errors import OutOfResources

    from flashkit.ops.triton import decode
    from flashkit.ops.triton import launch as launch_module

    monkeypatch.setattr(decode, "_fitted", {})
    launch, shapes = launch_module.launch, []

    def small_memory(kernel, grid, tensors, scalars, constexprs, *args, **options):
        if kernel is decode._decode_kernel:
            shapes.append((constexprs["BLOCK_N"], options["num_stages"]))
            if constexprs["BLOCK_N"] * options["num_stages"] > 32:  # 16 keys in 2 stages fit
                raise OutOfResources(1 << 20, 1 << 18, "shared memory")
        return launch(kernel, grid, tensors, scalars, constexprs, *args, **options)

    monkeypatch.setattr(launch_module, "launch", small_memory)
    case = Case(batch=2, nheads=4, nheads_k=2, d=16, capacity=48, seqlen_q=3, seqlen_new=0,
                page_size=16, causal=True, num_splits=1)
    case.check("triton", "cpu")
    tile = decode.DECODE_INTERPRETER["decode"]
    assert shapes[0] == (tile.block_n, tile.num_stages + decode.PAGED_EXTRA_STAGES)
    assert shapes[-1] == (16, 2) and len(set(shapes)) == len(shapes)
    tried = len(shapes)
    case.check("triton", "cpu")
    assert shapes[tried:] == [(16, 2)]
    with pytest.raises(OutOfResources):
        decode.smaller_tile(tile._replace(block_n=16, num_stages=2))


def test_spill_free_lifts_the_register_cap_or_drops_the_subtiles(monkeypatch):
    """A build that spills under the 168-register cap (3 programs per SM) runs uncapped on
    launches of up to 2 programs per SM and without sub-tiles on larger ones; others keep the
    cap, and a tile without sub-tiles keeps what it has."""
    from flashkit.ops.triton import decode

    monkeypatch.setattr(decode, "interpreting", lambda: False)
    tile = decode.DECODE_SM90["decode"]
    for programs, spills, expected in [(128, True, (4, 1)), (264, True, (4, 2)),
                                       (265, True, (1, 3)), (128, False, (4, 3)),
                                       (1536, False, (4, 3))]:
        got, per_sm = decode.spill_free(tile, programs, 132, spills)
        assert (got.subtiles, per_sm) == expected, (programs, spills)
    assert decode.register_cap(tile, 3) == {"maxnreg": 168}
    assert decode.register_cap(tile, 2) == {} and decode.register_cap(tile, 1) == {}
    assert decode.spill_free(tile._replace(subtiles=1), 128, 132, True)[0].subtiles == 1


# The checks of the Triton append kernel (CUDA calls check index values there, without a sync:
# a bad one fails a device-side assertion, which the interpreter skips; the kernel also marks
# the sequence's seqlens_k -1, checked here). Same cases as test_errors', plus an int
# cache_seqlens (passed to the kernel as a scalar).
APPEND_CHECKS = {
    "valid": {},
    "unused_table_entries_padding": {"table": {(0, 1): -1}},
    "int_seqlens": {"seqlens": 5},
    "int_seqlens_beyond_after_append": {"seqlens": 32},
    "seqlens_beyond_after_append": {"seqlens": [3, 32]},
    "seqlens_negative": {"seqlens": [-1, 2]},
    "leftpad_beyond_seqlens": {"leftpad": [4, 0]},
    "batch_idx_out_of_range": {"batch_idx": [0, 3]},
    "block_table_out_of_range": {"table": {(1, 0): 4}},
    "block_table_negative_read_only": {"seqlens": [20, 5], "table": {(0, 0): -1}},
    "rotary_too_short": {"seqlen_ro": 5},
}


@interpreted
@pytest.mark.parametrize("case", list(APPEND_CHECKS))
def test_append_kernel_flags_bad_indices_and_writes_nothing_out_of_bounds(case):
    from flashkit.ops.triton import append, decode

    bad = APPEND_CHECKS[case]
    paged = "table" in bad or case == "valid"
    q, kc, vc, k, v, table = _inputs(page_size=16 if paged else None)
    table = table if paged else None
    for (b, p), page in bad.get("table", {}).items():
        table[b, p] = page
    as_i32 = lambda key, default: torch.tensor(bad.get(key, default), dtype=torch.int32)  # noqa: E731
    angles = torch.rand(bad.get("seqlen_ro", 64), 4)
    kc_before, vc_before = kc.clone(), vc.clone()
    seqlens, rows, leftpad = (as_i32(key, default) for key, default in
                              (("seqlens", [3, 5]), ("batch_idx", [2, 0]), ("leftpad", [0, 0])))
    passed = int(seqlens) if seqlens.dim() == 0 else seqlens  # an int: the kernel's scalar
    seqlens = seqlens.expand(2)
    layout = (None if paged else rows, None if paged else leftpad, table)
    cos, sin = angles.cos(), angles.sin()
    # The decoding step's decode kernel (decode.Step) checks and appends itself, on copies.
    kc_step, vc_step = kc.clone(), vc.clone()
    params = AttentionParams(0.25)
    out_step, lse_step = decode.forward(
        q, kc_step, vc_step, None, *layout, params, 2, 32,
        step=decode.Step(passed, k, v, cos, sin, False, 1))
    q_rotated, seqlens_k = append.append(q, kc, vc, k, v, cos, sin, passed, *layout, 1, False)
    out, lse = decode.forward(q_rotated, kc, vc, seqlens_k.clamp(min=0), *layout, params, 2, 32)
    # Sequence b is marked -1 iff one of its indices is bad.
    ok = []
    for b, n in enumerate(seqlens.tolist()):
        row_ok = paged or 0 <= int(rows[b]) < kc.shape[0]
        pages_ok = not paged or all(0 <= int(p) < kc.shape[0]
                                    for p in table[b, :-(-max(n + 1, 0) // 16)])
        ok.append(0 <= n < 32 and 0 <= int(leftpad[b]) <= n and row_ok and pages_ok
                  and n + 1 <= angles.shape[0])
    assert seqlens_k.tolist() == [n + 1 if good else -1
                                  for n, good in zip(seqlens.tolist(), ok, strict=True)], case
    assert all(ok) == (case in ("valid", "unused_table_entries_padding", "int_seqlens")), case
    # The step marks a bad sequence's out NaN (its device assertion fails); a good one gives
    # what the append kernel and the decode kernel give, bit for bit, and so does the cache.
    for b in range(2):
        if ok[b]:
            assert torch.equal(out_step[b], out[b]) and torch.equal(lse_step[b], lse[b]), case
        else:
            assert out_step[b].isnan().all(), case
    assert torch.equal(kc_step, kc) and torch.equal(vc_step, vc), case
    # A sequence whose scalars or written page are bad writes nothing; the others only their
    # new slot (a bad entry among the pages it only reads does not stop that in-bounds write).
    allowed = set()
    for b, n in enumerate(seqlens.tolist()):
        row = int(table[b, n // 16]) if paged and 0 <= n < 32 else int(rows[b])
        if 0 <= n < 32 and 0 <= int(leftpad[b]) <= n and 0 <= row < kc.shape[0] \
                and n + 1 <= angles.shape[0]:
            allowed.add((row, n % 16 if paged else n))
    changed = (kc != kc_before).flatten(2).any(-1) | (vc != vc_before).flatten(2).any(-1)
    for row, slot in changed.nonzero().tolist():
        assert (row, slot) in allowed, f"{case}: wrote cache row {row} slot {slot}"


@interpreted
def test_cpu_calls_check_on_the_host_even_with_the_triton_backend():
    """CPU tensors: the clear ValueError comes before any launch (the interpreter path)."""
    q, kc, vc, k, v, table = _inputs(page_size=16)
    table[1, 0] = 4
    kc_before = kc.clone()
    with pytest.raises(ValueError, match="block_table"):
        _call(q, kc, vc, k, v, cache_seqlens=torch.tensor([3, 5], dtype=torch.int32),
              block_table=table, backend="triton")
    assert torch.equal(kc, kc_before)

# --- the compiled Triton kernels on a GPU -----------------------------------------------------

GPU_LAYOUTS = {"contiguous": None, "paged16": 16, "paged256": 256}


def _gpu_combos():
    """Every layout x query length once (GQA 8:1: 8 packed rows take the decode tile, 32 a wider
    decode tile, 296 the prefill tile), cycling masks, splits 0 (auto), 1, 3, 8 and rotary."""
    for n, (layout, seqlen_q) in enumerate(itertools.product(GPU_LAYOUTS, [1, 4, 37])):
        yield (layout, seqlen_q, list(MASKS)[n % 3], [0, 1, 3, 8][n % 4],
               [None, "interleaved", "neox"][n // 3])


@pytest.mark.gpu
@pytest.mark.parametrize("layout, seqlen_q, mask, num_splits, rotary", list(_gpu_combos()))
@pytest.mark.usefixtures("decode_loop")
def test_triton_on_gpu(layout, seqlen_q, mask, num_splits, rotary):
    """bf16, d128, 1000 cached keys: key tiles cross pages, splits and the masked/unmasked
    boundaries; appends at ragged lengths."""
    Case(batch=3, nheads=16, nheads_k=2, d=128, capacity=1024, seqlen_q=seqlen_q,
         seqlen_new=seqlen_q, page_size=GPU_LAYOUTS[layout], rotary=rotary,
         dtype=torch.bfloat16, num_splits=num_splits, **MASKS[mask]).check("triton", "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("feature", ["softcap", "alibi_batch", "sink", "leftpad"])
@pytest.mark.usefixtures("decode_loop")
def test_triton_features_on_gpu(feature):
    kw = {"softcap": {"softcap": 3.0},
          "alibi_batch": {"alibi_slopes": torch.rand(3, 16)},
          "sink": {"sink": torch.randn(16)},
          "leftpad": {"leftpad": True, "rotary": "neox"}}[feature]
    for mask in ("causal", "window"):
        Case(batch=3, nheads=16, nheads_k=2, d=128, capacity=512, seqlen_q=2, seqlen_new=2,
             dtype=torch.bfloat16, num_splits=0, **kw, **MASKS[mask]).check("triton", "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.usefixtures("decode_loop")
def test_triton_writes_every_output_element_on_gpu(num_splits):
    from flashkit.ops.triton import decode

    case = Case(batch=3, nheads=16, nheads_k=2, page_size=16, capacity=256, d=128, seqlen_q=3,
                seqlen_new=0, causal=True, dtype=torch.bfloat16)
    zeros = torch.zeros(3, dtype=torch.int32, device="cuda")
    out = poison(torch.empty(3, 3, 16, 128, dtype=torch.bfloat16, device="cuda"))
    lse = poison(torch.empty(3, 16, 3, device="cuda"))
    decode.forward(case.q.cuda(), case.k_cache.cuda(), case.v_cache.cuda(), case.seqlens.cuda(),
                   zeros, zeros, case.block_table.cuda(), AttentionParams(0.1, None, 0),
                   num_splits, out=out, lse=lse)
    assert not out.isnan().any() and not lse.isnan().any()


@pytest.mark.gpu
@pytest.mark.usefixtures("decode_loop")
def test_triton_split_counts_twice_on_gpu():
    """bf16 d128 GQA 8:1 over up to 1024 keys in 64-key tiles: 17 and 64 splits leave splits
    empty."""
    check_split_counts("cuda", (2, 5, 16, 17, 64), batch=3, nheads=16, nheads_k=2, d=128,
                       capacity=1024, dtype=torch.bfloat16, causal=True)


@pytest.mark.gpu
def test_gpu_index_checks_sync_and_on_device():
    """sync_checks=True: the host check's ValueError. By default: the device assertion stops the
    process's CUDA work (run in a child process: it ends the CUDA context)."""
    import subprocess
    import sys

    q, kc, vc, k, v, table = (t.cuda() for t in _inputs(page_size=16))
    table[1, 0] = 4
    lens = torch.tensor([3, 5], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="block_table"):
        _call(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, sync_checks=True)
    script = ("import torch, flashkit\n"
              "q = torch.randn(2, 1, 4, 16, device='cuda')\n"
              "kc = torch.randn(4, 16, 2, 16, device='cuda')\n"
              "table = torch.tensor([[0, 1], [4, 3]], dtype=torch.int32, device='cuda')\n"
              "lens = torch.tensor([3, 5], dtype=torch.int32, device='cuda')\n"
              "flashkit.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=lens,\n"
              "                                 block_table=table)\n"
              "torch.cuda.synchronize()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode != 0 and "assert" in done.stderr.lower(), done.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("layout, num_splits", [("contiguous", 0), ("paged256", 0),
                                                ("paged16", 3), ("contiguous", 1)])
def test_cuda_graph_replay_with_new_lengths_and_inputs(layout, num_splits):
    """One decoding step (append one token with rotary, attend causally) captured in a CUDA
    graph, replayed with new q, k, v and cache_seqlens written into the captured tensors: each
    replay gives the eager call's out, lse and cache bit for bit, and the oracle's result."""
    case = Case(batch=3, nheads=16, nheads_k=2, d=128, capacity=1024, seqlen_q=1, seqlen_new=1,
                page_size=GPU_LAYOUTS[layout], rotary="neox", causal=True,
                dtype=torch.bfloat16)
    cuda = lambda t: None if t is None else t.cuda()  # noqa: E731
    q, k, v, seqlens = (cuda(t) for t in (case.q, case.k_new, case.v_new, case.seqlens))
    cos, sin, rows, table = (cuda(t) for t in (case.cos, case.sin, case.batch_idx,
                                               case.block_table))
    k_cache, v_cache = cuda(case.k_cache), cuda(case.v_cache)

    def step(kc, vc):
        return flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, seqlens, cache_batch_idx=rows,
                                       block_table=table, causal=True, num_splits=num_splits,
                                       rotary_interleaved=case.interleaved,
                                       return_softmax_lse=True)

    side = torch.cuda.Stream()  # compile and warm up off the capture, on scratch caches
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(k_cache.clone(), v_cache.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step(k_cache, v_cache)

    for lengths in ([0, 517, 1022], [1, 64, 1000], [255, 256, 1023 - 1]):
        for name, t in (("q", case.q), ("k_new", case.k_new), ("v_new", case.v_new)):
            setattr(case, name, torch.randn_like(t))
        case.seqlens = torch.tensor(lengths, dtype=torch.int32)
        case.k_cache, case.v_cache = k_cache.cpu(), v_cache.cpu()
        for static, new in ((q, case.q), (k, case.k_new), (v, case.v_new),
                            (seqlens, case.seqlens)):
            static.copy_(new)
        k_eager, v_eager = k_cache.clone(), v_cache.clone()
        out_eager, lse_eager = step(k_eager, v_eager)
        graph.replay()
        assert torch.equal(out, out_eager) and torch.equal(lse, lse_eager)
        assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)
        k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
        oracle_out, oracle_lse, k_rot64 = case.expected(torch.float64)
        base_out, base_lse, _ = case.expected(torch.bfloat16)
        assert_close_to_oracle("out", out.cpu(), oracle_out, base_out)
        assert_close_to_oracle("lse", lse.cpu(), oracle_lse, base_lse)
        case.k_cache, case.v_cache = k_cache.cpu(), v_cache.cpu()
        case.check_append(k_before, v_before, k_rot64)


@pytest.mark.gpu
@pytest.mark.parametrize("layout, num_splits, seqlens", [
    ("contiguous", 1, "tensor"), ("contiguous", 4, "int"), ("paged256", 0, "tensor")])
def test_decoding_step_launches_only_its_kernels_on_gpu(layout, num_splits, seqlens):
    """An eager decoding step (append with rotary, attention) runs the decode kernel, which
    appends, and with several splits the merge kernel, and nothing else on the GPU (no append
    kernel, no fill, no separate assertion): a captured step has as many graph nodes."""
    from torch.profiler import ProfilerActivity, profile

    case = Case(batch=3, nheads=16, nheads_k=2, d=128, capacity=1024, seqlen_q=1, seqlen_new=1,
                page_size=GPU_LAYOUTS[layout], rotary="neox", causal=True, dtype=torch.bfloat16,
                seqlens=[500] * 3, num_splits=num_splits)
    kw = {"cache_seqlens": 500} if seqlens == "int" else {}
    case.call("triton", "cuda", **kw)  # compile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        case.call("triton", "cuda", **kw)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [name for name in names if not name.startswith("Memcpy")]  # case.call's copies
    expected = ["_decode_kernel"]
    if num_splits != 1:  # auto picks several splits for 6 programs over 1024 keys
        expected.append("_merge_kernel")
    assert sorted(kernels) == expected, names


PREFILL_CASES = {  # name: (mask, Case options, call options ("int": cache_seqlens as an int))
    "causal_rotary_leftpad": ("causal", dict(rotary="interleaved", leftpad=True), {}),
    "window_int_rows": ("window", dict(rotary="neox", seqlens=[700] * 3), {"int": True}),
    "full_features": ("full", dict(alibi_slopes=torch.rand(3, 16), sink=torch.randn(16),
                                   softcap=3.0), {}),
    "causal_no_append_in_order": ("causal", dict(seqlen_new=0), {"in_order": True}),
    "causal_rotary_d256": ("causal", dict(d=256, rotary="neox"), {}),
}


def _prefill_case(mask, options, call):
    """bf16 d128 (or options' d) GQA 8:1, 512 query rows over a contiguous cache of 1536 slots,
    ragged lengths (one empty sequence, one full), cache rows permuted (or in order with
    cache_batch_idx None); returns (case, extra call kwargs)."""
    case = Case(batch=3, nheads=16, nheads_k=2, d=options.pop("d", 128), capacity=1536,
                seqlen_q=512,
                seqlen_new=options.pop("seqlen_new", 512), dtype=torch.bfloat16, **options,
                **MASKS[mask])
    kw = {}
    if call.get("int"):
        kw["cache_seqlens"] = int(case.seqlens[0])
    if call.get("in_order"):  # rows 0..batch-1: no cache_batch_idx
        case.k_cache, case.v_cache = (c[case.batch_idx.long()] for c in (case.k_cache,
                                                                          case.v_cache))
        case.batch_idx = torch.arange(3, dtype=torch.int32)
        kw["cache_batch_idx"] = None
    return case, kw


def _spy_gluon_prefill(monkeypatch):
    """Route every contiguous prefill to the Gluon forward; returns the list its calls land in."""
    from flashkit.ops.triton import forward_hopper, prefill

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward runs on sm_90")
    monkeypatch.setattr(prefill, "GLUON_PREFILL_MIN_WORK", 0)  # small cases take the route
    calls = []
    forward = forward_hopper.attention_forward
    monkeypatch.setattr(forward_hopper, "attention_forward",
                        lambda *a, **kw: calls.append(kw.get("seqused_k")) or forward(*a, **kw))
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(PREFILL_CASES))
@pytest.mark.usefixtures("fresh_plans")  # choices made under the patched thresholds
def test_prefill_takes_the_gluon_forward_on_gpu(name, monkeypatch):
    """512 new tokens over a contiguous cache: the Gluon forward (seqused_k) computes the
    attention, against the oracle; the cache is appended (rotated) and nothing else changed."""
    calls = _spy_gluon_prefill(monkeypatch)
    mask, options, call = PREFILL_CASES[name]
    case, kw = _prefill_case(mask, dict(options), call)
    case.check("triton", "cuda", **kw)
    assert calls and calls[0] is not None, "the Gluon forward was not used"


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["causal", "full"])
@pytest.mark.usefixtures("fresh_plans")  # choices made under the patched thresholds
def test_prefill_poisoned_spare_cache_does_not_leak_on_gpu(mask, monkeypatch):
    """NaN, inf and -inf in every slot outside the valid keys (the spare cache row, slots past
    each sequence's keys, slots before its leftpad) never reach the Gluon prefill's output: TMA
    reads them with the tiles that cross a sequence's ends."""
    calls = _spy_gluon_prefill(monkeypatch)
    case = Case(batch=3, nheads=16, nheads_k=2, d=128, capacity=1536, seqlen_q=512,
                seqlen_new=512, dtype=torch.bfloat16, leftpad=True, rotary="neox",
                **MASKS[mask])
    valid = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool)
    for b in range(3):
        valid[case.batch_idx[b], case.leftpad[b]:case.seqlens[b]] = True
    for cache in (case.k_cache, case.v_cache):
        spare = cache[~valid]  # (slots, hk, d), a copy
        flat = spare.view(-1)
        for i, value in enumerate((float("nan"), float("inf"), float("-inf"))):
            flat[i::3] = value
        cache[~valid] = spare
    oracle_out, oracle_lse, _ = case.expected(torch.float64)
    base_out, base_lse, _ = case.expected(torch.bfloat16)
    out, lse = case.call("triton", "cuda")
    assert calls and calls[0] is not None, "the Gluon forward was not used"
    assert_close_to_oracle("out", out, oracle_out, base_out)
    assert_close_to_oracle("lse", lse, oracle_lse, base_lse)


# --- the launch cache (flashkit.ops.triton.launch) -----------------------------------------------

def _triton_spec(a, specialize=True, align=True):
    """Triton 3.6's specialisation of one argument (its binder's call), on the CPU."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, a, False, specialize, align)


_INTS = [0, 1, 2, 15, 16, 17, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, -2**31, -2**31 - 1,
         2**32, 2**63 - 16, 2**63 - 1, 2**63, -2**63, 2**64 - 16, 2**64 - 1]
_OTHER_SCALARS = [True, False, 0.0, 1.0, 16.0, 0.5, -2.5, 1e300, float("inf"), None]


def test_launch_key_determines_tritons_specialisation():
    """Equal launch keys imply equal Triton specialisations (the launch cache's premise):
    tensors of several dtypes at aligned and misaligned addresses by tensor_key; scalars by
    type and code, under each pair of do_not_specialize flags, with floats and bools equal to
    ints looked up first; two ints share a code exactly when Triton marks them alike; bundles
    (tuples) of scalars by their members' types and codes, of tensors by their members'."""
    from flashkit.ops.triton.launch import _Codes, scalar_code, scalar_types, tensor_key

    base = [torch.zeros(64, dtype=dtype) for dtype in (torch.float32, torch.bfloat16,
                                                        torch.int32)]
    tensors = [t[offset:] for t in base for offset in (0, 1, 4, 8, 16)]
    for a, b in itertools.combinations(tensors, 2):
        if tensor_key(a) == tensor_key(b):
            assert _triton_spec(a) == _triton_spec(b), (tensor_key(a), a, b)
    for specialize, align in itertools.product((True, False), repeat=2):
        codes = _Codes(specialize, align)
        keyed = [(a, (type(a), codes[a])) for a in _OTHER_SCALARS]
        keyed += [(a, (type(a), codes[a])) for a in _INTS]  # ints after floats and bools
        for (a, key_a), (b, key_b) in itertools.combinations(keyed, 2):
            spec_a, spec_b = (_triton_spec(x, specialize, align) for x in (a, b))
            if key_a == key_b:
                assert spec_a == spec_b, (a, b, specialize, align)
            if type(a) is type(b) is int:
                assert (key_a == key_b) == (spec_a == spec_b), (a, b, specialize, align)
        for too_large in (2**64, -2**63 - 1):  # Triton refuses them; never a valid int's code
            with pytest.raises(OverflowError):
                _triton_spec(too_large, specialize, align)
            assert scalar_code(too_large, specialize, align) not in {codes[a] for a in _INTS}
        # bundles of scalars (features.KernelFeatures.score_values): Triton marks each member
        members = [0.5, 1.0, 0, 1, 16, 17, 2**31]
        bundles = [()] + [tuple(c) for n in (1, 2) for c in itertools.product(members, repeat=n)]
        for a, b in itertools.combinations(bundles, 2):
            if (scalar_types((a,)), codes[a]) == (scalar_types((b,)), codes[b]):
                assert _triton_spec(a, specialize, align) == _triton_spec(b, specialize, align), (
                    a, b, specialize, align)
    # bundles of tensors (features.KernelFeatures.score_tensors)
    pairs = [(a,) for a in tensors[:6]] + [(a, b) for a in tensors[:3] for b in tensors[3:6]]
    for a, b in itertools.combinations(pairs, 2):
        if tensor_key(a) == tensor_key(b):
            assert _triton_spec(a) == _triton_spec(b), (tensor_key(a), a, b)
    assert len({tensor_key(a) for a in pairs}) == len({_triton_spec(a) for a in pairs})


class _StandInKernel:
    """A JITFunction as launch sees it: its params, and kernel[grid](...) specialising the
    arguments with Triton's own binder and returning one compiled stand-in per
    specialisation; every launch records (the specialisation its kernel was compiled for,
    that of its arguments)."""

    def __init__(self, fn, **flags):
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        jit = JITFunction(fn, **flags)
        self.__name__, self.params, self.arg_names = fn.__name__, jit.params, jit.arg_names
        self.used_global_vals = {}
        self._binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
        self.compiled, self.launches, self.through_triton = {}, [], 0

    def spec(self, *args, **kwargs):
        return tuple(self._binder(*args, **kwargs)[1])

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.through_triton += 1
            spec = self.spec(*args, **kwargs)
            self.launches.append((spec, spec))
            return self.compiled.setdefault(spec, _StandInCompiled(self, spec))
        return run


class _StandInCompiled:
    function = packed_metadata = None

    def __init__(self, kernel, spec):
        self.kernel, self.spec = kernel, spec

    def run(self, *args):  # grid (3), stream, function, metadata, 3 hooks, kernel arguments
        self.kernel.launches.append((self.spec, self.kernel.spec(*args[9:])))


def _stand_in_fn(x_ptr, a, b, seed, scale, flag, N: tl.constexpr):  # noqa: F821
    pass


@pytest.fixture
def direct_launch(monkeypatch):
    """launch as on a GPU (no interpreter, a stream from a stand-in driver), empty caches."""
    import triton

    from flashkit.ops.triton import launch

    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton.runtime.driver, "_active",
                        type("Driver", (), {"get_current_stream": lambda self, device: 0})())
    for cache in ("_compiled", "_by_value", "_plans"):
        monkeypatch.setattr(launch, cache, {})
    return launch


def test_launch_takes_the_kernel_triton_would(direct_launch):
    """Through launch's caches, every launch runs the kernel compiled for its arguments'
    Triton specialisation, and Triton compiles each specialisation once (bools, keyed as the
    ints 0 and 1, twice): values of one class share an entry. b is not specialised on
    alignment, seed not at all (as the kernels' dropout seeds)."""
    import random

    kernel = _StandInKernel(_stand_in_fn, do_not_specialize=["seed"],
                            do_not_specialize_on_alignment=["b"])
    rng = random.Random(0)
    x = torch.zeros(64)
    classes = set()  # (Triton's specialisation, the bool)
    for _ in range(300):
        scalars = (rng.choice(_INTS), rng.choice(_INTS), rng.randrange(-2**31, 2**31),
                   rng.choice([0.5, -2.5, 1e-3]), rng.random() < 0.5)
        direct_launch.launch(kernel, (1,), (x,), scalars, dict(N=16))
        classes.add((kernel.spec(x, *scalars, N=16), scalars[-1]))
    assert len(kernel.launches) == 300
    assert all(compiled == spec for compiled, spec in kernel.launches)
    assert kernel.through_triton == len(direct_launch._compiled) == len(classes) < 150


def test_launch_cache_does_not_grow_with_a_new_seed_each_call(direct_launch):
    """A dropout-like call with a new seed every time reuses one compiled kernel: one call
    through Triton, one entry."""
    import random

    kernel = _StandInKernel(_stand_in_fn, do_not_specialize=["seed"])
    rng = random.Random(1)
    x = torch.zeros(64)
    for _ in range(2 * direct_launch.MAX_ENTRIES + 10):
        direct_launch.launch(kernel, (1,), (x,), (64, 7, rng.randrange(-2**31, 2**31), 0.5,
                                                  True), dict(N=16))
    assert kernel.through_triton == 1 and len(direct_launch._compiled) == 1
    assert all(compiled == spec for compiled, spec in kernel.launches)


def test_host_cdiv_and_next_power_of_2_match_tritons():
    """common's host cdiv / next_power_of_2 (the launchers' grids and blocks) are Triton's."""
    import triton

    from flashkit.ops.triton.common import cdiv, next_power_of_2

    for n in [*range(0, 1100), 2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_launch_sees_a_changed_global():
    """launch's check of a kernel's globals (Triton's: a changed one raises on the next launch)
    still sees a new value after it has passed once, and takes an equal new object."""
    import copy

    import triton.language as tl

    from flashkit.ops.triton.launch import _globals_changed

    class Kernel:  # what _globals_changed reads of a JITFunction
        def __init__(self, scope):
            self.used_global_vals = {("A", id(scope)): (copy.deepcopy(scope["A"]), scope)}

    scope = {"A": tl.constexpr(1)}
    kernel = Kernel(scope)
    assert not _globals_changed(kernel) and not _globals_changed(kernel)
    scope["A"] = tl.constexpr(2)
    assert _globals_changed(kernel)
    scope["A"] = tl.constexpr(1)
    assert not _globals_changed(kernel)
    del scope["A"]
    assert _globals_changed(kernel)


def test_launched_kernels_take_their_constexprs_last():
    """launch passes the runtime arguments and then the constexprs in signature order (the
    Gluon forward's too)."""
    import inspect

    from flashkit.ops.triton import append, decode, forward_hopper

    for kernel in (append._append_kernel, decode._decode_kernel, decode._merge_kernel,
                   forward_hopper._fwd_hopper_kernel):
        kinds = ["constexpr" in str(p.annotation)
                 for p in inspect.signature(kernel.fn).parameters.values()]
        assert kinds == sorted(kinds), kernel.fn.__name__


@pytest.mark.gpu
def test_launch_cache_separates_misaligned_tensors_on_gpu():
    """A misaligned q (data_ptr % 16 != 0) gets its own compiled decode kernel, and both give the
    same result."""
    from flashkit.ops.triton import decode, launch

    case = Case(batch=3, nheads=16, nheads_k=2, d=128, capacity=512, seqlen_q=1, seqlen_new=0,
                dtype=torch.bfloat16)
    k_cache, v_cache, seqlens = case.k_cache.cuda(), case.v_cache.cuda(), case.seqlens.cuda()
    rows = case.batch_idx.cuda()
    q = case.q.cuda()
    q_odd = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view_as(q)
    q_odd.copy_(q)
    params = AttentionParams(128 ** -0.5)
    outs = []
    for query in (q, q_odd, q, q_odd):
        before = set(launch._compiled)
        outs.append(decode.forward(query, k_cache, v_cache, seqlens, rows, None, None, params,
                                   1, 512)[0])
        new = [key for key in set(launch._compiled) - before
               if key[0] == id(decode._decode_kernel)]
        assert len(new) <= 1
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    aligned = {key[2][0] for key in launch._compiled if key[0] == id(decode._decode_kernel)}
    assert {(torch.bfloat16, True), (torch.bfloat16, False)} <= aligned


@interpreted
def test_triton_int_steps_keep_one_plan(monkeypatch):
    """A decoding step with an int cache_seqlens, as the CUDA path passes it (KVCacheArgs with
    host_seqlen and no tensor), keeps one launch plan while the int changes every step: the
    decode kernel is prepared once and takes each value per call. Each step gives what the same
    step with its lengths as a tensor gives."""
    from flashkit.ops.params import KVCacheArgs
    from flashkit.ops.triton import decode, dispatch
    from flashkit.ops.triton import kvcache_attention as triton_kvcache

    dispatch.forget_plans()
    prepared = []
    real_prepare = decode._prepare
    monkeypatch.setattr(decode, "_prepare", lambda *a: prepared.append(1) or real_prepare(*a))
    q, kc, vc, k, v, _ = _inputs()
    params = AttentionParams(0.25, None, 0)  # causal
    for n in (3, 9, 20):
        outs = []
        for seqlens in (n, torch.full((2,), n, dtype=torch.int32)):
            tensor = isinstance(seqlens, torch.Tensor)
            cache = KVCacheArgs(k=k, v=v, rotary_cos=None, rotary_sin=None,
                                rotary_interleaved=False,
                                cache_seqlens=seqlens if tensor else None,
                                host_seqlen=None if tensor else n, cache_batch_idx=None,
                                cache_leftpad=None, block_table=None, q_rows=1, capacity=32,
                                max_seqlen_k=32, num_splits=2, host_checked=False)
            caches = (kc.clone(), vc.clone())
            outs.append((*triton_kvcache(q, *caches, cache, params), *caches))
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(prepared) == 2  # one decode launch per plan: the int's and the tensor's


@interpreted
def test_triton_planned_step_runs_what_dispatch_runs():
    """The planned decoding step that flash_attn_with_kvcache keeps with a call's checks
    (dispatch.PlannedStep) gives bitwise what kvcache_attention gives for the same call, with
    an int and with a tensor cache_seqlens, and with the params of each call (a sink that
    differs between two calls of one plan); forget_plans empties it, and it then declines to
    run (None), so the caller goes through dispatch again."""
    import dataclasses

    from flashkit.ops.params import KVCacheArgs
    from flashkit.ops.triton import dispatch, kvcache_step
    from flashkit.ops.triton import kvcache_attention as triton_kvcache

    dispatch.forget_plans()
    q, kc, vc, k, v, _ = _inputs()
    causal = AttentionParams(0.25, None, 0)

    def with_sink():  # the plan key holds the sink's layout; each call brings its own values
        return dataclasses.replace(causal, sink=torch.randn(4) * 3)

    for seqlens in (9, torch.full((2,), 9, dtype=torch.int32)):
        tensor = isinstance(seqlens, torch.Tensor)
        cache = KVCacheArgs(k=k, v=v, rotary_cos=None, rotary_sin=None,
                            rotary_interleaved=False, cache_seqlens=seqlens if tensor else None,
                            host_seqlen=None if tensor else seqlens, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, q_rows=1, capacity=32,
                            max_seqlen_k=32, num_splits=2, host_checked=False)
        step = kvcache_step(q, kc, vc, cache, with_sink())
        for _ in range(2):  # the step kept from the call before, against a fresh plan's
            params = with_sink()
            assert isinstance(step, dispatch.PlannedStep)
            caches = (kc.clone(), vc.clone())
            got = (*step(params, q, *caches, k, v, seqlens, None, None, None, None, None),
                   *caches)
            dispatch.forget_plans()
            caches = (kc.clone(), vc.clone())
            want = (*triton_kvcache(q, *caches, cache, params), *caches)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            step = kvcache_step(q, kc, vc, cache, params)
    dispatch.forget_plans()
    assert step(params, q, kc.clone(), vc.clone(), k, v, seqlens, None, None, None, None,
                None) is None


class _NeverKept(dict):
    """A _KEPT_CALLS that keeps nothing: every call is checked and dispatched anew."""

    def __setitem__(self, key, value):
        pass


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", ["tensor", "int"])
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged"])
def test_gpu_kept_decoding_steps_equal_the_steps_through_dispatch(lengths, page_size,
                                                                  monkeypatch):
    """A decoding loop (rotary, one new token a step, a growing cache, GQA 8:1) through
    flash_attn_with_kvcache: from the second step on, each call runs the planned step kept with
    its checks (dispatch.PlannedStep), skipping the checks and dispatch. Outputs, lse and the
    caches equal bitwise those of the same loop with nothing kept; after forget_plans the next
    call goes through dispatch and keeps a new step."""
    from flashkit.ops.triton import dispatch

    ran = []
    real_call = dispatch.PlannedStep.__call__

    def counted(self, *args):
        result = real_call(self, *args)
        ran.append(result is not None)
        return result

    monkeypatch.setattr(dispatch.PlannedStep, "__call__", counted)

    def loop(kept):
        monkeypatch.setattr(kvcache, "_KEPT_CALLS", {} if kept else _NeverKept())
        dispatch.forget_plans()
        gen = torch.Generator().manual_seed(0)

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)

        batch, nheads, nheads_k, d, capacity = 2, 16, 2, 128, 256
        if page_size is None:
            k_cache, v_cache = randn(batch, capacity, nheads_k, d), randn(batch, capacity,
                                                                          nheads_k, d)
            table = None
        else:
            pages = batch * capacity // page_size
            k_cache, v_cache = (randn(pages, page_size, nheads_k, d) for _ in range(2))
            table = torch.randperm(pages, generator=gen).view(batch, -1).to("cuda",
                                                                            torch.int32)
        angles = torch.rand(capacity, 32, generator=gen).cuda() * 6.28
        cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
        results = []
        for n in range(100, 110):
            if n == 105:
                dispatch.forget_plans()
            q, k, v = randn(batch, 1, nheads, d), *(randn(batch, 1, nheads_k, d)
                                                     for _ in range(2))
            lens = n if lengths == "int" else torch.full((batch,), n, dtype=torch.int32,
                                                         device="cuda")
            results += flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos,
                                               rotary_sin=sin, cache_seqlens=lens,
                                               block_table=table, causal=True,
                                               return_softmax_lse=True)
        return results + [k_cache, v_cache]

    through_dispatch = loop(kept=False)
    assert ran == []
    kept = loop(kept=True)
    # steps 2-5 ran kept; step 6 found its step forgotten (None), then steps 7-10 ran kept
    assert ran == [True] * 4 + [False] + [True] * 4
    for got, want in zip(kept, through_dispatch, strict=True):
        assert torch.equal(got, want)
