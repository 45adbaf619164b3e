"""The host side of the sm_90 Gluon kernels on any machine: their TMA descriptors, and the
arguments their launchers pass (checked against the kernels' signatures without a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from flashkit.ops.triton import hopper_common  # noqa: E402


def _fields(desc) -> dict:
    return {f.name: getattr(desc, f.name) for f in dataclasses.fields(TensorDescriptor)}


@pytest.mark.parametrize("rows, box_rows", [(128, None), (64, 16)])
def test_flash_descriptor_equals_a_checked_one(rows, box_rows):
    """Made without TensorDescriptor's checks after the first of a geometry: the same fields as
    a descriptor made with them, each call, for each tensor."""
    for _ in range(2):
        x = torch.randn(2, 256, 4, 64, dtype=torch.bfloat16)
        fast = hopper_common.flash_descriptor(x, rows, box_rows)
        x2d = x.view(-1, 256)
        checked = TensorDescriptor(x2d, [512, 256], [256, 1], [box_rows or rows, 64],
                                   hopper_common.tile_layout(rows, 64, x.dtype))
        assert type(fast) is TensorDescriptor
        got, want = _fields(fast), _fields(checked)
        assert got.pop("base").data_ptr() == want.pop("base").data_ptr()
        assert got == want


def test_rows_descriptor_reads_lse_as_one_row():
    lse = torch.randn(2, 4, 256)
    desc = hopper_common.rows_descriptor(lse, 64)
    assert desc.shape == [2048] and desc.strides == [1] and desc.block_shape == [64]
    assert desc.base.data_ptr() == lse.data_ptr()


def test_a_bad_geometry_still_raises():
    """The check runs for every new geometry: a block that is not a power of two, or a row
    stride that is not 16-byte aligned, is refused as TensorDescriptor refuses it."""
    layout = hopper_common.tile_layout(64, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="power of 2"):
        hopper_common.descriptor(torch.randn(256, 64, dtype=torch.bfloat16), (48, 64), layout)
    with pytest.raises(AssertionError, match="16-byte"):
        hopper_common.descriptor(torch.randn(256, 68, dtype=torch.bfloat16), (64, 64), layout)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_launchers_match_the_kernel_signatures(causal, monkeypatch):
    """The Gluon dK/dV and dQ launchers pass their tensors (any order), scalars and constexprs
    as launch() needs them: constexprs in signature order after the runtime arguments."""
    from flashkit.ops.params import AttentionParams
    from flashkit.ops.triton import backward_hopper, launch

    launched = []

    def record(kernel, grid, tensors, scalars, constexprs, tensor_params=(), **options):
        order = launch._order(kernel, tensor_params, len(tensors), len(scalars))
        launch._check_constexpr_order(kernel, len(tensors) + len(scalars), constexprs)
        launched.append((kernel.__name__, len(order(tensors + scalars))))

    monkeypatch.setattr(backward_hopper, "launch", record)
    q, k, v, dout = (torch.randn(2, 256, 4, 64, dtype=torch.bfloat16) for _ in range(4))
    lse, delta = torch.randn(2, 4, 256), torch.randn(2, 4, 256)
    params = AttentionParams(0.125, None, 0 if causal else None)
    backward_hopper.attention_backward_dkdv(dout, q, k, v, lse, delta, params,
                                            torch.empty_like(k), torch.empty_like(v))
    backward_hopper.attention_backward_dq(dout, q, k, v, lse, delta, params,
                                          torch.empty_like(q))
    assert [name for name, _ in launched] == ["_bwd_dkdv_hopper_kernel", "_bwd_dq_hopper_kernel"]
