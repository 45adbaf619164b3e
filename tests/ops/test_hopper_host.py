"""The host side of the sm_90 Gluon kernels on any machine: their TMA descriptors (the
launchers' arguments against the kernels' signatures: tests/ops/test_features.py)."""

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
