"""The non-finite and one-key promises of docs/robustness.md on the sm_90 Gluon kernels: fp16/bf16
at head dims 64/128 in the flash layout, shapes the Gluon path takes (the other adversarial
modules use fp32 at head dim 16, which it declines). Every test asserts that the Gluon forward
or backward computed the result (their launchers are wrapped and counted).

- NaN/inf in the values (and keys, forward) of keys some query rows cannot see, inside the
  tiles those rows share with rows that see them (causal diagonal, window edges, the key tail at
  lengths off the tiles, varlen): the other rows' out, lse and dq are bit for bit those of the
  clean inputs and match the float64 oracle; rows that see a poisoned value are non-finite; rows
  with no visible key give out 0 and lse -inf. Every forward schedule (one warpgroup, producer
  with one to three consumers, ping-pong, persistent) through the launcher.
- Rows that see exactly one key get exactly zero dq and dk (window (0, 0); causal with
  seqlen_q > seqlen_k)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import flashkit
from flashkit.ops.params import AttentionParams
from flashkit.reference import attention_with_params
from flashkit.testing import assert_close_to_oracle

forward_hopper = importlib.import_module("flashkit.ops.triton.forward_hopper")
backward_hopper = importlib.import_module("flashkit.ops.triton.backward_hopper")

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")]

# (BLOCK_N, NUM_STAGES, CONSUMERS, SPECIALIZED, PINGPONG, PERSISTENT), as test_triton_hopper's
SCHEDULES = {
    "inline": (64, 3, 1, False, False, False),
    "producer": (128, 2, 1, True, False, False),
    "two": (128, 2, 2, True, False, False),
    "pingpong": (64, 2, 2, True, True, False),
    "three": (128, 2, 3, True, True, False),
    "persistent": (128, 2, 2, True, True, True),
    "persistent_three": (64, 2, 3, True, False, True),
}


def _spy(monkeypatch) -> list:
    """Record every call of the Gluon launchers (dispatch and backward.py call them through
    their modules)."""
    calls = []
    for module, name in ((forward_hopper, "attention_forward"),
                         (backward_hopper, "attention_backward_dkdv"),
                         (backward_hopper, "attention_backward_dq")):
        launcher = getattr(module, name)

        def record(*args, _name=name, _launcher=launcher, **kwargs):
            calls.append(_name)
            return _launcher(*args, **kwargs)
        monkeypatch.setattr(module, name, record)
    return calls


def _visible(seqlen_q, seqlen_k, window) -> torch.Tensor:
    """[seqlen_q, seqlen_k] bool: key j visible from query i (docs/design.md section 1)."""
    left, right = window
    i = torch.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k)[None, :]
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def _poison_(x, keys, head):
    """NaN, inf and -inf into elements of x's rows `keys` of kv head `head` (x: (batch, seqlen,
    heads, d); batch entry 0)."""
    for n, j in enumerate(keys):
        x[0, j, head, n % x.shape[-1]] = (math.nan, math.inf, -math.inf)[n % 3]
        x[0, j, head, (n + 7) % x.shape[-1]] = math.nan


# (head_dim, seqlen_q, seqlen_k, window (left, right), poisoned keys): keys inside tiles that
# rows which cannot see them share with rows that do (the causal diagonal, the window edges),
# the last key of a length off the tiles, and keys no row sees.
CASES = [
    (128, 300, 300, (-1, 0), (5, 130, 200, 299)),
    (64, 257, 257, (-1, 0), (64, 100, 256)),
    (128, 200, 333, (-1, 0), (140, 200, 332)),   # seqlen_k > seqlen_q: shift 133
    (64, 333, 200, (-1, 0), (0, 1, 50, 199)),    # rows 0 .. 132 see no key
    (128, 260, 260, (40, 8), (3, 70, 128, 255)),
    (64, 190, 190, (0, 0), (17, 100)),           # one key per row
    (128, 520, 520, (-1, 0), (300, 517)),
]


def _dense(case, dtype, arg):
    head_dim, seqlen_q, seqlen_k, window, keys = case
    shape = (2, None, 4, head_dim)
    q = torch.randn(2, seqlen_q, 4, head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(shape[0], seqlen_k, 2, head_dim, device="cuda", dtype=dtype)
            for _ in range(2))
    bad = {"k": k.clone(), "v": v.clone()}
    _poison_(bad[arg], keys, 0)
    vis = _visible(seqlen_q, seqlen_k, window)
    sees = vis[:, list(keys)].any(1).cuda()  # query rows that see a poisoned key
    return q, k, v, bad["k"], bad["v"], window, vis, sees


@pytest.mark.parametrize("arg", ["v", "k"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gluon_forward_masked_non_finite_changes_nothing(case, arg, monkeypatch):
    calls = _spy(monkeypatch)
    q, k, v, k_bad, v_bad, window, vis, sees = _dense(case, torch.bfloat16, arg)

    def run(k_in, v_in):
        return flashkit.flash_attn_func(q, k_in, v_in, window_size=window,
                                        return_attn_probs=True, backend="triton")[:2]
    clean_out, clean_lse = run(k, v)
    out, lse = run(k_bad, v_bad)
    assert calls == ["attention_forward"] * 2
    clean = ~sees
    # heads 0, 1 read kv head 0 (the poisoned one); batch entry 1 and heads 2, 3 are clean
    assert torch.equal(out[0][clean][:, :2], clean_out[0][clean][:, :2])
    assert torch.equal(lse[0][:2][:, clean], clean_lse[0][:2][:, clean])
    assert torch.equal(out[1], clean_out[1]) and torch.equal(out[:, :, 2:], clean_out[:, :, 2:])
    if arg == "v" or sees.any():  # a NaN key scores NaN: its row is NaN as well
        assert not torch.isfinite(out[0][sees][:, :2]).all(-1).any()
    none = ~vis.any(1).cuda()  # rows with no visible key
    assert (out[:, none] == 0).all() and (lse[:, :, none] == -math.inf).all()
    ref, _ = attention_with_params(*(x.double() for x in (q, k, v)),
                                   AttentionParams(q.shape[-1] ** -0.5, *_window(window)))
    base, _ = attention_with_params(q, k, v, AttentionParams(q.shape[-1] ** -0.5,
                                                             *_window(window)))
    assert_close_to_oracle("out (rows that cannot see the poison)", out[0][clean],
                           ref[0][clean], base[0][clean])


def _window(window):
    left, right = window
    return (None if left < 0 else left), (None if right < 0 else right)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("head_dim,window", [(64, (-1, 0)), (128, (-1, 0)), (128, (70, 3))])
def test_gluon_forward_every_schedule_masks_non_finite_values(schedule, head_dim, window):
    """The launcher with each schedule (consumers sharing a tile each guard it): NaN/inf values
    of keys on the diagonal, at the window's edges and in the key tail."""
    seqlen_q = seqlen_k = 450
    keys = (0, 127, 200, 201, 383, 449)
    q = torch.randn(2, seqlen_q, 4, head_dim, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, seqlen_k, 2, head_dim, device="cuda", dtype=torch.float16)
            for _ in range(2))
    v_bad = v.clone()
    _poison_(v_bad, keys, 1)
    params = AttentionParams(head_dim ** -0.5, *_window(window))
    tile = SCHEDULES[schedule]
    clean_out, clean_lse = forward_hopper.attention_forward(q, k, v, params, tile=tile)
    out, lse = forward_hopper.attention_forward(q, k, v_bad, params, tile=tile)
    sees = _visible(seqlen_q, seqlen_k, window)[:, list(keys)].any(1).cuda()
    assert torch.equal(out[0][~sees][:, 2:], clean_out[0][~sees][:, 2:])
    assert torch.equal(out[:, :, :2], clean_out[:, :, :2]) and torch.equal(out[1], clean_out[1])
    assert torch.equal(lse, clean_lse)
    assert not torch.isfinite(out[0][sees][:, 2:]).all(-1).any()


