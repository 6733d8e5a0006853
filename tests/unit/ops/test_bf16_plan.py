"""The BF16 plan of the emulation backend (CUDA's: BF16 operands, FP32 products), run on CPU.

``BF16_GEMM_DEVICES`` is widened to "cpu" here, so the plan's decode, scale raise and epilogue
run on this machine (``_mm`` widens BF16 operands to FP32 off CUDA: the same exact products).
"""
from __future__ import annotations

import pytest
import torch

from te_npu.formats import Format
from te_npu.numerics import hif8, mxfp8
from te_npu.ops import emulation, low_precision_grouped_matmul, low_precision_matmul
from te_npu.quantizers import HiF8Quantizer, MXFP8Quantizer
from te_npu.ops.operand import QuantizedOperand

ORIENT = {"NT": ("row", "row"), "NN": ("row", "col"), "TN": ("col", "col")}
E4M3_MIN_SUBNORMAL = 0x01  # 2**-9
E4M3_MAX_CODE = 0x7E  # 448


@pytest.fixture
def bf16_plan(monkeypatch):
    monkeypatch.setattr(emulation, "BF16_GEMM_DEVICES", frozenset({"cuda", "cpu"}))


def _quantizer(fmt):
    return MXFP8Quantizer() if fmt == Format.MXFP8_E4M3 else HiF8Quantizer(15.0)


def _operands(gen, fmt, layout, M=64, N=96, K=128):
    rand = lambda *s: (torch.randn(*s, generator=gen) * 3).to(torch.bfloat16)  # noqa: E731
    q = _quantizer(fmt)
    lo, ro = ORIENT[layout]
    shapes = {"NT": ((M, K), (N, K)), "NN": ((M, N), (N, K)), "TN": ((M, N), (M, K))}[layout]
    return q.quantize(rand(*shapes[0]), orientation=lo), q.quantize(rand(*shapes[1]), orientation=ro)


def _grouped_operands(fmt, layout, seed, sizes=(5, 0, 40, 19)):
    """(left, right, group_list) of a grouped ``layout`` GEMM over 64 token rows in 4 groups."""
    gen = torch.Generator().manual_seed(seed)
    group_list = torch.tensor(sizes)
    rand = lambda *s: (torch.randn(*s, generator=gen) * 3).to(torch.bfloat16)  # noqa: E731
    q = _quantizer(fmt)
    if layout == "NT":
        return q.quantize(rand(64, 96), orientation="row"), q.quantize(rand(4, 64, 96), orientation="row"), group_list
    if layout == "NN":
        return q.quantize(rand(64, 64), orientation="row"), q.quantize(rand(4, 64, 96), orientation="col"), group_list
    return (q.quantize(rand(64, 64), orientation="col", group_list=group_list),
            q.quantize(rand(64, 96), orientation="col", group_list=group_list), group_list)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
@pytest.mark.parametrize("fmt", [Format.MXFP8_E4M3, Format.HIF8], ids=lambda f: f.value)
def test_bf16_plan_equals_fp32_plan_on_random_operands(monkeypatch, fmt, layout, out_dtype):
    left, right = _operands(torch.Generator().manual_seed(7), fmt, layout)
    fp32_plan = low_precision_matmul(left, right, layout=layout, output_dtype=out_dtype)
    monkeypatch.setattr(emulation, "BF16_GEMM_DEVICES", frozenset({"cuda", "cpu"}))
    bf16_plan = low_precision_matmul(left, right, layout=layout, output_dtype=out_dtype)
    assert bf16_plan.dtype == out_dtype
    # same exact products, same FP32 matmul of the widened operands: equal bit for bit here
    assert torch.equal(bf16_plan, fp32_plan)


@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
@pytest.mark.parametrize("fmt", [Format.MXFP8_E4M3, Format.HIF8], ids=lambda f: f.value)
def test_bf16_plan_grouped_equals_fp32_plan(monkeypatch, fmt, layout):
    left, right, group_list = _grouped_operands(fmt, layout, seed=3)
    fp32_plan = low_precision_grouped_matmul(left, right, group_list, layout=layout, output_dtype=torch.float32)
    monkeypatch.setattr(emulation, "BF16_GEMM_DEVICES", frozenset({"cuda", "cpu"}))
    bf16_plan = low_precision_grouped_matmul(left, right, group_list, layout=layout, output_dtype=torch.float32)
    assert torch.equal(bf16_plan, fp32_plan)


