"""Each statistic of ``te_npu.observer.stats`` on hand-made operands whose codes, scales and
errors are worked out here by hand (the codes are built from the values they must decode to)."""
from __future__ import annotations

import math

import pytest
import torch

from te_npu.formats import Format
from te_npu.numerics import hif8
from te_npu.observer.stats import combine, figures, identity, operand_stats
from te_npu.ops.group_sizes import group_sizes_tensor
from te_npu.ops.layouts import to_npu
from te_npu.ops.operand import QuantizedOperand
from te_npu.quantizers import MXFP8Quantizer


def _mx_row_block() -> torch.Tensor:
    """One 32-element MXFP8 block: 500 and 460 above E4M3's 448, 1.0, 2**-11, and 28 zeros."""
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([500.0, 460.0, 1.0, 2.0**-11])
    return x


def _mx_operand(x, scale_exp: int, orientation="row") -> QuantizedOperand:
    """Codes written by hand: E8M0 scale 2**scale_exp; elements = x / scale saturated to 448 and
    rounded by E4M3's own cast (exact for the values used here, 2**-11 / 2**0 flushes to zero)."""
    scaled = (x / 2.0**scale_exp).clamp(-448, 448)
    data = scaled.to(torch.float8_e4m3fn)
    shape = list(x.shape)
    if orientation == "row":
        shape[-1] //= 32
    else:
        shape[-2] //= 32
    scale = torch.full(shape, 127 + scale_exp, dtype=torch.uint8)
    return QuantizedOperand(data, scale, torch.float32, Format.MXFP8_E4M3, orientation)


def test_mxfp8_block_clip_underflow_error_and_range_versus_hand_counts():
    x = _mx_row_block()
    op = _mx_operand(x, 0)  # the OCP floor rule's scale for amax 500: 2**(floor(log2 500) - 8) = 2**0
    assert op.data.float()[0, :4].tolist() == [448.0, 448.0, 1.0, 0.0]
    f = figures(operand_stats(op, x))
    err = 52.0**2 + 12.0**2 + 2.0**-22
    sig = 500.0**2 + 460.0**2 + 1.0 + 2.0**-22
    assert f.elements == 32
    assert f.underflow == 1 / 4  # 2**-11 of the four non-zero values
    assert f.clipped == 2 / 32  # 500 and 460 > 448 * 2**0
    assert f.amax == 500.0
    assert (f.scale_min, f.scale_max) == (0.0, 0.0)
    assert f.rel_error == pytest.approx(math.sqrt(err / sig), rel=1e-12)
    assert f.sqnr_db == pytest.approx(10 * math.log10(sig / err), rel=1e-12)
    assert f.block_dynamic_range == pytest.approx(math.log2(500.0) + 11, rel=1e-7)


def test_mxfp8_quantizer_operand_matches_the_hand_operand_under_floor():
    x = _mx_row_block()
    op = MXFP8Quantizer(scale_alg="floor").quantize(x, orientation="row")
    assert torch.equal(operand_stats(op, x), operand_stats(_mx_operand(x, 0), x))


def test_mxfp8_scale_range_reports_e8m0_exponents_of_every_block():
    x = torch.cat([torch.full((1, 32), 2.0**-3), torch.full((1, 32), 2.0**5)], dim=1)  # two blocks
    scale = torch.tensor([[127 - 3, 127 + 5]], dtype=torch.uint8)  # each block's own power of two
    op = QuantizedOperand(torch.ones(1, 64).to(torch.float8_e4m3fn), scale, torch.float32, Format.MXFP8_E4M3, "row")
    f = figures(operand_stats(op, x))
    assert (f.scale_min, f.scale_max) == (-3.0, 5.0)
    assert f.sqnr_db == math.inf and f.underflow == 0.0 and f.clipped == 0.0
    assert f.block_dynamic_range == 0.0  # every block holds one magnitude


