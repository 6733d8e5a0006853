"""Ragged ("grouped") MXFP8 blocks along dim 0: blocks restart at every group boundary."""
import pytest
import torch

from te_npu.numerics import mxfp8


def bits(data: torch.Tensor) -> torch.Tensor:
    return data.view(torch.uint8)


def test_mxfp8_group_block_index_hand_example():
    # group sizes [0, 5, 32, 40] -> 77 rows, blocks:
    #   group 0: none
    #   group 1: rows  0..4   -> block 0 (5 rows, short)
    #   group 2: rows  5..36  -> block 1 (32 rows)
    #   group 3: rows 37..68  -> block 2 (32 rows), rows 69..76 -> block 3 (8 rows, short)
    row_to_block, num_blocks = mxfp8.group_block_index(torch.tensor([0, 5, 32, 40]))
    expected = torch.tensor([0] * 5 + [1] * 32 + [2] * 32 + [3] * 8)
    assert num_blocks == 4
    assert torch.equal(row_to_block, expected)


def test_mxfp8_quantize_grouped_hand_example_scales():
    x = torch.zeros(77, 32)
    x[2, 0] = 1.0  # block 0 (group 1): amax 1 -> code 119
    x[36, 0] = 448.0  # block 1 (last row of group 2): code 127
    x[37, 0] = 0.75  # block 2 (first row of group 3): code 118
    x[76, 0] = 2.0  # block 3 (short tail of group 3): code 120
    data, scale = mxfp8.quantize_grouped(x, torch.tensor([0, 5, 32, 40]))
    assert scale.shape == (4, 32) and data.shape == (77, 32)
    assert scale[:, 0].tolist() == [119, 127, 118, 120]
    assert torch.equal(scale[:, 1:], torch.zeros(4, 31, dtype=torch.uint8))  # zero columns -> code 0


def test_mxfp8_quantize_grouped_multiples_of_block_equal_dense(gen):
    x = torch.randn(160, 64, generator=gen).to(torch.bfloat16)
    data, scale = mxfp8.quantize_grouped(x, torch.tensor([32, 0, 64, 64]))
    ref_data, ref_scale = mxfp8.quantize(x, axis=0)
    assert torch.equal(scale, ref_scale) and torch.equal(bits(data), bits(ref_data))


@pytest.mark.parametrize("sizes", [[0, 5, 32, 40], [1, 1, 1], [33, 0, 0, 31, 70], [0, 0, 7]],
                         ids=["mixed", "singletons", "zeros_between", "leading_zeros"])
def test_mxfp8_quantize_grouped_equals_zero_padded_groups(sizes, gen):
    group_sizes = torch.tensor(sizes)
    x = torch.randn(sum(sizes), 64, generator=gen) * 10
    data, scale = mxfp8.quantize_grouped(x, group_sizes)
    start, block = 0, 0
    for g in sizes:
        if g == 0:
            continue
        padded_rows = -(-g // 32) * 32
        x_g = torch.zeros(padded_rows, 64)
        x_g[:g] = x[start:start + g]  # zero padding leaves each block's amax unchanged
        ref_data, ref_scale = mxfp8.quantize(x_g, axis=0)
        nb = padded_rows // 32
        assert torch.equal(scale[block:block + nb], ref_scale)
        assert torch.equal(bits(data[start:start + g]), bits(ref_data[:g]))
        start, block = start + g, block + nb
    assert block == scale.shape[0]


def test_mxfp8_dequantize_grouped_round_trip(gen):
    sizes = torch.tensor([0, 5, 32, 40])
    x = torch.randn(77, 32, generator=gen)
    data, scale = mxfp8.quantize_grouped(x, sizes)
    row_to_block, _ = mxfp8.group_block_index(sizes)
    expected = data.float() * mxfp8.e8m0_to_float(scale)[row_to_block]
    deq = mxfp8.dequantize_grouped(data, scale, sizes)
    assert torch.equal(deq, expected)
    again_data, again_scale = mxfp8.quantize_grouped(deq, sizes)  # representable values are fixed points
    assert torch.equal(mxfp8.dequantize_grouped(again_data, again_scale, sizes), deq)


def test_mxfp8_quantize_grouped_rejects_bad_sizes():
    with pytest.raises(ValueError, match="rows"):
        mxfp8.quantize_grouped(torch.zeros(10, 32), torch.tensor([4, 4]))
    with pytest.raises(ValueError, match=r"\(10,\)"):
        mxfp8.quantize_grouped(torch.zeros(10), torch.tensor([10]))