def _tiny_scale_operands():
    """X [4, 64] row: row r < 3 holds E4M3's smallest value 2**-9 at k = r under block scale
    code r (codes 0..2: unraised, the products fall below BF16's subnormal quantum 2**-133);
    row 3 holds 1.0 under code 127. W [2, 64] row: all ones, then all twos, scale 1."""
    x = torch.zeros(4, 64, dtype=torch.uint8)
    x_scale = torch.full((4, 2), 127, dtype=torch.uint8)
    for r in range(3):
        x[r, r] = E4M3_MIN_SUBNORMAL
        x_scale[r, 0] = r
    x[3, 40] = 0x38  # 1.0
    w = torch.full((2, 64), 0x38, dtype=torch.uint8)
    w[1] = 0x40  # 2.0
    w_scale = torch.full((2, 2), 127, dtype=torch.uint8)
    make = lambda d, s: QuantizedOperand(d.view(torch.float8_e4m3fn), s, torch.bfloat16,  # noqa: E731
                                         Format.MXFP8_E4M3, "row")
    return make(x, x_scale), make(w, w_scale)


def _tiny_expected():
    """Hand-computed: row r < 3 -> [2**(r - 136), 2**(r - 135)] (FP32 subnormals, exact); row 3 -> [1, 2]."""
    rows = [[2.0 ** (r - 136), 2.0 ** (r - 135)] for r in range(3)] + [[1.0, 2.0]]
    return torch.tensor(rows, dtype=torch.float32)


def test_bf16_plan_is_exact_for_the_smallest_block_scales(bf16_plan):
    x, w = _tiny_scale_operands()
    assert torch.equal(low_precision_matmul(x, w, layout="NT", output_dtype=torch.float32), _tiny_expected())
    assert torch.equal(low_precision_matmul(w, x, layout="NT", output_dtype=torch.float32), _tiny_expected().t())


def test_bf16_plan_without_the_scale_raise_loses_the_smallest_values(bf16_plan, monkeypatch):
    """Why the raise exists (and that the test above would catch its removal)."""
    monkeypatch.setattr(emulation, "BF16_MXFP8_SCALE_SHIFT", 0)
    x, w = _tiny_scale_operands()
    out = low_precision_matmul(x, w, layout="NT", output_dtype=torch.float32)
    assert not torch.equal(out[:3], _tiny_expected()[:3]) and torch.equal(out[3], _tiny_expected()[3])


def test_bf16_plan_headroom_ends_at_block_code_243():
    """Documented price of the raise: codes <= 243 decode finite with E4M3's largest value;
    code 244 overflows BF16 (the FP32 plan would give 448 * 2**117)."""
    data = torch.full((2, 32), E4M3_MAX_CODE, dtype=torch.uint8).view(torch.float8_e4m3fn)
    op = QuantizedOperand(data, torch.tensor([[243], [244]], dtype=torch.uint8), torch.float32,
                          Format.MXFP8_E4M3, "row")
    decoded = emulation.decode(op, torch.bfloat16, emulation.BF16_MXFP8_SCALE_SHIFT)
    assert torch.isfinite(decoded[0]).all() and torch.isinf(decoded[1]).all()
    assert torch.isfinite(emulation.decode(op)).all()


def test_bf16_plan_keeps_nan_blocks_nan(bf16_plan):
    x = torch.ones(2, 64, dtype=torch.bfloat16)
    x[0, 3] = float("nan")
    q = MXFP8Quantizer()
    out = low_precision_matmul(q.quantize(x, orientation="row"), q.quantize(torch.ones(4, 64), orientation="row"),
                               layout="NT", output_dtype=torch.bfloat16)
    assert torch.isnan(out[0]).all() and torch.equal(out[1], torch.full((4,), 64.0, dtype=torch.bfloat16))


def test_hif8_bf16_decode_is_exact_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    op = QuantizedOperand(codes, torch.tensor(1.0), torch.float32, Format.HIF8, "row")
    torch.testing.assert_close(emulation.decode(op, torch.bfloat16).float(), hif8.decode(codes),
                               rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
def test_bf16_plan_grouped_mxfp8_into_bf16_rounds_the_product_once(monkeypatch, layout):
    """BF16 output takes the fused kernel's BF16 product (raised), then the exact unraise: the
    FP32 plan's product rounded once to BF16 (up to FP32 summation order; equal here)."""
    left, right, group_list = _grouped_operands(Format.MXFP8_E4M3, layout, seed=5)
    fp32_plan = low_precision_grouped_matmul(left, right, group_list, layout=layout, output_dtype=torch.float32)
    monkeypatch.setattr(emulation, "BF16_GEMM_DEVICES", frozenset({"cuda", "cpu"}))
    calls = []
    original = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(k.get("out_dtype")) or original(*a, **k))
    bf16_plan = low_precision_grouped_matmul(left, right, group_list, layout=layout, output_dtype=torch.bfloat16)
    assert calls == [torch.bfloat16]
    assert bf16_plan.dtype == torch.bfloat16
    assert torch.equal(bf16_plan, fp32_plan.to(torch.bfloat16))
    if layout == "TN":
        assert torch.count_nonzero(bf16_plan[1]) == 0