def test_npu_scale_layout_reads_the_same_figures_as_canonical():
    x = torch.linspace(-3, 5, 64 * 64).reshape(64, 64)
    for orientation in ("row", "col"):
        op = MXFP8Quantizer().quantize(x, orientation=orientation)
        assert torch.equal(operand_stats(to_npu(op), x), operand_stats(op, x)), orientation


def test_ragged_col_blocks_restart_at_each_group():
    """Row 0 = 1.0 alone in group 0, rows 1..63 = 2**-4: a dense col block 0 would span both
    (range log2(1 / 2**-4) = 4); ragged blocks restart, so every block has one magnitude."""
    x = torch.full((64, 32), 2.0**-4)
    x[0] = 1.0
    quantizer = MXFP8Quantizer()
    dense = quantizer.quantize(x, orientation="col")
    ragged = quantizer.quantize(x, orientation="col", group_list=group_sizes_tensor([1, 63]))
    assert figures(operand_stats(dense, x)).block_dynamic_range == 4.0
    ragged_figures = figures(operand_stats(ragged, x))
    assert ragged_figures.block_dynamic_range == 0.0
    assert ragged_figures.sqnr_db == math.inf  # powers of two: exact


def test_hif8_underflow_overflow_and_error_versus_hand_values():
    """Scale 2.0: 3.0 -> 1.5 exact; 2**-30 -> 2**-31 below HiF8's 2**-23 (zero); 1e5 -> 5e4 past
    the 40960 overflow threshold (Inf, clipped: > 32768 * 2); -1.0 -> -0.5 exact; 0 stays 0."""
    x = torch.tensor([0.0, 3.0, 2.0**-30, 1e5, -1.0])
    scale = torch.tensor(2.0)
    codes = hif8.encode(x / scale)
    assert hif8.decode(codes).tolist() == [0.0, 1.5, 0.0, math.inf, -0.5]
    op = QuantizedOperand(codes, scale, torch.float32, Format.HIF8, "row")
    f = figures(operand_stats(op, x))
    err, sig = 2.0**-60, 9.0 + 2.0**-60 + 1e10 + 1.0  # error over the finite dequantized values
    assert (f.elements, f.underflow, f.clipped, f.amax) == (5, 1 / 4, 1 / 5, 1e5)
    assert (f.scale_min, f.scale_max) == (2.0, 2.0)
    assert f.sqnr_db == pytest.approx(10 * math.log10(sig / err), rel=1e-12)
    assert f.block_dynamic_range is None


def test_hif8_per_expert_scales_give_the_scale_range():
    x = torch.ones(3, 4, 4) * torch.tensor([1.0, 4.0, 0.25]).view(3, 1, 1)
    scale = torch.tensor([1.0, 4.0, 0.25])
    op = QuantizedOperand(hif8.encode(torch.ones(3, 4, 4)), scale, torch.float32, Format.HIF8, "row")
    f = figures(operand_stats(op, x))
    assert (f.scale_min, f.scale_max, f.sqnr_db, f.elements) == (0.25, 4.0, math.inf, 48)


def test_non_finite_source_values_are_left_out():
    x = torch.tensor([1.0, math.nan, math.inf, 2.0])
    op = QuantizedOperand(hif8.encode(x), torch.tensor(1.0), torch.float32, Format.HIF8, "row")
    f = figures(operand_stats(op, x))
    assert (f.elements, f.amax, f.sqnr_db) == (2, 2.0, math.inf)


def test_combine_sums_counts_and_keeps_maxima():
    a = operand_stats(_mx_operand(_mx_row_block(), 0), _mx_row_block())
    b = operand_stats(_mx_operand(torch.ones(1, 32), -7), torch.ones(1, 32))
    both = figures(combine(combine(identity(), a), b))
    assert both.elements == 64 and both.underflow == 1 / 36 and both.clipped == 2 / 64
    assert (both.scale_min, both.scale_max, both.amax) == (-7.0, 0.0, 500.0)
