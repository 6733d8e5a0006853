"""E4M3 and E8M0 element codecs versus ``ml_dtypes``."""
import math

import numpy as np
import pytest
import torch

from te_npu.numerics import mxfp8

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is the E4M3/E8M0 reference")

ALL_CODES = torch.arange(256, dtype=torch.uint8)


def _same_bits_or_both_nan(got: np.ndarray, ref: np.ndarray) -> bool:
    nan = np.isnan(ref)
    return bool(np.array_equal(np.isnan(got), nan) and np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32)))


def test_e4m3_decode_all_codes_versus_ml_dtypes():
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert _same_bits_or_both_nan(mxfp8.decode_e4m3(ALL_CODES).numpy(), ref)
    assert _same_bits_or_both_nan(mxfp8.decode_e4m3(ALL_CODES.view(torch.float8_e4m3fn)).numpy(), ref)


def test_e8m0_decode_all_codes_versus_ml_dtypes():
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    assert _same_bits_or_both_nan(mxfp8.e8m0_to_float(ALL_CODES).numpy(), ref)


# (name, input, expected E4M3 code, where it comes from)
E4M3_CASES = [
    ("zero", 0.0, 0x00),
    ("negative_zero", -0.0, 0x80),  # E4M3 has a signed zero
    ("one", 1.0, 0x38),  # exponent 7 (bias 7) << 3
    ("max", 448.0, 0x7E),  # 1.75 * 2**8: exponent 15, mantissa 110 (111 is NaN)
    ("saturate_449", 449.0, 0x7E),
    ("saturate_1e6", 1e6, 0x7E),
    ("saturate_neg_inf", -math.inf, 0xFE),
    ("nan", math.nan, 0x7F),
    ("tie_to_even_down", 1.0625, 0x38),  # halfway 1.0/1.125 -> even mantissa 000
    ("tie_to_even_up", 1.1875, 0x3A),  # halfway 1.125/1.25 -> even mantissa 010
    ("tie_to_even_max", 432.0, 0x7E),  # halfway 416/448 -> even mantissa 110
    ("min_normal", 2.0**-6, 0x08),
    ("max_subnormal", 7 * 2.0**-9, 0x07),
    ("min_subnormal", 2.0**-9, 0x01),
    ("half_min_subnormal_tie", 2.0**-10, 0x00),  # tie 0/2**-9 -> even (0)
    ("above_half_min_subnormal", 2.0**-10 * 1.0001, 0x01),
    ("subnormal_tie_up", 3 * 2.0**-10, 0x02),  # tie 1/2 * 2**-9 -> even (2)
]


@pytest.mark.parametrize("value, code", [c[1:] for c in E4M3_CASES], ids=[c[0] for c in E4M3_CASES])
def test_e4m3_encode_hand_vectors(value, code):
    got = mxfp8.encode_e4m3(torch.tensor([value], dtype=torch.float32)).view(torch.uint8)
    assert torch.equal(got, torch.tensor([code], dtype=torch.uint8)), f"{value} -> {int(got[0]):#04x}"


def _reference_saturating_e4m3(x: np.ndarray) -> np.ndarray:
    clipped = np.clip(x, -448.0, 448.0)  # ml_dtypes casts are not saturating either
    return clipped.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def test_e4m3_encode_random_and_boundaries_versus_ml_dtypes(np_rng):
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid)])
    mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)
    bits = np.concatenate([grid, mids]).view(np.int32).astype(np.int64)
    near = np.concatenate([bits + k for k in (-2, -1, 0, 1, 2)]).astype(np.int32).view(np.float32)
    rand = (np_rng.standard_normal(500_000) * np.exp2(np_rng.uniform(-14, 12, 500_000))).astype(np.float32)
    x = np.concatenate([near, rand, np.array([600.0, -1e30, 464.0, 480.0, 1e-30], dtype=np.float32)])
    got = mxfp8.encode_e4m3(torch.from_numpy(x)).view(torch.uint8).numpy()
    assert np.array_equal(got, _reference_saturating_e4m3(x))


def test_e4m3_encode_every_bf16_value_versus_ml_dtypes():
    x16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x16 = x16[~torch.isnan(x16)]
    got = mxfp8.encode_e4m3(x16).view(torch.uint8).numpy()
    assert np.array_equal(got, _reference_saturating_e4m3(x16.float().numpy()))
