"""launch.Prepared, the launch a dispatch plan keeps: its direct launch passes the compiled
kernel's C entry exactly the arguments Triton's own launcher would (descriptors expanded into
TMA maps, shapes and strides; tensors and scalars in signature order; each call's seed), it
keeps no tensor alive, and it refuses a per-call scalar Triton specialises on. On an sm_90
GPU, the direct launches of a seen plan key give bitwise what the launches through Triton
give.

The CPU tests need no GPU: a stand-in compiled kernel carries Triton 3.6's real CudaLauncher and
tensor-descriptor wrapper (wrap_handle_tensordesc) around a C entry that records its arguments,
and the driver's fill_tma_descriptor returns its own arguments instead of an encoded map."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch

import flashkit
from flashkit.ops.triton import dispatch
from flashkit.ops.triton import launch as launch_module
from flashkit.ops.triton.hopper_common import descriptor, gluon, tile_layout
from helpers import ON_HOPPER

pytestmark = pytest.mark.skipif(gluon is None, reason="a Triton without Gluon")

if gluon is not None:
    from triton.backends.nvidia.driver import CudaLauncher, wrap_handle_tensordesc
    from triton.experimental.gluon import language as gl

    @gluon.jit(do_not_specialize=["seed_lo", "seed_hi"])
    def _stand_in(x_desc, n, Out, seed_lo, scale, seed_hi, y_desc, BLOCK: gl.constexpr,
                  FLAG: gl.constexpr):
        pass  # never compiled: the test's compiled kernel stands in for it

    @gluon.jit
    def _bundled_stand_in(x_desc, Out, Bundle, values, BLOCK: gl.constexpr):
        pass  # a kernel taking a bundle of tensors and one of scalars (features.py's)

TENSORS = ("x_desc", "Out", "y_desc")  # the tensor parameters, interleaved with the scalars
META = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "fp4_padded": False}
STREAM, FUNCTION, PACKED = 7, 1234, ("packed metadata",)


class _Driver:
    """The active driver's stand-in: a stream, and fill_tma_descriptor returning its arguments."""

    def __init__(self):
        self.utils = types.SimpleNamespace(fill_tma_descriptor=lambda *args: ("tma", *args))

    def get_current_stream(self, device=None):
        return STREAM


@pytest.fixture
def compiled(monkeypatch):
    """A compiled kernel whose launcher is Triton's CudaLauncher and descriptor wrapper around
    a recording C entry; launch_module.launch returns it after launching through it, as
    launch does."""
    signature = {"x_desc": "tensordesc<bf16[64, 32]>", "n": "i32", "Out": "*fp32",
                 "seed_lo": "i32", "scale": "fp32", "seed_hi": "i32",
                 "y_desc": "tensordesc<bf16[64, 32]>", "BLOCK": "constexpr",
                 "FLAG": "constexpr"}
    return _compiled(monkeypatch, signature, 2)


@pytest.fixture
def compiled_bundled(monkeypatch):
    """The same for _bundled_stand_in: a bundle of two tensors, one of two scalars."""
    signature = {"x_desc": "tensordesc<bf16[64, 32]>", "Out": "*fp32",
                 "Bundle": ("*fp32", "*bf16"), "values": ("fp32", "i32"),
                 "BLOCK": "constexpr"}
    return _compiled(monkeypatch, signature, 1)


@pytest.fixture
def compiled_nested(monkeypatch):
    """The same for _bundled_stand_in taking a nested bundle of tensors and numbers, as a
    user's modifiers reach the Gluon kernels (a block mask's lists with their sizes, a
    modifier's captured tensors and numbers): the member 1 is a constexpr to Triton."""
    signature = {"x_desc": "tensordesc<bf16[64, 32]>", "Out": "*fp32",
                 "Bundle": (("*i32", "*i32", "i32", "constexpr"), "i32", "fp32"),
                 "values": ("fp32", "i32"), "BLOCK": "constexpr"}
    return _compiled(monkeypatch, signature, 1)


