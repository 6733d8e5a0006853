"""MXFP8 block quantization versus hand-computed blocks and an independent numpy reference."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from te_npu.numerics import mxfp8

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is the E4M3 reference")


def reference_quantize(x: np.ndarray, axis: int, scale_alg: str = "floor", bs: int = 32):
    """Slow reference: exponent from np.frexp (exact, subnormals too), float64 scaling, ml_dtypes cast."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # NaN/Inf blocks
        return _reference_quantize(x, axis, scale_alg, bs)


def _reference_quantize(x, axis, scale_alg, bs):
    x = np.moveaxis(x.astype(np.float32), axis, -1)
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // bs, bs)).astype(np.float64)
    amax = np.abs(blocks).max(axis=-1)
    if scale_alg == "floor":
        e = np.frexp(amax)[1] - 1 - 8  # frexp: amax = m * 2**k, m in [0.5, 1) -> floor(log2) = k - 1
    else:
        q = amax / 448.0
        e = np.ceil(np.log2(q)).astype(np.int64)  # float64 log2 of a power of two is exact
    e = np.where(amax == 0, -127, e)
    e = np.clip(e, -127, 127)
    bad = ~np.isfinite(amax)
    codes = np.where(bad, 255, e + 127).astype(np.uint8)
    scaled = np.ldexp(blocks, -np.where(bad, 0, e)[..., None])
    scaled = np.where(bad[..., None], np.nan, np.clip(scaled, -448.0, 448.0))
    data = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(x.shape)
    return np.moveaxis(data, -1, axis), np.moveaxis(codes, -1, axis)


def assert_matches_reference(x: torch.Tensor, axis: int, scale_alg: str = "floor"):
    data, scale = mxfp8.quantize(x, axis=axis, scale_alg=scale_alg)
    ref_data, ref_scale = reference_quantize(x.float().numpy(), axis, scale_alg)
    assert np.array_equal(scale.numpy(), ref_scale)
    got = data.view(torch.uint8).numpy()
    nan = np.isnan(data.float().numpy())
    assert np.array_equal(nan, np.isnan(ref_data.view(ml_dtypes.float8_e4m3fn).astype(np.float32)))
    assert np.array_equal(got[~nan], ref_data[~nan])


def one_block(first: float, fill: float = 0.0) -> torch.Tensor:
    return torch.tensor([first] + [fill] * 31, dtype=torch.float32)


# (name, block's first element (rest 0), scale_alg, expected scale code, expected data code of it)
BLOCK_CASES = [
    ("amax_one", 1.0, "floor", 119, 0x78),  # floor(log2 1) - 8 = -8 -> 119; 1 * 2**8 = 256 = exp 15 -> 0x78
    ("amax_448", 448.0, "floor", 127, 0x7E),  # floor(log2 448) = 8 -> e = 0; 448 = 0x7E
    ("amax_0_75", 0.75, "floor", 118, 0x7C),  # floor(log2 .75) = -1 -> e = -9; .75 * 512 = 384 = 1.5 * 2**8
    ("amax_500_saturates", 500.0, "floor", 127, 0x7E),  # e = 0; 500 > 448 -> saturated
    ("amax_480_saturates", 480.0, "floor", 127, 0x7E),  # unsaturated RNE would give 512 (NaN)
    ("amax_neg_511", -511.0, "floor", 127, 0xFE),  # sign kept, saturated to -448
    ("amax_tiny_clamped", 2.0**-120, "floor", 0, 0x70),  # e = -128 -> clamped to -127; 2**7 = 0x70
    ("amax_fp32_subnormal", 2.0**-140, "floor", 0, 0x00),  # e clamped to -127; 2**-13 < half 2**-9 -> 0
    ("amax_fp32_min_subnormal", 2.0**-149, "floor", 0, 0x00),
    # e can reach at most 119 (floor) / 120 (ceil) from fp32, so the +127 clamp is unreachable.
    ("amax_fp32_max", 3.4028235e38, "floor", 246, 0x7E),  # floor(log2) = 127 -> e = 119; 1.99.. * 2**8 saturates
    ("ceil_amax_one", 1.0, "ceil", 119, 0x78),  # 1/448 -> next power of two 2**-8
    ("ceil_amax_448", 448.0, "ceil", 127, 0x7E),  # 448/448 = 1 exactly
    ("ceil_amax_449", 449.0, "ceil", 128, 0x76),  # 449/448 > 1 -> e = 1; 224.5 -> RNE 224 = exp 14, mant 110
    ("ceil_amax_subnormal", 2.0**-140, "ceil", 0, 0x00),
    ("ceil_amax_tiny", 2.0**-130, "ceil", 0, 0x20),  # 2**-130/448 < 2**-127 -> e = -127; 2**-3: exp 4 -> 0x20
]


