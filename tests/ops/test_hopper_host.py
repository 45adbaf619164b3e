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


def test_a_new_length_reuses_its_geometry_check(monkeypatch):
    """What TensorDescriptor checks does not depend on the dims' sizes, only on whether they are
    positive: a base one row longer (a decoding step's cache) takes no new check; an empty one
    does, and is refused."""
    layout = hopper_common.tile_layout(64, 64, torch.bfloat16)
    hopper_common.descriptor(torch.randn(300, 64, dtype=torch.bfloat16), (64, 64), layout)
    checked = []

    class Counting(TensorDescriptor):
        def __post_init__(self):
            checked.append(self.shape)
            super().__post_init__()

    monkeypatch.setattr(hopper_common, "TensorDescriptor", Counting)
    desc = hopper_common.descriptor(torch.randn(301, 64, dtype=torch.bfloat16), (64, 64), layout)
    assert checked == [] and desc.shape == [301, 64]
    with pytest.raises(AssertionError, match="positive"):
        hopper_common.descriptor(torch.empty(0, 64, dtype=torch.bfloat16), (64, 64), layout)
    assert checked == [[0, 64]]


def test_heads_major_tensors_are_read_through_their_own_2d_view():
    """SDPA's (batch, heads, seqlen, d) memory seen as (batch, seqlen, heads, d) is read in
    place: its 2-D view (batch * heads * seqlen, d) holds (b, s, h) at row b * rows_b + h *
    rows_h + s, column h * cols_h (view_geometry), as the flash layout's (tokens, heads * d)
    does; a descriptor rebased on the tensor itself (launch._rebased, what a prepared launch
    does) views the same memory. So are q, k, v unbound from one packed qkv (dense and
    varlen): rows 3 * heads * d apart. A sliced head dim, batch entries not a whole number of
    rows apart and a tensor off 16 bytes are not read in place."""
    from flashkit.ops.triton.launch import _rebased

    b, s, h, d = 2, 48, 3, 64
    flash = torch.randn(b, s, h, d, dtype=torch.bfloat16)
    heads_major = flash.transpose(1, 2).contiguous().transpose(1, 2)
    for x in (flash, heads_major):
        assert hopper_common.tma_layout(x)
        assert hopper_common.heads_major(x) == (x is heads_major)
        view = hopper_common.view_2d(x)
        assert view.data_ptr() == x.data_ptr() and view.is_contiguous()
        rows_b, rows_h, cols_h = hopper_common.view_geometry(x)
        for bi, si, hi in ((0, 0, 0), (1, 47, 2), (1, 5, 1)):
            row, col = bi * rows_b + hi * rows_h + si, hi * cols_h
            assert torch.equal(view[row, col:col + d], x[bi, si, hi])
        desc = hopper_common.flash_descriptor(x, 64)
        assert list(desc.shape) == list(view.shape)
        rebased = _rebased(desc, x)
        assert rebased.base.data_ptr() == x.data_ptr()
        assert torch.equal(rebased.base, view)
    varlen = flash.view(b * s, h, d)
    assert hopper_common.view_geometry(varlen) == (0, 0, d)
    assert hopper_common.view_geometry(heads_major) == (h * s, s, 0)
    # q, k, v unbound from one packed tensor: tokens 3 * h * d apart, read in place too
    qkv = torch.randn(b, s, 3, h, d, dtype=torch.bfloat16)
    for x in (*qkv.unbind(2), *qkv.view(b * s, 3, h, d).unbind(1)):
        assert hopper_common.token_rows(x) and hopper_common.tma_layout(x)
        view = hopper_common.view_2d(x)
        assert view.data_ptr() == x.data_ptr() and view.stride() == (3 * h * d, 1)
        assert torch.equal(view.view(-1, h, d), x.reshape(-1, h, d))
        assert hopper_common.view_geometry(x) == ((s if x.dim() == 4 else 0), 0, d)
        assert torch.equal(_rebased(hopper_common.flash_descriptor(x, 64), x).base, view)
    sliced = torch.randn(b, s, h, 2 * d)[..., :d]
    unaligned = torch.randn(b * s * h * d + 1, dtype=torch.bfloat16)[1:].view(b, h, s, d)
    gapped = torch.randn(b, s + 1, h, d)[:, :s]  # batch entries a token apart: no even rows
    for x in (sliced, unaligned.transpose(1, 2), gapped):
        assert not hopper_common.tma_layout(x)