@pytest.fixture
def compiled_empty(monkeypatch):
    """The same for _bundled_stand_in taking an empty bundle, as an absent feature's reaches
    the Gluon kernels (most of a plain call's bundles)."""
    signature = {"x_desc": "tensordesc<bf16[64, 32]>", "Out": "*fp32", "Bundle": (),
                 "values": ("fp32", "i32"), "BLOCK": "constexpr"}
    return _compiled(monkeypatch, signature, 1)


def _compiled(monkeypatch, signature: dict, descriptors: int):
    import triton

    calls = []

    def c_entry(*args):  # what the compiled module's launch receives
        calls.append(args)

    metas = [dict(META, block_size=[64, 32])] * descriptors
    runner = object.__new__(CudaLauncher)
    runner.launch = wrap_handle_tensordesc(c_entry, signature, metas)
    runner.num_ctas, runner.launch_cooperative_grid, runner.launch_pdl = 1, False, True
    runner.global_scratch_size = runner.profile_scratch_size = 0
    runner.global_scratch_align = runner.profile_scratch_align = 1
    kernel = types.SimpleNamespace(run=runner, function=FUNCTION, packed_metadata=PACKED,
                                   metadata=types.SimpleNamespace(tensordesc_meta=metas))
    slow = []

    def through_launch(kern, grid, tensors, scalars, constexprs, tensor_params=(), **options):
        slow.append(scalars)
        args = launch_module._order(kern, tensor_params, len(tensors), len(scalars))(
            tensors + scalars)
        kernel.run(*grid, STREAM, FUNCTION, PACKED, None, None, None, *args,
                   *constexprs.values())
        return kernel

    monkeypatch.setattr(triton.runtime.driver, "_active", _Driver())
    monkeypatch.setattr(launch_module, "launch", through_launch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return types.SimpleNamespace(calls=calls, slow=slow)


def _read(arg):
    """What the launcher's C code reads of an argument: a tensor's address (getPointer calls
    data_ptr() on anything but an int), a tuple's members' (a bundle), anything else as it is."""
    if isinstance(arg, torch.Tensor):
        return arg.data_ptr()
    if type(arg) is tuple:
        return tuple(map(_read, arg))
    return arg


def assert_launches_alike(direct: tuple, expected: tuple) -> None:
    """The direct launch's C-entry arguments read as Triton's launcher's do: equal values,
    pointers as addresses (the direct launch passes ints, Triton's wrapper the tensors)."""
    assert len(direct) == len(expected)
    for got, want in zip(direct, expected, strict=True):
        assert got is want or _read(got) == _read(want), (got, want)


def _inputs(seed: int):
    """x, y (bf16, read through descriptors of [64, 32] boxes) and out, as a call passes them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 4, 32, generator=gen).to(torch.bfloat16)
    y = torch.randn(256, 2, 32, generator=gen).to(torch.bfloat16)
    return x, torch.empty(16), y


def _prepared(x, y):
    layout = tile_layout(64, 32, torch.bfloat16)
    descriptors = {0: descriptor(x.view(-1, 128), (64, 32), layout),
                   2: descriptor(y.view(-1, 64), (64, 32), layout)}
    return launch_module.Prepared(_stand_in, (3, 2), (128, 0, 0.5, 0), dict(BLOCK=64, FLAG=True),
                                  TENSORS, descriptors, ("seed_lo", "seed_hi"))


def test_the_direct_launch_passes_what_tritons_launcher_would(compiled):
    x, out, y = _inputs(0)
    prepared = _prepared(x, y)
    prepared(x, out, y, varying=(5, 6))  # the first call goes through launch
    prepared(*_inputs(1), varying=(7, 8))  # the second too, and keeps the direct launch
    assert len(compiled.slow) == 2
    for seed, varying in ((2, (-3, 9)), (3, (11, 0))):
        tensors, launched = _inputs(seed), len(compiled.slow)
        prepared(*tensors, varying=varying)
        assert len(compiled.slow) == launched  # direct
        direct = compiled.calls[-1]
        prepared._launch(tensors, varying)  # the same call through Triton's wrapper
        assert compiled.slow[-1] == (128, varying[0], 0.5, varying[1])
        expected = compiled.calls[-1]
        assert_launches_alike(direct, expected)
        # the TMA maps hold this call's addresses: after the 13 launch arguments, x_desc's map,
        # 2 dims and 2 strides, then n, Out, seed_lo, scale, seed_hi and y_desc's map
        x, out, y = tensors
        assert direct[13][:2] == ("tma", x.data_ptr()) and direct[19] == out.data_ptr()
        assert direct[23][:2] == ("tma", y.data_ptr())


def test_a_tma_map_is_encoded_once_per_address(compiled):
    """The direct launch encodes a descriptor argument's TMA map (a driver call) the first time
    it sees the tensor's address and reuses it after: a loop over the same buffers encodes
    nothing, new buffers get their own maps."""
    import triton

    utils = triton.runtime.driver.active.utils
    encoded, fill = [], utils.fill_tma_descriptor
    utils.fill_tma_descriptor = lambda address, *args: encoded.append(address) or fill(
        address, *args)
    x, out, y = _inputs(0)
    prepared = _prepared(x, y)
    for _ in range(2):  # through launch (Triton's wrapper encodes), then the direct launch
        prepared(x, out, y, varying=(1, 2))
    del encoded[:]
    for _ in range(3):
        prepared(x, out, y, varying=(1, 2))
    assert encoded == [x.data_ptr(), y.data_ptr()]
    x2, out2, y2 = _inputs(1)
    prepared(x2, out2, y2, varying=(1, 2))
    assert encoded[2:] == [x2.data_ptr(), y2.data_ptr()]
    assert compiled.calls[-1][13][:2] == ("tma", x2.data_ptr())
    prepared(x, out, y, varying=(1, 2))  # both addresses' maps are kept
    assert len(encoded) == 4 and compiled.calls[-1][13][:2] == ("tma", x.data_ptr())


def test_a_sized_descriptor_and_a_keyed_scalar_follow_each_call(compiled):
    """A sized descriptor takes its rows from each call's tensor, and a keyed scalar (one Triton
    specialises, the caller keeping a Prepared per specialisation) its value from each call:
    a decoding step's cache one key longer each call. The direct launch passes what Triton's
    launcher passes for a descriptor made over that tensor, with a map per address and rows."""
    import triton

    utils = triton.runtime.driver.active.utils
    encoded, fill = [], utils.fill_tma_descriptor
    utils.fill_tma_descriptor = lambda *args: encoded.append(args[:1] + args[5:6]) or fill(*args)
    x, out, y = _inputs(0)
    layout = tile_layout(64, 32, torch.bfloat16)
    prepared = launch_module.Prepared(
        _stand_in, (3, 2), (128, 0, 0.5, 0), dict(BLOCK=64, FLAG=True), TENSORS,
        {0: descriptor(x.view(-1, 128), (64, 32), layout),
         2: descriptor(y.view(-1, 64), (64, 32), layout)},
        ("seed_lo", "seed_hi", "n"), keyed=("n",), sized=(0,))
    for _ in range(3):  # through launch twice (the direct launch kept), then direct
        prepared(x, out, y, varying=(1, 2, 144))
    alive = [x]  # every tensor kept, so each new one has its own address
    for call, rows in enumerate((130, 130, 200, 130, 128)):
        x = torch.randn(rows, 4, 32).to(torch.bfloat16) if call != 1 else x  # 1: same tensor
        alive.append(x)
        launched, maps = len(compiled.slow), len(encoded)
        prepared(x, out, y, varying=(1, 2, 16 + rows))
        assert len(compiled.slow) == launched  # direct
        # a map per new (address, rows): x's of the same tensor again is kept, y's once
        assert encoded[maps:] == ([] if call == 1 else [(x.data_ptr(), [rows, 128])])
        direct = compiled.calls[-1]
        prepared._launch((x, out, y), (1, 2, 16 + rows))
        assert compiled.slow[-1] == (16 + rows, 1, 0.5, 2)
        assert_launches_alike(direct, compiled.calls[-1])
        assert direct[13][:2] == ("tma", x.data_ptr()) and direct[14:18] == (rows, 128, 128, 1)
        assert direct[18] == 16 + rows  # n


def test_a_new_alignment_or_dtype_goes_through_launch_again(compiled):
    x, out, y = _inputs(0)
    prepared = _prepared(x, y)
    for _ in range(3):
        prepared(x, out, y, varying=(1, 2))
    assert len(compiled.slow) == 2
    prepared(x, torch.empty(17)[1:], y, varying=(1, 2))  # out 4 bytes off 16-byte alignment
    assert len(compiled.slow) == 3
    prepared(x, torch.empty(16, dtype=torch.float64), y, varying=(1, 2))  # another dtype
    assert len(compiled.slow) == 4
    prepared(x, out, y, varying=(1, 2))  # the kept direct launch again
    assert len(compiled.slow) == 4


def _bundled_inputs(seed: int):
    """x (read through a descriptor), out and the bundle (float32, bf16), as a call passes
    them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 4, 32, generator=gen).to(torch.bfloat16)
    return x, torch.empty(16), (torch.randn(8, generator=gen),
                                torch.randn(8, generator=gen).to(torch.bfloat16))


