"""``HiF8Tensor``: one payload for both orientations, FP32 scales ([] dense, [E] per expert)."""
import pytest
import torch

from te_npu.formats import Format
from te_npu.numerics import hif8
from te_npu.numerics.constants import HIF8_INPUT_MAX
from te_npu.quantizers import HiF8Quantizer
from te_npu.tensor import HiF8Tensor

SHAPES = [pytest.param((64, 96), id="dense"), pytest.param((3, 64, 32), id="grouped")]


def _amax(w: torch.Tensor) -> torch.Tensor:
    return w.float().abs().amax(dim=(1, 2)) if w.dim() == 3 else w.float().abs().amax()


@pytest.mark.parametrize("shape", SHAPES)
def test_hif8_tensor_holds_codes_and_fp32_scale_versus_reference(make_weight, shape):
    w = make_weight(*shape)
    t = HiF8Tensor.from_high_precision(w)
    assert (t.shape, t.dtype) == (w.shape, torch.bfloat16)
    assert (t.qdata.dtype, list(t.qdata.shape)) == (torch.uint8, list(shape))
    assert (t.scale.dtype, list(t.scale.shape)) == (torch.float32, list(shape[:1]) if len(shape) == 3 else [])
    want_scale = hif8.current_scale(_amax(w), HIF8_INPUT_MAX)
    assert torch.equal(t.scale, want_scale)
    assert torch.equal(t.qdata, hif8.quantize(w, want_scale))


def test_hif8_tensor_grouped_scales_follow_expert_order(make_weight):
    experts = [make_weight(32, 64) * (2.0**e) for e in (3, -2, 0, 5)]  # distinct amax per expert
    t = HiF8Tensor.from_high_precision(torch.stack(experts))
    for e, w_e in enumerate(experts):
        assert t.scale[e] == hif8.current_scale(w_e.float().abs().amax(), HIF8_INPUT_MAX)
        assert torch.equal(t.qdata[e], HiF8Tensor.from_high_precision(w_e).qdata)


@pytest.mark.parametrize("shape", SHAPES)
def test_hif8_tensor_select_shares_one_payload_for_row_and_col(make_weight, shape):
    t = HiF8Tensor.from_high_precision(make_weight(*shape))
    row, col = t.select("row"), t.select("col")
    assert row.data is col.data is t.qdata and row.scale is col.scale is t.scale
    assert row.data.data_ptr() == col.data.data_ptr() == t.qdata.data_ptr()
    assert (row.orientation, col.orientation) == ("row", "col")
    assert row.format == col.format == Format.HIF8 and row.logical_dtype == torch.bfloat16


@pytest.mark.parametrize("shape", SHAPES)
def test_hif8_tensor_dequantize_equals_numerics_bitwise(make_weight, shape):
    t = HiF8Tensor.from_high_precision(make_weight(*shape))
    want = hif8.dequantize(t.qdata, t.scale)
    assert torch.equal(t.dequantize(torch.float32), want)
    assert torch.equal(t.dequantize(), want.to(torch.bfloat16))


@pytest.mark.parametrize("shape", SHAPES)
def test_hif8_tensor_refresh_from_master_current_scaling_in_place(make_weight, shape):
    t = HiF8Tensor.from_high_precision(make_weight(*shape))
    ptrs = (t.qdata.data_ptr(), t.scale.data_ptr())
    master = make_weight(*shape, dtype=torch.float32) * 3
    t.refresh_from_master(master)
    assert (t.qdata.data_ptr(), t.scale.data_ptr()) == ptrs
    fresh = HiF8Tensor.from_high_precision(master)
    assert torch.equal(t.qdata, fresh.qdata) and torch.equal(t.scale, fresh.scale)


def test_hif8_tensor_dense_refresh_quantizes_with_the_reduced_amax(make_weight):
    t = HiF8Tensor.from_high_precision(make_weight(64, 32))
    master = make_weight(64, 32, dtype=torch.float32)
    assert torch.equal(t.shared_scale_amax(master), _amax(master))  # the shard's own FP32 amax
    group_amax = torch.tensor(112.5)  # e.g. the FSDP-group MAX of the shards' amaxes
    t.refresh_from_master(master, amax=group_amax)
    group_scale = hif8.current_scale(group_amax, HIF8_INPUT_MAX)
    assert torch.equal(t.scale, group_scale)
    assert torch.equal(t.qdata, hif8.quantize(master, group_scale))


def test_hif8_tensor_grouped_refresh_keeps_per_expert_scales_local(make_weight):
    t = HiF8Tensor.from_high_precision(make_weight(2, 32, 32))
    master = make_weight(2, 32, 32, dtype=torch.float32)
    assert t.shared_scale_amax(master) is None  # per-expert scales of whole experts need no other shard
    with pytest.raises(ValueError, match="per-expert scales"):
        t.refresh_from_master(master, amax=torch.tensor(1.0))
    t.refresh_from_master(master)
    fresh = HiF8Tensor.from_high_precision(master)
    assert torch.equal(t.qdata, fresh.qdata) and torch.equal(t.scale, fresh.scale)


def test_hif8_tensor_from_high_precision_with_scale_and_quantizer(make_weight):
    w = make_weight(32, 32)
    t = HiF8Tensor.from_high_precision(w, HiF8Quantizer(224.0), scale=torch.tensor(0.5))
    assert t.scale.item() == 0.5 and torch.equal(t.qdata, hif8.quantize(w, torch.tensor(0.5)))
    assert HiF8Tensor.from_high_precision(w, HiF8Quantizer(224.0)).scale == hif8.current_scale(w.float().abs().amax(), 224.0)


def test_hif8_tensor_dense_split_shares_the_scalar_scale(make_weight):
    t = HiF8Tensor.from_high_precision(make_weight(96, 32))
    chunks = torch.split(t, [40, 56])  # any row boundary is legal for HiF8
    assert all(c.scale is t.scale for c in chunks)
    assert torch.equal(torch.cat([c.qdata for c in chunks]), t.qdata)


def test_hif8_tensor_grouped_split_moves_scale_with_experts(make_weight):
    t = HiF8Tensor.from_high_precision(make_weight(4, 32, 32))
    chunks = torch.chunk(t, 2)
    assert torch.equal(torch.cat([c.scale for c in chunks]), t.scale)
    assert torch.equal(torch.cat([c.qdata for c in chunks]), t.qdata)
    assert [list(c.scale.shape) for c in chunks] == [[2], [2]]


@pytest.mark.parametrize("shape", SHAPES)
def test_hif8_refresh_reports_the_amax_its_scale_came_from(make_weight, shape):
    from te_npu.events import QuantEvent, subscribe

    t = HiF8Tensor.from_high_precision(make_weight(*shape))
    master = make_weight(*shape, dtype=torch.float32)
    # dense: the FSDP-group MAX, larger than this shard's; grouped: each expert's own amax
    amax = _amax(master) * 3 if len(shape) == 2 else _amax(master)
    events = []
    with subscribe(events.append):
        t.refresh_from_master(master, amax=amax if len(shape) == 2 else None)
    (event,) = [e for e in events if isinstance(e, QuantEvent)]
    assert event.format == Format.HIF8.value and event.shape == shape
    assert event.format_max == HIF8_INPUT_MAX and torch.equal(event.amax, amax)
    assert torch.equal(event.scale, hif8.current_scale(amax, HIF8_INPUT_MAX)) and torch.equal(event.scale, t.scale)
