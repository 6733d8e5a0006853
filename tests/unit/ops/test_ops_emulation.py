"""Emulated GEMMs versus an independent reference: numerics dequantize + FP32 matmul."""
from __future__ import annotations

import pytest
import torch

from te_npu.formats import Format
from te_npu.numerics import hif8, mxfp8
from te_npu.events import GemmEvent, QuantEvent, subscribe
from te_npu.ops import low_precision_grouped_matmul, low_precision_matmul
from te_npu.quantizers import HiF8Quantizer, MXFP8Quantizer

FORMATS = [Format.MXFP8_E4M3, Format.HIF8]
OUT_DTYPES = [torch.float32, torch.bfloat16]
# (left orientation, right orientation) per layout, as the GEMM contract requires
ORIENT = {"NT": ("row", "row"), "NN": ("row", "col"), "TN": ("col", "col")}


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def _rand(gen, *shape):
    return (torch.randn(*shape, generator=gen) * 3).to(torch.bfloat16)


def _quantizer(fmt):
    return MXFP8Quantizer() if fmt == Format.MXFP8_E4M3 else HiF8Quantizer(15.0)


def _ref_value(op, group_sizes=None):
    """Independent reference decode: numerics dequantize (MXFP8) / HiF8 codes only (the
    contract applies HiF8 scales to the FP32 product, the kernels' order: (P * right.scale) * left.scale)."""
    if op.format == Format.HIF8:
        return hif8.decode(op.data)
    if op.group_sizes is not None:
        return mxfp8.dequantize_grouped(op.data, op.scale, op.group_sizes)
    return mxfp8.dequantize(op.data, op.scale, axis=-1 if op.orientation == "row" else -2)


def _assert_close(actual, expected, out_dtype):
    tol = {} if out_dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(actual, expected.to(out_dtype), **tol)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_dense_matmul_versus_reference(gen, fmt, layout, out_dtype):
    M, N, K = 64, 96, 128
    q = _quantizer(fmt)
    lo, ro = ORIENT[layout]
    if layout == "NT":
        left, right = q.quantize(_rand(gen, M, K), orientation=lo), q.quantize(_rand(gen, N, K), orientation=ro)
        expected = _ref_value(left) @ _ref_value(right).t()
    elif layout == "NN":
        left, right = q.quantize(_rand(gen, M, N), orientation=lo), q.quantize(_rand(gen, N, K), orientation=ro)
        expected = _ref_value(left) @ _ref_value(right)
    else:
        left, right = q.quantize(_rand(gen, M, N), orientation=lo), q.quantize(_rand(gen, M, K), orientation=ro)
        expected = _ref_value(left).t() @ _ref_value(right)
    if fmt == Format.HIF8:
        expected = expected * right.scale * left.scale
    out = low_precision_matmul(left, right, layout=layout, output_dtype=out_dtype)
    assert out.dtype == out_dtype
    _assert_close(out, expected, out_dtype)


GROUPS = {
    "uneven": [5, 0, 40, 19],
    "one_group": [64],
    "empty_groups": [0, 33, 0],
    "non_multiple_32": [31, 1, 70],
}


def _grouped_operands(gen, fmt, layout, sizes):
    T, N, K = sum(sizes), 64, 96
    G = len(sizes)
    group_list = torch.tensor(sizes, dtype=torch.int64)
    if fmt == Format.MXFP8_E4M3:
        q = MXFP8Quantizer()
        quant_w = lambda w, o: q.quantize(w, orientation=o)  # noqa: E731
    else:
        q = HiF8Quantizer(15.0)
        quant_w = lambda w, o: q.quantize(w, orientation=o)  # noqa: E731
    if layout == "NT":
        left, right = q.quantize(_rand(gen, T, K), orientation="row"), quant_w(_rand(gen, G, N, K), "row")
    elif layout == "NN":
        left, right = q.quantize(_rand(gen, T, N), orientation="row"), quant_w(_rand(gen, G, N, K), "col")
    else:
        left = q.quantize(_rand(gen, T, N), orientation="col", group_list=group_list)
        right = q.quantize(_rand(gen, T, K), orientation="col", group_list=group_list)
    return left, right, group_list


def _grouped_reference(left, right, group_list, layout):
    a, b = _ref_value(left), _ref_value(right)
    sizes = group_list.tolist()
    hifloat = left.format == Format.HIF8
    if layout == "TN":
        out = torch.stack([x.t() @ y for x, y in zip(torch.split(a, sizes), torch.split(b, sizes))])
        return out * right.scale * left.scale if hifloat else out
    rows = []
    for g, chunk in enumerate(torch.split(a, sizes)):
        row = chunk @ (b[g].t() if layout == "NT" else b[g])
        rows.append(row * right.scale[g] * left.scale if hifloat else row)
    return torch.cat(rows)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("groups", list(GROUPS), ids=str)
@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_grouped_matmul_versus_reference(gen, fmt, layout, groups, out_dtype):
    left, right, group_list = _grouped_operands(gen, fmt, layout, GROUPS[groups])
    out = low_precision_grouped_matmul(left, right, group_list, layout=layout, output_dtype=out_dtype)
    expected = _grouped_reference(left, right, group_list, layout)
    assert out.shape == expected.shape and out.dtype == out_dtype
    _assert_close(out, expected, out_dtype)
    if layout == "TN":
        for g, size in enumerate(GROUPS[groups]):
            if size == 0:
                assert torch.count_nonzero(out[g]) == 0