def _bundled_prepared(x):
    descriptors = {0: descriptor(x.view(-1, 128), (64, 32), tile_layout(64, 32, torch.bfloat16))}
    return launch_module.Prepared(_bundled_stand_in, (3, 2), ((0.5, 16),), dict(BLOCK=64),
                                  ("x_desc", "Out", "Bundle"), descriptors)


def _nested_inputs(seed: int, count: int = 3):
    """x, out and a nested bundle ((two int32 lists, count, 1), 0, 0.5), as a call passes
    them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 4, 32, generator=gen).to(torch.bfloat16)
    lists = tuple(torch.randint(0, 9, (8,), generator=gen, dtype=torch.int32) for _ in range(2))
    return x, torch.empty(16), ((*lists, count, 1), 0, 0.5)


@pytest.mark.parametrize("kind", ["bundled", "nested"])
def test_the_direct_launch_passes_bundles_as_tritons_launcher_would(kind, request):
    """A bundle of tensors (a tuple, features.KernelFeatures.score_tensors), or a nested one of
    tensors and numbers (a user's modifiers: a block mask's lists with their sizes), is each
    call's own, a bundle of scalars fixed: the direct launch passes them as Triton's launcher
    would, tensors as their addresses."""
    compiled = request.getfixturevalue(f"compiled_{kind}")
    inputs = _bundled_inputs if kind == "bundled" else _nested_inputs
    x, out, bundle = inputs(0)
    prepared = _bundled_prepared(x)
    prepared(x, out, bundle)
    prepared(*inputs(1))
    assert len(compiled.slow) == 2
    tensors = inputs(2)
    prepared(*tensors)
    assert len(compiled.slow) == 2  # direct
    direct = compiled.calls[-1]
    prepared._launch(tensors, ())
    expected = compiled.calls[-1]
    assert_launches_alike(direct, expected)
    # after the 13 launch arguments, x_desc's map, 2 dims and 2 strides: Out, the two bundles
    assert direct[18] == tensors[1].data_ptr()
    assert direct[19] == _read(tensors[2]) and direct[20] == (0.5, 16)


def test_a_bundle_of_another_dtype_or_alignment_goes_through_launch_again(compiled_bundled):
    compiled = compiled_bundled
    x, out, (a, b) = _bundled_inputs(0)
    prepared = _bundled_prepared(x)
    for _ in range(3):
        prepared(x, out, (a, b))
    assert len(compiled.slow) == 2
    prepared(x, out, (torch.empty(17)[1:], b))  # 4 bytes off 16-byte alignment
    assert len(compiled.slow) == 3
    prepared(x, out, (a, b.float()))  # another dtype
    assert len(compiled.slow) == 4
    prepared(x, out, (a, b))  # the kept direct launch again
    assert len(compiled.slow) == 4


def test_a_nested_bundle_with_another_number_dtype_or_alignment_goes_through_launch(
        compiled_nested):
    """The direct launch was compiled for the bundle's numbers (Triton may specialise on
    them) and its tensors' dtypes and alignment: any other goes through launch."""
    compiled = compiled_nested
    x, out, ((a, b, count, one), zero, half) = _nested_inputs(0)
    prepared = _bundled_prepared(x)
    for _ in range(3):
        prepared(x, out, ((a, b, count, one), zero, half))
    assert len(compiled.slow) == 2
    for bundle in (((a, b, 4, one), zero, half), ((a, b, count, one), zero, 0.25),
                   ((a, b, count, one), 0.0, half), ((a, b.long(), count, one), zero, half),
                   ((a, torch.empty(9, dtype=torch.int32)[1:], count, one), zero, half),
                   ((a, b, count), zero, half)):
        launched = len(compiled.slow)
        prepared(x, out, bundle)
        assert len(compiled.slow) == launched + 1, bundle
    prepared(x, out, ((a, b, count, one), zero, half))  # the kept direct launch again
    assert len(compiled.slow) == launched + 1