@pytest.mark.parametrize("first, alg, scale_code, data_code", [c[1:] for c in BLOCK_CASES],
                         ids=[c[0] for c in BLOCK_CASES])
def test_mxfp8_quantize_hand_blocks(first, alg, scale_code, data_code):
    data, scale = mxfp8.quantize(one_block(first), scale_alg=alg)
    assert torch.equal(scale, torch.tensor([scale_code], dtype=torch.uint8))
    assert int(data.view(torch.uint8)[0]) == data_code
    assert torch.equal(data.view(torch.uint8)[1:], torch.zeros(31, dtype=torch.uint8))


def test_mxfp8_quantize_zero_block():
    data, scale = mxfp8.quantize(torch.zeros(2, 64))
    assert torch.equal(scale, torch.zeros(2, 2, dtype=torch.uint8))  # code 0 = 2**-127
    assert torch.equal(data.view(torch.uint8), torch.zeros(2, 64, dtype=torch.uint8))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "neg_inf"])
def test_mxfp8_quantize_nonfinite_block(bad, gen):
    x = torch.randn(2, 64, generator=gen)
    x[1, 40] = bad
    data, scale = mxfp8.quantize(x)
    assert scale[1, 1] == 0xFF and bool(torch.isnan(data[1, 32:].float()).all())
    assert scale[0].tolist() != [0xFF, 0xFF] and scale[1, 0] != 0xFF
    assert not bool(torch.isnan(data[:, :32].float()).any())  # other blocks untouched


def test_mxfp8_quantize_rejects_ragged_shape():
    with pytest.raises(ValueError, match=r"\(4, 33\)"):
        mxfp8.quantize(torch.zeros(4, 33))
    with pytest.raises(ValueError, match=r"\(40, 64\)"):
        mxfp8.quantize(torch.zeros(40, 64), axis=0)
    with pytest.raises(ValueError, match="scale_alg"):
        mxfp8.quantize(torch.zeros(4, 32), scale_alg="round")


@pytest.mark.parametrize("shape, axis", [
    ((64, 96), -1), ((64, 96), -2), ((64, 96), 0), ((3, 64, 32), -1), ((3, 64, 32), 1), ((64, 2, 3), 0),
], ids=["2d_row", "2d_col", "2d_axis0", "3d_row", "3d_col", "3d_axis0"])
@pytest.mark.parametrize("alg", ["floor", "ceil"])
def test_mxfp8_quantize_versus_reference(shape, axis, alg, gen):
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-20, 20, shape, generator=gen).float())
    data, scale = mxfp8.quantize(x, axis=axis, scale_alg=alg)
    expected_scale_shape = list(shape)
    expected_scale_shape[axis] //= 32
    assert data.shape == shape and data.dtype == torch.float8_e4m3fn
    assert list(scale.shape) == expected_scale_shape and scale.dtype == torch.uint8
    assert_matches_reference(x, axis, alg)


