"""The fake's dtype codes and byte codecs against ml_dtypes / en_dtypes."""
import en_dtypes
import ml_dtypes
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fakes.dtypes import (
    TORCH_NPU_DTYPE_CODES, acl_of_code, e8m0_to_float, fp8_saturating, hif8_decode, hif8_encode,
)


def test_torch_npu_codes_are_acl_enum_plus_256():
    # Init.h TORCH_NPU_ENUM_OFFSET with acl_base_rt.h enums
    assert TORCH_NPU_DTYPE_CODES["hifloat8"] == 256 + 34 and TORCH_NPU_DTYPE_CODES["float8_e8m0fnu"] == 256 + 37
    assert TORCH_NPU_DTYPE_CODES["float4_e2m1fn_x2"] == 296 and TORCH_NPU_DTYPE_CODES["bfloat16"] == 283


def test_dtype_codes_below_256_are_scalar_types():
    assert acl_of_code(24) == "FLOAT8_E4M3FN" and acl_of_code(23) == "FLOAT8_E5M2" and acl_of_code(15) == "BF16"
    assert acl_of_code(292) == "FLOAT8_E4M3FN" and acl_of_code(290) == "HIFLOAT8" and acl_of_code(12) is None


def test_e8m0_decode_matches_ml_dtypes_for_all_256_codes():
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = e8m0_to_float(codes).numpy()
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.array_equal(got[~np.isnan(got)], ref[~np.isnan(ref)])


def test_hif8_decode_matches_en_dtypes_for_all_256_codes():
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.numpy().view(en_dtypes.hifloat8).astype(np.float32)
    got = hif8_decode(codes).numpy()
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.array_equal(got[~np.isnan(got)], ref[~np.isnan(ref)])


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=-460.0, max_value=460.0, allow_nan=False, width=32))
def test_fp8_saturating_equals_ml_dtypes_rne_inside_the_range(v):
    got = fp8_saturating(torch.tensor([v]), torch.float8_e4m3fn).view(torch.uint8).item()
    ref = np.array([np.clip(v, -448, 448)], np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)[0]
    assert got == ref


def test_fp8_saturating_clamps_overflow_and_zeroes_nan():
    got = fp8_saturating(torch.tensor([1e6, -1e6, float("inf"), float("nan")]), torch.float8_e5m2).float().tolist()
    assert got == [57344.0, -57344.0, 57344.0, 0.0]


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=-32768.0, max_value=32768.0, allow_nan=False, width=32))
def test_hif8_encode_equals_en_dtypes_inside_the_range(v):
    got = hif8_encode(torch.tensor([v])).item()
    ref = np.array([v], np.float32).astype(en_dtypes.hifloat8).view(np.uint8)[0]
    assert got == ref


@settings(max_examples=100, deadline=None)
@given(st.floats(min_value=2.0**-20, max_value=3e4, allow_nan=False, width=32))
def test_hif8_encode_commutes_with_negation(v):
    pos, neg = hif8_encode(torch.tensor([v])), hif8_encode(torch.tensor([-v]))
    assert hif8_decode(neg).item() == -hif8_decode(pos).item()


def test_hif8_encode_saturates_instead_of_overflowing_to_inf():
    top = hif8_encode(torch.tensor([32768.0])).item()
    assert hif8_encode(torch.tensor([5e4, float("inf")])).tolist() == [top, top]
    assert np.array([5e4], np.float32).astype(en_dtypes.hifloat8).astype(np.float32)[0] == np.inf  # en_dtypes alone