def test_an_empty_bundle_goes_in_as_it_is_and_nothing_else_takes_its_place(compiled_empty):
    """An empty bundle (an absent feature's) is passed as it is, (), as Triton's launcher
    would, and not filled in each call; a call with anything else in its place goes through
    launch."""
    compiled = compiled_empty
    x, out, _ = _bundled_inputs(0)
    prepared = _bundled_prepared(x)
    for _ in range(3):
        prepared(x, out, ())
    assert len(compiled.slow) == 2  # the third direct
    direct = compiled.calls[-1]
    prepared._launch((x, out, ()), ())
    assert_launches_alike(direct, compiled.calls[-1])
    assert direct[19] == ()
    for other in ((torch.empty(8),), torch.empty(8)):
        launched = len(compiled.slow)
        prepared(x, out, other)
        assert len(compiled.slow) == launched + 1, other


def test_the_plan_keeps_no_tensor_alive():
    x, _, y = _inputs(0)
    alive = weakref.ref(x)
    prepared = _prepared(x, y)
    del x
    gc.collect()
    assert alive() is None
    assert all(d.base is None for d in prepared.descriptors.values())


def test_a_varying_scalar_must_not_be_specialised():
    x, _, y = _inputs(0)
    layout = tile_layout(64, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="do_not_specialize"):
        launch_module.Prepared(_stand_in, (1,), (128, 0, 0.5, 0), dict(BLOCK=64, FLAG=True),
                               TENSORS, {0: descriptor(x.view(-1, 128), (64, 32), layout)},
                               ("n",))