@pytest.mark.parametrize("alg", ["floor", "ceil"])
def test_mxfp8_quantize_wide_range_versus_reference(np_rng, alg):
    # random bit patterns: any float32 incl. subnormals, NaN and Inf, both signs
    bits = np_rng.integers(-(2**31), 2**31, size=(64, 256), dtype=np.int64).astype(np.int32)
    x = torch.from_numpy(bits.view(np.float32))
    assert_matches_reference(x, -1, alg)
    assert_matches_reference(x, 0, alg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mxfp8_quantize_low_precision_input_equals_fp32(dtype, gen):
    x = (torch.randn(64, 128, generator=gen) * 3).to(dtype)
    x[0, :32] = 0
    for axis in (-1, 0):
        d16, s16 = mxfp8.quantize(x, axis)
        d32, s32 = mxfp8.quantize(x.float(), axis)
        assert torch.equal(s16, s32) and torch.equal(d16.view(torch.uint8), d32.view(torch.uint8))


def test_mxfp8_quantize_every_bf16_value_versus_fp32():
    # every finite bf16 value, one block each holding it and its negation-free neighbours
    x = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[: x.numel() // 32 * 32].reshape(-1, 32)
    x = x * torch.where(torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) < 0.5, -1, 1).to(x.dtype)
    d16, s16 = mxfp8.quantize(x)
    d32, s32 = mxfp8.quantize(x.float())
    assert torch.equal(s16, s32) and torch.equal(d16.view(torch.uint8), d32.view(torch.uint8))


def test_mxfp8_dequantize_versus_decoded_product(gen):
    x = torch.randn(64, 8, generator=gen)
    data, scale = mxfp8.quantize(x, axis=0)
    expected = data.float() * torch.exp2(scale.float() - 127).repeat_interleave(32, dim=0)
    assert torch.equal(mxfp8.dequantize(data, scale, axis=0), expected)


def test_mxfp8_quantize_dual_equals_two_single_axis(gen):
    w = torch.randn(2, 64, 96, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    row_d, row_s, col_d, col_s = mxfp8.quantize_dual(w)
    ref_row_d, ref_row_s = mxfp8.quantize(w, axis=-1)
    ref_col_d, ref_col_s = mxfp8.quantize(w, axis=-2)
    assert torch.equal(row_s, ref_row_s) and torch.equal(col_s, ref_col_s)
    assert torch.equal(row_d.view(torch.uint8), ref_row_d.view(torch.uint8))
    assert torch.equal(col_d.view(torch.uint8), ref_col_d.view(torch.uint8))


# ------------------------------------------------------------------------ properties
finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
blocks = hnp.arrays(np.float32, st.tuples(st.sampled_from([32, 64]), st.sampled_from([32, 64])), elements=finite_f32)


def _exp2_codes(scale: torch.Tensor) -> torch.Tensor:
    return mxfp8.e8m0_to_float(scale)


@settings(max_examples=60, deadline=None)
@given(x=blocks, alg=st.sampled_from(["floor", "ceil"]))
def test_mxfp8_quantize_scales_are_powers_of_two(x, alg):
    _, scale = mxfp8.quantize(torch.from_numpy(x), scale_alg=alg)
    values = _exp2_codes(scale)
    mantissa, _ = torch.frexp(values)
    assert bool((mantissa == 0.5).all())  # 2**k has frexp mantissa exactly 0.5


@settings(max_examples=60, deadline=None)
@given(x=blocks, alg=st.sampled_from(["floor", "ceil"]))
def test_mxfp8_quantize_commutes_with_negation(x, alg):
    t = torch.from_numpy(x)
    d_pos, s_pos = mxfp8.quantize(t, scale_alg=alg)
    d_neg, s_neg = mxfp8.quantize(-t, scale_alg=alg)
    assert torch.equal(s_pos, s_neg)
    assert torch.equal((-d_pos.float()), d_neg.float())


@settings(max_examples=60, deadline=None)
@given(x=blocks)
def test_mxfp8_quantize_col_equals_row_of_transpose(x):
    t = torch.from_numpy(x)
    d_col, s_col = mxfp8.quantize(t, axis=-2)
    d_row, s_row = mxfp8.quantize(t.t().contiguous(), axis=-1)
    assert torch.equal(s_col, s_row.t()) and torch.equal(d_col.view(torch.uint8), d_row.t().view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(x=blocks, alg=st.sampled_from(["floor", "ceil"]))
def test_mxfp8_quantize_error_within_half_ulp(x, alg):
    t = torch.from_numpy(x)
    data, scale = mxfp8.quantize(t, scale_alg=alg)
    s = _exp2_codes(scale).double().repeat_interleave(32, dim=-1)
    scaled = t.double() / s  # exact: division by a power of two
    err = (data.double() - scaled).abs()
    # half an E4M3 ulp at |v|: ulp = 2**(max(floor(log2|v|), -6) - 3)
    exp = torch.floor(torch.log2(scaled.abs().clamp(min=2.0**-6)))
    half_ulp = torch.exp2(exp - 3) / 2
    saturated = scaled.abs() > 448
    assert bool(((err <= half_ulp) | saturated).all())
    assert bool((data.double()[saturated].abs() == 448).all())


@settings(max_examples=60, deadline=None)
@given(x=blocks, alg=st.sampled_from(["floor", "ceil"]))
def test_mxfp8_quantize_idempotent_on_representable_values(x, alg):
    t = torch.from_numpy(x)
    if alg == "ceil":
        # ceil rounds a block's top element up to 448 * 2**e: at the top of the FP32 range
        # (amax > 248 * 2**120 ~ 3.3e38: the element rounds to 256, 256 * 2**120 = 2**128) is Inf in FP32
        t = t.clamp(-2.0**127, 2.0**127)
    data, scale = mxfp8.quantize(t, scale_alg=alg)
    once = mxfp8.dequantize(data, scale)
    data2, scale2 = mxfp8.quantize(once, scale_alg=alg)
    assert torch.equal(mxfp8.dequantize(data2, scale2), once)


def test_mxfp8_ceil_dequantizes_the_top_of_the_fp32_range_to_inf():
    # the documented corner of the round-up rule: amax 3.3e38 -> scale 2**120, element 248 -> RNE 256
    data, scale = mxfp8.quantize(one_block(3.2964854e38), scale_alg="ceil")
    assert int(scale[0]) == 247 and float(mxfp8.dequantize(data, scale)[0]) == math.inf
    data, scale = mxfp8.quantize(one_block(3.2964854e38), scale_alg="floor")  # clipped to 448 * 2**119
    assert float(mxfp8.dequantize(data, scale)[0]) == 448 * 2.0**119
