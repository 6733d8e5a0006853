"""``MXFP8Quantizer``: which axis each orientation blocks, ragged group blocks, the dual call, the
scale algorithms -- checked against a reference written here from the OCP MX definition (block
amax -> E8M0 exponent via ``torch.frexp`` -> saturating E4M3 cast), not against te_npu's numerics."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from te_npu.events import QuantEvent, subscribe
from te_npu.formats import Format
from te_npu.quantizers import MXFP8Quantizer, Quantizer

E4M3_MAX = 448.0


def reference_row(x: torch.Tensor, block: int = 32, scale_alg: str = "ceil"):
    """(E4M3 data, E8M0 codes ``[..., K / block]``) of ``x [..., K]`` blocked along the last dim.

    floor: ``e = floor(log2(amax)) - 8`` (448 = 1.75 * 2**8); ceil: the least ``e`` with
    ``amax / 2**e <= 448``. A zero block has code 0 (and zero data)."""
    x32 = x.float()
    blocks = x32.reshape(*x32.shape[:-1], -1, block)
    amax = blocks.abs().amax(-1)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    floor_log2 = exponent - 1
    if scale_alg == "floor":
        e = floor_log2 - 8
    else:
        ratio_exp = torch.ceil(torch.log2(amax.double() / E4M3_MAX)).to(torch.int32)
        e = ratio_exp
    e = torch.where(amax > 0, e.clamp(-127, 127), torch.full_like(e, -127))
    scaled = blocks * torch.exp2(-e.float()).unsqueeze(-1)
    data = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(x.shape)
    codes = torch.where(amax > 0, e + 127, torch.zeros_like(e)).to(torch.uint8)
    return data, codes


def same_e4m3(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("scale_alg", ["floor", "ceil"])
def test_mxfp8_quantizer_row_blocks_along_k_versus_reference(spread, scale_alg):
    x = spread(64, 96)
    op = MXFP8Quantizer(scale_alg=scale_alg).quantize(x, orientation="row")
    data, codes = reference_row(x, scale_alg=scale_alg)
    assert (op.format, op.orientation, op.logical_dtype, op.scale_layout) == (Format.MXFP8_E4M3, "row", x.dtype,
                                                                             "canonical")
    assert op.scale.shape == (64, 3) and torch.equal(op.scale, codes)
    assert same_e4m3(op.data, data)


def test_mxfp8_quantizer_col_blocks_along_m_as_the_row_quantization_of_the_transpose(spread):
    x = spread(64, 96)
    op = MXFP8Quantizer().quantize(x, orientation="col")
    data_t, codes_t = reference_row(x.t().contiguous())
    assert op.orientation == "col" and op.scale.shape == (2, 96)
    assert torch.equal(op.scale, codes_t.t()) and same_e4m3(op.data, data_t.t())


def test_mxfp8_quantizer_zero_block_gets_code_zero(spread):
    x = spread(32, 64)
    x[:, :32] = 0
    op = MXFP8Quantizer().quantize(x, orientation="row")
    assert torch.equal(op.scale[:, 0], torch.zeros(32, dtype=torch.uint8))
    assert torch.count_nonzero(op.data[:, :32].view(torch.uint8)) == 0


def test_mxfp8_quantizer_ragged_col_restarts_blocks_at_each_group(spread):
    """Group sizes [40, 0, 24]: blocks rows 0-31 and 32-39 of group 0, rows 40-63 of group 2 (a
    block never mixes two experts' tokens); a partial block's amax is over its own rows only."""
    x = spread(64, 96)
    sizes = [40, 0, 24]
    op = MXFP8Quantizer().quantize(x, orientation="col", group_list=torch.tensor(sizes))
    want_codes, want_data = [], []
    for chunk in torch.split(x, sizes):
        if not len(chunk):
            continue
        rows = -(-len(chunk) // 32) * 32
        padded = torch.cat([chunk, chunk.new_zeros(rows - len(chunk), chunk.shape[1])])  # zeros: amax unchanged
        data_t, codes_t = reference_row(padded.t().contiguous())
        want_codes.append(codes_t.t())
        want_data.append(data_t.t()[: len(chunk)])
    assert op.group_sizes.tolist() == sizes and op.scale.shape == (3, 96)
    assert torch.equal(op.scale, torch.cat(want_codes)) and same_e4m3(op.data, torch.cat(want_data))


def test_mxfp8_quantizer_row_ignores_group_list_and_ragged_col_needs_2d(spread):
    x = spread(64, 96)
    q = MXFP8Quantizer()
    grouped_row = q.quantize(x, orientation="row", group_list=torch.tensor([40, 24]))
    plain_row = q.quantize(x, orientation="row")
    assert grouped_row.group_sizes is None and torch.equal(grouped_row.scale, plain_row.scale)
    with pytest.raises(ValueError, match=r"grouped col quantization needs a 2D \[T, K\] tensor, got shape \(2, 32, 96\)"):
        q.quantize(spread(2, 32, 96), orientation="col", group_list=torch.tensor([32, 32]))


def test_mxfp8_quantizer_dual_equals_row_and_col_from_the_same_values(spread):
    w = spread(4, 64, 96)  # a 3D expert stack: blocks stay inside each expert
    q = MXFP8Quantizer()
    row, col = q.quantize_dual(w)
    for got, orientation in ((row, "row"), (col, "col")):
        alone = q.quantize(w, orientation=orientation)
        assert got.orientation == orientation
        assert torch.equal(got.scale, alone.scale) and same_e4m3(got.data, alone.data)
    assert torch.equal(row.scale, torch.stack([reference_row(w[e])[1] for e in range(4)]))


def test_mxfp8_quantizer_is_stateless_and_reports_each_call(spread):
    q = MXFP8Quantizer()
    assert isinstance(q, Quantizer) and q.format == Format.MXFP8_E4M3
    assert q == MXFP8Quantizer() and hash(q) == hash(MXFP8Quantizer()) and q == MXFP8Quantizer(scale_alg="ceil") != MXFP8Quantizer(scale_alg="floor")
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.block_size = 16
    x = spread(64, 96)
    events = []
    with subscribe(events.append, QuantEvent):
        q.quantize(x, orientation="row")
        q.quantize(x, orientation="col", group_list=torch.tensor([64]))
        q.quantize_dual(x)
    assert [(e.orientation, e.grouped, e.shape, e.amax) for e in events] == [
        ("row", False, (64, 96), None), ("col", True, (64, 96), None), ("dual", False, (64, 96), None)]