# --- on the GPU: the direct launches compute what the launches through Triton compute ---------


# (batch, seqlen, nheads, nheads_k, headdim, varlen lengths or None, flash_attn_func kwargs)
PLANNED = {
    "causal d128": (2, 256, 8, 2, 128, None, dict(causal=True)),
    "window, softcap, ALiBi, sink d64": (2, 256, 4, 2, 64, None, dict(
        window_size=(64, 0), softcap=20.0, alibi=True, sink=True)),
    "dropout": (1, 256, 4, 4, 64, None, dict(causal=True, dropout_p=0.2)),
    "odd lengths (the Gluon backward as varlen)": (2, 200, 4, 4, 128, None, {}),
    "d256": (1, 256, 4, 4, 256, None, dict(causal=True)),
    "varlen": (None, None, 4, 2, 128, [100, 0, 257, 31], dict(causal=True, sink=True)),
}


def _planned_step(case: str, seed: int, draw: int) -> list:
    """out, lse and the gradients of one step of `case` on inputs drawn with `draw` (new
    tensors at new addresses), its dropout seed drawn from torch.manual_seed(seed)."""
    batch, seqlen, nheads, nheads_k, headdim, lengths, kwargs = PLANNED[case]
    kwargs = dict(kwargs)
    gen = torch.Generator().manual_seed(draw)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16).requires_grad_()

    if lengths is None:
        q, k, v = (randn(batch, seqlen, h, headdim) for h in (nheads, nheads_k, nheads_k))
    else:
        q, k, v = (randn(sum(lengths), h, headdim) for h in (nheads, nheads_k, nheads_k))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
    leaves = [q, k, v]
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(nheads, generator=gen).cuda() * 0.5 + 0.1
    if kwargs.pop("sink", False):
        kwargs["sink"] = torch.randn(nheads, generator=gen).cuda().requires_grad_()
        leaves.append(kwargs["sink"])
    torch.manual_seed(seed)
    if lengths is None:
        out, lse = flashkit.flash_attn_func(q, k, v, return_softmax_lse=True, **kwargs)
    else:
        out, lse = flashkit.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths),
                                                   return_softmax_lse=True, **kwargs)
    grads = torch.autograd.grad((out * torch.randn(out.shape, generator=gen).to(out)).sum(),
                                leaves)
    return [out, lse, *grads]