@pytest.mark.parametrize("layout,bad", [("NT", ("row", "col")), ("NN", ("row", "row")), ("TN", ("row", "col"))])
def test_matmul_wrong_mxfp8_orientation_raises(gen, layout, bad):
    q = MXFP8Quantizer()
    left = q.quantize(_rand(gen, 64, 64), orientation=bad[0])
    right = q.quantize(_rand(gen, 64, 64), orientation=bad[1])
    with pytest.raises(ValueError, match="reduction dim"):
        low_precision_matmul(left, right, layout=layout, output_dtype=torch.float32)


def test_matmul_mismatched_formats_raise(gen):
    left = MXFP8Quantizer().quantize(_rand(gen, 32, 64), orientation="row")
    right = HiF8Quantizer(15.0).quantize(_rand(gen, 32, 64), orientation="row")
    with pytest.raises(ValueError, match="formats differ"):
        low_precision_matmul(left, right, layout="NT", output_dtype=torch.float32)


def test_matmul_shape_error_names_shapes(gen):
    q = HiF8Quantizer(15.0)
    left, right = q.quantize(_rand(gen, 32, 64), orientation="row"), q.quantize(_rand(gen, 16, 96), orientation="row")
    with pytest.raises(ValueError, match=r"\(32, 64\).*\(16, 96\)"):
        low_precision_matmul(left, right, layout="NT", output_dtype=torch.float32)


def test_matmul_bad_layout_and_output_dtype_raise(gen):
    q = HiF8Quantizer(15.0)
    op = q.quantize(_rand(gen, 32, 32), orientation="row")
    with pytest.raises(ValueError, match="layout"):
        low_precision_matmul(op, op, layout="TT", output_dtype=torch.float32)
    with pytest.raises(ValueError, match="output_dtype"):
        low_precision_matmul(op, op, layout="NT", output_dtype=torch.int8)


def test_hif8_scale_dtype_must_be_fp32(gen):
    op = HiF8Quantizer(15.0).quantize(_rand(gen, 32, 32), orientation="row")
    bad = type(op)(op.data, op.scale.double(), op.logical_dtype, op.format, op.orientation)
    with pytest.raises(ValueError, match="scale must be torch.float32"):
        low_precision_matmul(bad, op, layout="NT", output_dtype=torch.float32)


def test_grouped_group_list_must_sum_to_tokens(gen):
    left, right, _ = _grouped_operands(gen, Format.HIF8, "NT", [8, 8])
    with pytest.raises(ValueError, match="sums to 15"):
        low_precision_grouped_matmul(left, right, torch.tensor([8, 7]), layout="NT", output_dtype=torch.float32)


def test_grouped_tn_group_sizes_must_match_group_list(gen):
    left, right, _ = _grouped_operands(gen, Format.MXFP8_E4M3, "TN", [40, 24])
    with pytest.raises(ValueError, match="group_sizes"):
        low_precision_grouped_matmul(left, right, torch.tensor([32, 32]), layout="TN", output_dtype=torch.float32)


def test_ops_emit_gemm_and_quant_events(gen):
    events, inner = [], []
    q = MXFP8Quantizer()
    with subscribe(events.append):
        left = q.quantize(_rand(gen, 32, 64), orientation="row")
        right = q.quantize(_rand(gen, 32, 64), orientation="row")
        with subscribe(inner.append):
            low_precision_matmul(left, right, layout="NT", output_dtype=torch.bfloat16)
        codes, scale = HiF8Quantizer(224.0).quantize(_rand(gen, 4, 4), orientation="col").data, None
    gemms = [e for e in events if isinstance(e, GemmEvent)]
    quants = [e for e in events if isinstance(e, QuantEvent)]
    assert inner == gemms
    assert gemms == [GemmEvent("dense", "NT", "fprop", "mxfp8_e4m3", (32, 64), (32, 64), torch.uint8, torch.uint8,
                               torch.bfloat16, "emulation", None)]
    assert [(e.format, e.orientation) for e in quants] == [("mxfp8_e4m3", "row")] * 2 + [("hif8", "col")]
    assert quants[-1].amax is not None and quants[-1].scale.dtype == torch.float32
    low_precision_matmul(left, right, layout="NT", output_dtype=torch.bfloat16)  # no subscriber: nothing recorded
    assert len(events) == 4


def test_grouped_event_names_groups_and_gemm(gen):
    events = []
    left, right, group_list = _grouped_operands(gen, Format.HIF8, "TN", [3, 5])
    with subscribe(events.append):
        low_precision_grouped_matmul(left, right, group_list, layout="TN", output_dtype=torch.float32)
    (event,) = events
    assert (event.kind, event.gemm, event.num_groups, event.right_scale_dtype) == ("grouped", "wgrad", 2, torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA path: needs a CUDA device")
@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_cuda_matmul_matches_cpu_emulation(gen, fmt, layout):
    left, right, group_list = _grouped_operands(gen, fmt, layout, [40, 0, 24])
    cpu = low_precision_grouped_matmul(left, right, group_list, layout=layout, output_dtype=torch.float32)
    move = lambda op: type(op)(op.data.cuda(), op.scale.cuda(), op.logical_dtype, op.format, op.orientation,  # noqa: E731
                               None if op.group_sizes is None else op.group_sizes.cuda())
    gpu = low_precision_grouped_matmul(move(left), move(right), group_list.cuda(), layout=layout,
                                       output_dtype=torch.float32)
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-5, atol=1e-4)
