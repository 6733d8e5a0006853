"""``MXFP8Tensor``: row/col payloads versus the numerics reference, select, refresh, dim-0 rules."""
import pytest
import torch

from te_npu.formats import Format
from te_npu.numerics import mxfp8
from te_npu.quantizers import MXFP8Quantizer
from te_npu.tensor import MXFP8Tensor

SHAPES = [pytest.param((64, 96), id="dense"), pytest.param((3, 64, 32), id="grouped")]


@pytest.mark.parametrize("shape", SHAPES)
def test_mxfp8_tensor_holds_row_col_pairs_versus_reference(make_weight, shape):
    w = make_weight(*shape)
    t = MXFP8Tensor.from_high_precision(w)
    *lead, n, k = shape
    assert (t.shape, t.dtype, t.device) == (w.shape, torch.bfloat16, w.device)
    assert (t.row_data.dtype, t.col_data.dtype) == (torch.float8_e4m3fn, torch.float8_e4m3fn)
    assert (t.row_scale.dtype, t.col_scale.dtype) == (torch.uint8, torch.uint8)  # E8M0 codes
    assert list(t.row_data.shape) == list(t.col_data.shape) == [*lead, n, k]
    assert list(t.row_scale.shape) == [*lead, n, k // 32]
    assert list(t.col_scale.shape) == [*lead, n // 32, k]
    expected = mxfp8.quantize_dual(w)
    for got, want in zip((t.row_data, t.row_scale, t.col_data, t.col_scale), expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("shape", SHAPES)
def test_mxfp8_tensor_select_returns_stored_storage(make_weight, shape):
    t = MXFP8Tensor.from_high_precision(make_weight(*shape))
    for orientation, data, scale in (("row", t.row_data, t.row_scale), ("col", t.col_data, t.col_scale)):
        op = t.select(orientation)
        assert op.data is data and op.scale is scale
        assert op.data.data_ptr() == data.data_ptr()
        assert (op.orientation, op.format, op.logical_dtype) == (orientation, Format.MXFP8_E4M3, torch.bfloat16)


def test_mxfp8_tensor_select_rejects_unknown_orientation(make_weight):
    t = MXFP8Tensor.from_high_precision(make_weight(64, 64))
    with pytest.raises(ValueError, match="orientation"):
        t.select("diag")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [None, torch.float32], ids=["logical", "fp32"])
def test_mxfp8_tensor_dequantize_equals_numerics_bitwise(make_weight, shape, dtype):
    t = MXFP8Tensor.from_high_precision(make_weight(*shape))
    want = mxfp8.dequantize(t.row_data, t.row_scale, axis=-1).to(dtype or torch.bfloat16)
    got = t.dequantize(dtype)
    assert got.dtype == want.dtype and type(got) is torch.Tensor
    assert torch.equal(got, want)


@pytest.mark.parametrize("shape", SHAPES)
def test_mxfp8_tensor_refresh_from_master_updates_in_place(make_weight, shape):
    t = MXFP8Tensor.from_high_precision(make_weight(*shape))
    ptrs = [x.data_ptr() for x in t._inner().values()]
    held = t.select("col")  # a reference held elsewhere (e.g. by a saved operand)
    master = make_weight(*shape, dtype=torch.float32)
    assert t.shared_scale_amax(master) is None  # MX scales never span shards
    with pytest.raises(ValueError, match="no scale shared"):
        t.refresh_from_master(master, amax=torch.tensor(1.0))
    t.refresh_from_master(master)
    assert [x.data_ptr() for x in t._inner().values()] == ptrs
    fresh = MXFP8Tensor.from_high_precision(master)
    for name in t._inner_fields:
        assert torch.equal(getattr(t, name).view(torch.uint8), getattr(fresh, name).view(torch.uint8)), name
    assert torch.equal(held.data.view(torch.uint8), fresh.col_data.view(torch.uint8))


def test_mxfp8_tensor_refresh_rejects_other_shape(make_weight):
    t = MXFP8Tensor.from_high_precision(make_weight(64, 64))
    with pytest.raises(ValueError, match="master shape"):
        t.refresh_from_master(torch.zeros(32, 64))


def test_mxfp8_tensor_keeps_quantizer_scale_alg(make_weight):
    w = make_weight(64, 64)
    t = MXFP8Tensor.from_high_precision(w, MXFP8Quantizer(scale_alg="ceil"))
    assert torch.equal(t.row_scale, mxfp8.quantize(w, axis=-1, scale_alg="ceil")[1])
    chunk = torch.chunk(t, 2)[0]
    assert chunk._quantizer.scale_alg == "ceil"


@pytest.mark.parametrize("sizes", [[32, 96], [64, 64], [96, 32]], ids=str)
def test_mxfp8_tensor_dense_split_on_32_row_blocks(make_weight, sizes):
    t = MXFP8Tensor.from_high_precision(make_weight(128, 64))
    chunks = torch.split(t, sizes)
    assert [c.shape[0] for c in chunks] == sizes and all(type(c) is MXFP8Tensor for c in chunks)
    for c, start in zip(chunks, [0, sizes[0]]):
        assert c.col_scale.shape[0] == c.shape[0] // 32
        assert c.row_data.data_ptr() == t.row_data[start:].data_ptr()  # a view, not a copy
    for name in t._inner_fields:
        joined = torch.cat([getattr(c, name).view(torch.uint8) for c in chunks])
        assert torch.equal(joined, getattr(t, name).view(torch.uint8)), name


@pytest.mark.parametrize(
    "rows, cut, boundary",
    [
        pytest.param(128, lambda t: torch.split(t, [48, 80]), 48, id="split_with_sizes"),
        pytest.param(192, lambda t: torch.chunk(t, 4), 48, id="chunk"),
        pytest.param(128, lambda t: t.narrow(0, 16, 64), 16, id="narrow"),
        pytest.param(128, lambda t: t[0:40], 40, id="slice"),
    ],
)
def test_mxfp8_tensor_dense_split_off_block_raises_naming_boundary(make_weight, rows, cut, boundary):
    t = MXFP8Tensor.from_high_precision(make_weight(rows, 64))
    with pytest.raises(ValueError, match=rf"\[{rows}, 64\].*boundary {boundary} is not a multiple of 32"):
        cut(t)


def test_mxfp8_tensor_grouped_splits_along_experts(make_weight):
    t = MXFP8Tensor.from_high_precision(make_weight(4, 64, 32))
    chunks = torch.chunk(t, 2)
    assert [list(c.shape) for c in chunks] == [[2, 64, 32], [2, 64, 32]]
    for i, c in enumerate(chunks):
        for name in t._inner_fields:
            assert torch.equal(getattr(c, name).view(torch.uint8), getattr(t, name)[2 * i : 2 * i + 2].view(torch.uint8))
    odd = t[1:2]  # one expert: always legal along experts
    assert list(odd.col_scale.shape) == [1, 2, 32]