_KEYS_IN_ORDER = """
import importlib, json, sys
from flashkit.ops.triton import launch
names = sys.argv[1].split(",")
kernels = {name: getattr(importlib.import_module("flashkit.ops.triton." + name.split(".")[0]),
                         name.split(".")[1]) for name in names}
for name in names:  # this process's order of first compiles
    launch.settle_cache_keys(kernels[name])
print(json.dumps({name: kernel.cache_key for name, kernel in kernels.items()}))
"""


def test_kernel_cache_keys_do_not_depend_on_the_order_of_first_compiles():
    """Triton keys a kernel with what its helpers' own keys have found so far, so two portable
    kernels sharing helpers get other keys when hashed in the other order (and a process that
    compiles in another order misses the disk cache). settle_cache_keys keys the helpers first:
    every order gives the same keys, compiled for the GPU (not the interpreter)."""
    import json
    import os
    import subprocess
    import sys

    names = ["forward._fwd_kernel", "backward._bwd_kernel", "forward_hopper._fwd_hopper_kernel",
             "decode._decode_kernel"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    keys = [json.loads(subprocess.run([sys.executable, "-c", _KEYS_IN_ORDER, ",".join(order)],
                                      env=env, check=True, capture_output=True,
                                      text=True).stdout)
            for order in (names, names[::-1], names[1:] + names[:1])]
    assert keys[0] == keys[1] == keys[2]
    assert len(set(keys[0].values())) == len(names)



@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", list(PLANNED))
def test_gpu_direct_launches_equal_the_launches_through_triton(case):
    dispatch.forget_plans()
    for draw in (1, 2):  # a key's first two calls go through launch; the second keeps it
        _planned_step(case, seed=draw, draw=draw)
    kept = [p for plan in dispatch._plans.values() for p in plan.launches.values()
            if isinstance(p, launch_module.Prepared)]  # (not the entry point's kept plans)
    assert kept and all(p._direct for p in kept)
    direct = _planned_step(case, seed=7, draw=3)  # new tensors and seed: the direct launches
    dispatch.forget_plans()
    through = _planned_step(case, seed=7, draw=3)  # the same call through Triton's launcher
    for got, want in zip(direct, through, strict=True):
        assert torch.equal(got, want)


# (batch, nheads, nheads_k, capacity, filled, page size or None, num_splits, flash_attn_with_kvcache
# kwargs): decoding steps (one new token) and a longer query block (the append, then attention)
DECODED = {
    "step": (2, 16, 4, 1024, 700, None, 0, dict(causal=True)),
    "step, paged, split": (2, 16, 4, 1024, 900, 64, 3, dict(causal=True)),
    "step, rotary, sink": (1, 8, 8, 512, 300, None, 1, dict(rotary=True, sink=True)),
    "16 queries": (2, 8, 2, 1024, 500, None, 0, dict(causal=True, seqlen_q=16)),
}


def _decoded(case: str, draw: int) -> list:
    """out, lse and the caches after a flash_attn_with_kvcache call of `case` on inputs drawn
    with `draw` (the caches new tensors each draw)."""
    batch, nheads, nheads_k, capacity, filled, page, splits, kwargs = DECODED[case]
    kwargs = dict(kwargs)
    gen = torch.Generator().manual_seed(draw)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)

    seqlen_q = kwargs.pop("seqlen_q", 1)
    q, k, v = randn(batch, seqlen_q, nheads, 128), *(randn(batch, seqlen_q, nheads_k, 128)
                                                      for _ in range(2))
    if page is None:
        k_cache, v_cache = (randn(batch, capacity, nheads_k, 128) for _ in range(2))
    else:
        pages = batch * capacity // page
        k_cache, v_cache = (randn(pages, page, nheads_k, 128) for _ in range(2))
        kwargs["block_table"] = torch.randperm(pages, generator=gen).view(batch, -1).to(
            "cuda", torch.int32)
    if kwargs.pop("rotary", False):
        angles = torch.rand(capacity, 32, generator=gen).cuda() * 6.28
        kwargs.update(rotary_cos=angles.cos().to(torch.bfloat16),
                      rotary_sin=angles.sin().to(torch.bfloat16))
    if kwargs.pop("sink", False):
        kwargs["sink"] = torch.randn(nheads, generator=gen).cuda()
    lengths = torch.full((batch,), filled, dtype=torch.int32, device="cuda")
    out, lse = flashkit.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                                num_splits=splits, return_softmax_lse=True,
                                                **kwargs)
    return [out, lse, k_cache, v_cache]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", list(DECODED))