def _grads(q, k, v, dout, window, **kwargs):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = flashkit.flash_attn_func(*leaves, window_size=window, backend="triton", **kwargs)
    return torch.autograd.grad(out, leaves, dout)


def _oracle_grads(q, k, v, dout, window, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, _ = attention_with_params(*leaves, AttentionParams(q.shape[-1] ** -0.5,
                                                            *_window(window)))
    return torch.autograd.grad(out, leaves, dout.to(dtype))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_gluon_backward_masked_non_finite_value_changes_nothing(case, monkeypatch):
    """NaN/inf values of keys some rows cannot see: those rows' dq (dP = dO V^T reads every
    value of the tile), dv everywhere (dV = P^T dO reads no value) and dk of the keys only
    such rows see are those of the clean inputs; with lengths off the tiles the dense call runs
    through the Gluon kernels as varlen."""
    calls = _spy(monkeypatch)
    q, k, v, _, v_bad, window, vis, sees = _dense(case, torch.bfloat16, "v")
    dout = torch.randn_like(q)
    clean = _grads(q, k, v, dout, window)
    got = _grads(q, k, v_bad, dout, window)
    assert calls.count("attention_backward_dkdv") == calls.count("attention_backward_dq") == 2
    rows = ~sees
    assert torch.equal(got[0][0][rows], clean[0][0][rows])
    assert torch.equal(got[0][1], clean[0][1])
    assert torch.equal(got[2], clean[2])
    quiet_keys = ~vis[sees.cpu()].any(0).cuda()  # keys no row that sees the poison sees
    quiet_keys[list(case[4])] = False
    assert torch.equal(got[1][0][quiet_keys], clean[1][0][quiet_keys])
    want, base = (_oracle_grads(q, k, v, dout, window, t) for t in (torch.float64, q.dtype))
    assert_close_to_oracle("dq", got[0][0][rows], want[0][0][rows], base[0][0][rows], factor=3)
    assert_close_to_oracle("dv", got[2], want[2], base[2], factor=3)


# (head_dim, seqlen_q, seqlen_k, window): every row of (0, 0) sees one key; causal with
# seqlen_q > seqlen_k: row seqlen_q - seqlen_k sees key 0 alone (rows above it see none)
ONE_KEY = [(64, 256, 256, (0, 0)), (128, 192, 192, (0, 0)), (128, 200, 130, (0, 0)),
           (64, 320, 128, (-1, 0)), (128, 333, 201, (-1, 0))]


@pytest.mark.parametrize("case", ONE_KEY, ids=str)
def test_gluon_backward_one_key_rows_get_exact_zero(case, monkeypatch):
    calls = _spy(monkeypatch)
    head_dim, seqlen_q, seqlen_k, window = case
    q = torch.randn(2, seqlen_q, 4, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, seqlen_k, 2, head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    dout = torch.randn_like(q)
    dq, dk, dv = _grads(q, k, v, dout, window)
    assert "attention_backward_dq" in calls
    vis = _visible(seqlen_q, seqlen_k, window)
    one = (vis.sum(1) == 1).cuda()
    assert one.any() and (dq[:, one] == 0).all()
    only_one = (vis.sum(0) > 0) & (vis & (vis.sum(1, keepdim=True) == 1)).sum(0).eq(
        vis.sum(0))  # keys seen only by one-key rows
    assert (dk[:, only_one.cuda()] == 0).all()
    want, base = (_oracle_grads(q, k, v, dout, window, t) for t in (torch.float64, q.dtype))
    for name, got, w, b in zip(("dq", "dk", "dv"), (dq, dk, dv), want, base, strict=True):
        assert_close_to_oracle(name, got, w, b, factor=3)
    sink = torch.zeros(4, device="cuda")  # a sink makes the one score matter: no exact zero
    dq_sink = _grads(q, k, v, dout, window, sink=sink)[0]
    assert (dq_sink[:, one] != 0).any()


def test_gluon_takes_the_adversarial_shapes(monkeypatch):
    """The module's shapes do reach the Gluon kernels through the public API (dense at lengths
    on the tiles, dense off them, varlen)."""
    calls = _spy(monkeypatch)
    for seqlen in (256, 190):
        q, k, v = (torch.randn(1, seqlen, 2, 64, device="cuda", dtype=torch.float16,
                               requires_grad=True) for _ in range(3))
        flashkit.flash_attn_func(q, k, v, causal=True, backend="triton").sum().backward()
    cu = torch.tensor([0, 70, 71, 300], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(300, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    flashkit.flash_attn_varlen_func(q, k, v, cu, cu, 229, 229, causal=True,
                                    backend="triton").sum().backward()
    assert calls == ["attention_forward", "attention_backward_dkdv",
                     "attention_backward_dq"] * 3


def test_gluon_varlen_neighbour_keys_and_band(monkeypatch):
    """Varlen: NaN values in a sequence's diagonal and in its last keys (the next sequence's
    rows are read by the same tile) reach only the rows that see them, forward and dq."""
    calls = _spy(monkeypatch)
    lengths = [70, 1, 200, 129]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    total = int(cu[-1])
    q, k, v = (torch.randn(total, 4, 64, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    dout = torch.randn_like(q)
    start = int(cu[2])
    keys = (start + 100, start + 199)  # sequence 2's key 100 and its last key
    v_bad = v.clone()
    for n, j in enumerate(keys):
        v_bad[j, :, n] = (math.nan, math.inf)[n]

    def run(v_in):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v_in)]
        out = flashkit.flash_attn_varlen_func(*leaves, cu, cu, max(lengths), max(lengths),
                                              causal=True, backend="triton")
        return (out, *torch.autograd.grad(out, leaves, dout))
    clean, got = run(v), run(v_bad)
    assert calls.count("attention_forward") == 2
    assert calls.count("attention_backward_dq") == 2
    rows = torch.ones(total, dtype=torch.bool, device="cuda")
    rows[start + 100:start + 200] = False  # sequence 2's rows that see key 100 (causal)
    for name, a, b in zip(("out", "dq", "dv"), (got[0], got[1], got[3]),
                          (clean[0], clean[1], clean[3]), strict=True):
        kept = b if name == "dv" else b[rows]
        assert torch.equal(a if name == "dv" else a[rows], kept), name
    assert not torch.isfinite(got[0][start + 100:start + 200]).all(-1).any()
