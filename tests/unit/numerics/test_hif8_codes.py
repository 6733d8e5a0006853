"""HiF8 encode/decode versus hand-computed codes and versus the ``en_dtypes.hifloat8`` reference."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from te_npu.numerics import hif8
from te_npu.numerics.constants import HIF8_NAN, HIF8_NEG_INF, HIF8_POS_INF

en_dtypes = pytest.importorskip("en_dtypes", reason="en_dtypes is the HiF8 reference implementation")

ALL_CODES = torch.arange(256, dtype=torch.uint8)


def reference_encode(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # NaN/Inf inputs make numpy warn; the codes are fine
        return np.asarray(x, dtype=np.float32).astype(en_dtypes.hifloat8).view(np.uint8)


def reference_decode_table() -> np.ndarray:
    return np.arange(256, dtype=np.uint8).view(en_dtypes.hifloat8).astype(np.float32)


# (name, input, expected code, where the code comes from)
ENCODE_CASES = [
    ("zero", 0.0, 0x00),  # the only zero code
    ("negative_zero", -0.0, 0x00),  # 0x80 is NaN, so -0 has no code of its own (en_dtypes agrees)
    ("nan", math.nan, 0x80),  # the only NaN code
    ("pos_inf", math.inf, 0x6F),  # Inf takes the slot of 1.5*2**15: 0|11|0|111|1
    ("neg_inf", -math.inf, 0xEF),
    ("one", 1.0, 0x08),  # |E|=0: prefix 0001, mantissa 000
    ("one_and_eighth", 1.125, 0x09),  # prefix 0001, mantissa 001
    ("tie_away_e0", 1.0625, 0x09),  # halfway 1.0/1.125 -> away from zero (RNE would give 0x08)
    ("below_tie_e0", 1.0624999, 0x08),
    ("neg_tie_away_e0", -1.0625, 0x89),  # sign bit | 0x09
    ("two", 2.0, 0x10),  # |E|=1: 001 | exp sign 0 | mantissa 000
    ("half", 0.5, 0x18),  # 001 | exp sign 1 | 000
    ("fifteen", 15.0, 0x2F),  # |E|=3: 01|0|1|111 = 1.875*8
    ("band_3_to_4_carry", 15.5, 0x40),  # 15.5 is the tie 15/16 -> away -> 16 = 10|0|00|00
    ("sixteen", 16.0, 0x40),  # |E|=4: 10 | 0 | 00 | 00
    ("band4_tie_away", 18.0, 0x41),  # tie 16/20 (2 mantissa bits) -> 20
    ("two_twenty_four", 224.0, 0x4F),  # |E|=7: 10|0|11|11 = 1.75*128
    ("band_7_to_8_carry", 240.0, 0x60),  # tie 224/256 -> 256 = 11|0|000|0
    ("band8_tie_away", 320.0, 0x61),  # tie 256/384 (1 mantissa bit) -> 384
    ("max", 32768.0, 0x6E),  # 11|0|111|0 = 2**15
    ("below_overflow", 40959.996, 0x6E),  # just below the 32768/49152 tie
    ("overflow_tie", 40960.0, 0x6F),  # tie 32768 / (1.5*2**15 = Inf slot) -> away -> Inf
    ("overflow_large", 1e6, 0x6F),
    ("neg_overflow", -1e6, 0xEF),
    ("min_normal", 2.0**-15, 0x7E),  # |E|=15 negative: 11|1|111|0
    ("min_normal_mant", 1.5 * 2.0**-15, 0x7F),
    ("max_denormal", 2.0**-16, 0x07),  # denormal code m = E + 23
    ("denormal_tie", 1.5 * 2.0**-17, 0x07),  # tie 2**-17/2**-16 -> away -> 2**-16
    ("smallest_denormal", 2.0**-22, 0x01),
    ("half_smallest_denormal", 2.0**-23, 0x01),  # tie 0/2**-22 -> away from zero
    ("neg_half_smallest_denormal", -(2.0**-23), 0x81),
    ("below_half_smallest_denormal", 2.0**-23 * (1 - 2.0**-24), 0x00),
    ("neg_underflow_to_zero", -(2.0**-24), 0x00),  # rounds to zero, which has no sign
    ("fp32_subnormal", 1e-45, 0x00),
]


@pytest.mark.parametrize("value, code", [c[1:] for c in ENCODE_CASES], ids=[c[0] for c in ENCODE_CASES])
def test_hif8_encode_hand_vectors(value, code):
    got = hif8.encode(torch.tensor([value], dtype=torch.float32))
    assert torch.equal(got, torch.tensor([code], dtype=torch.uint8)), f"{value} -> {int(got[0]):#04x}"
    assert int(reference_encode(np.array([value]))[0]) == code  # the hand value agrees with en_dtypes


SATURATE_CASES = [
    ("overflow_tie", 40960.0, 0x6E),  # saturates to 2**15 instead of Inf
    ("neg_huge", -3e38, 0xEE),
    ("inf_stays_inf", math.inf, HIF8_POS_INF),  # saturation only clips finite values
    ("neg_inf_stays_inf", -math.inf, HIF8_NEG_INF),
    ("nan_stays_nan", math.nan, HIF8_NAN),
    ("max", 32768.0, 0x6E),
    ("in_range", 3.0, 0x14),
]


@pytest.mark.parametrize("value, code", [c[1:] for c in SATURATE_CASES], ids=[c[0] for c in SATURATE_CASES])
def test_hif8_encode_saturate_hand_vectors(value, code):
    got = hif8.encode(torch.tensor([value], dtype=torch.float32), saturate=True)
    assert torch.equal(got, torch.tensor([code], dtype=torch.uint8))


def test_hif8_decode_all_codes_versus_en_dtypes():
    ref = reference_decode_table()
    got = hif8.decode(ALL_CODES).numpy()
    assert np.isnan(got[0x80]) and np.isnan(ref[0x80])
    finite = ~np.isnan(ref)
    assert np.array_equal(got[finite].view(np.uint32), ref[finite].view(np.uint32))


def _neighbours(values: np.ndarray, ulps=(1, 2)) -> np.ndarray:
    """``values`` and the float32 values 1 and 2 ulps either side of them."""
    bits = values.astype(np.float32).view(np.int32).astype(np.int64)
    out = [bits]
    for k in ulps:
        out += [bits + k, bits - k]
    return np.clip(np.concatenate(out), -(2**31), 2**31 - 1).astype(np.int32).view(np.float32)


def test_hif8_encode_boundaries_versus_en_dtypes():
    table = reference_decode_table()
    grid = np.sort(table[np.isfinite(table)])  # every finite HiF8 value, both signs
    grid = np.unique(np.concatenate([grid, [np.float32(np.inf), -np.float32(np.inf)]]))
    finite = grid[np.isfinite(grid)]
    midpoints = ((finite[1:].astype(np.float64) + finite[:-1]) / 2).astype(np.float32)  # exact in fp32
    extra = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**-23, 40960.0, 49152.0, 65536.0,
                      1e-45, -1e-45, 1e-40, 1.1754942e-38, 3.4028235e38, -3.4028235e38], dtype=np.float32)
    x = np.concatenate([_neighbours(finite), _neighbours(midpoints), extra, -extra])
    got = hif8.encode(torch.from_numpy(x)).numpy()
    ref = reference_encode(x)
    bad = got != ref
    assert not bad.any(), list(zip(x[bad][:8], got[bad][:8], ref[bad][:8]))


def test_hif8_encode_random_full_range_versus_en_dtypes(np_rng):
    # random float32 bit patterns: every exponent (subnormal, Inf, NaN included)
    bits = np_rng.integers(-(2**31), 2**31, size=1_000_000, dtype=np.int64).astype(np.int32)
    # plus values concentrated on the HiF8 range 2**-25 .. 2**17
    around = (np_rng.standard_normal(1_000_000) * np.exp2(np_rng.uniform(-25, 17, 1_000_000))).astype(np.float32)
    x = np.concatenate([bits.view(np.float32), around])
    got = hif8.encode(torch.from_numpy(x)).numpy()
    ref = reference_encode(x)
    bad = got != ref
    assert not bad.any(), list(zip(x[bad][:8], got[bad][:8], ref[bad][:8]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hif8_encode_low_precision_input_equals_fp32(dtype, gen):
    x = (torch.randn(4096, generator=gen) * 100).to(dtype)
    assert torch.equal(hif8.encode(x), hif8.encode(x.float()))


def test_hif8_encode_keeps_shape():
    x = torch.zeros(2, 3, 5)
    assert hif8.encode(x).shape == (2, 3, 5) and hif8.encode(x).dtype == torch.uint8
    assert hif8.decode(hif8.encode(x)).shape == (2, 3, 5)


def test_hif8_round_trip_every_representable_value():
    values = hif8.decode(ALL_CODES)
    codes = hif8.encode(values)
    expected = ALL_CODES.clone()
    assert torch.equal(codes, expected)  # 0x80 -> NaN -> 0x80, 0x00 -> 0 -> 0x00


def test_hif8_encode_monotone_over_sorted_sweep(np_rng):
    x = np.sort(np.concatenate([
        np_rng.uniform(-5e4, 5e4, 200_000), np_rng.standard_normal(200_000) * 1e-4,
    ]).astype(np.float32))
    values = hif8.round_to_hif8(torch.from_numpy(x))
    assert bool((values[1:] >= values[:-1]).all())


@settings(max_examples=200, deadline=None)
@given(a=st.floats(width=32, allow_nan=False), b=st.floats(width=32, allow_nan=False))
def test_hif8_encode_monotone_property(a, b):
    lo, hi = min(a, b), max(a, b)
    r = hif8.round_to_hif8(torch.tensor([lo, hi], dtype=torch.float32))
    assert r[0] <= r[1]


@settings(max_examples=200, deadline=None)
@given(x=st.floats(width=32, allow_nan=False))
def test_hif8_encode_commutes_with_negation(x):
    pos = hif8.round_to_hif8(torch.tensor([x], dtype=torch.float32))
    neg = hif8.round_to_hif8(torch.tensor([-x], dtype=torch.float32))
    assert torch.equal(pos, -neg) or (pos == 0 and neg == 0)