def test_gpu_direct_decoding_equals_the_launches_through_triton(case):
    dispatch.forget_plans()
    for draw in (1, 2):
        _decoded(case, draw)
    kept = [p for plan in dispatch._plans.values() for p in plan.launches.values()
            if isinstance(p, launch_module.Prepared)]
    assert kept and all(p._direct for p in kept)
    direct = _decoded(case, 3)
    dispatch.forget_plans()
    through = _decoded(case, 3)
    for got, want in zip(direct, through, strict=True):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
def test_gpu_reused_buffers_with_new_values_give_each_steps_results():
    """A training-like loop over the same buffers (new values copied in every step, so the
    direct launches find their TMA maps encoded for those addresses already) gives each step's
    own outputs and gradients: bitwise those of the same call on fresh copies (new addresses,
    newly encoded maps)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.empty(2, 256, 4, 128, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    for _ in range(3):
        with torch.no_grad():
            for buffer in (q, k, v, dout):
                buffer.copy_(torch.randn(buffer.shape, generator=gen, device="cuda"))
        out = flashkit.flash_attn_func(*leaves, causal=True)
        grads = torch.autograd.grad(out, leaves, dout)
        fresh = [x.detach().clone().requires_grad_() for x in leaves]
        out_fresh = flashkit.flash_attn_func(*fresh, causal=True)
        grads_fresh = torch.autograd.grad(out_fresh, fresh, dout.clone())
        assert torch.equal(out, out_fresh)
        for got, want in zip(grads, grads_fresh, strict=True):
            assert torch.equal(got, want)
