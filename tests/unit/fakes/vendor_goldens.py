"""Ports of the vendor's own Python references (hicann/ops-nn ``quant/*/tests/assets/golden.py``),
re-written from reading them, in numpy, for the cases the fake models (FP8 MX, HiF8 per-tensor).

They are independent of the fake's torch code and of te_npu; the tests compare the fake against
them bit for bit and name the places where the kernels (which the fake follows) and the goldens
differ.
"""
from __future__ import annotations

import en_dtypes
import ml_dtypes
import numpy as np

FP8 = {"float8_e4m3fn": (ml_dtypes.float8_e4m3fn, 448.0, 4, 3), "float8_e5m2": (ml_dtypes.float8_e5m2, 57344.0, 5, 2)}


def _share_exp_ocp(amax: np.ndarray, max_norm: float) -> np.ndarray:
    """golden ``_mx_calculate_share_exp``: floor(log2(amax)) - emax, -inf for amax == 0."""
    emax = int(np.log2(max_norm))
    with np.errstate(divide="ignore", invalid="ignore"):
        res = np.floor(np.log2(amax.astype(np.float32) + np.float32(2.0**-126) * (amax == 0))) - emax
    res[amax == 0] = -np.inf
    return res


def _share_exp_cublas(amax: np.ndarray, max_norm: float) -> np.ndarray:
    """golden ``_mx_calculate_share_exp_nv``: exponent of amax / max rounded up."""
    s = (amax.astype(np.float32) / np.float32(max_norm)).astype(np.float32)
    bits = s.view(np.uint32)
    exp = ((bits & 0x7F800000) >> 23).astype(np.int16)
    man = bits & 0x007FFFFF
    up = ((exp > 0) & (exp < 254) & (man > 0)) | ((exp == 0) & (man > 2**22))
    res = (np.where(up, exp + 1, exp) - 127).astype(np.float32)
    res[amax == 0] = -np.inf
    return res


def mx_quantize(x: np.ndarray, fmt: str, axis: int = -1, block_size: int = 32, scale_alg: int = 0):
    """golden ``_mx_quantize`` (rint): x float32 values -> (y codes uint8 like x, scale codes uint8
    [.., P along axis, .., 2])."""
    np_fmt, max_norm, ebits, mbits = FP8[fmt]
    axis = axis % x.ndim
    moved = np.moveaxis(x.astype(np.float32), axis, -1)
    d = moved.shape[-1]
    nb = -(-d // block_size)
    padded = np.zeros(moved.shape[:-1] + (nb * block_size,), np.float32)
    padded[..., :d] = moved
    blocks = padded.reshape(moved.shape[:-1] + (nb, block_size))
    with np.errstate(invalid="ignore"):
        amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
    share = _share_exp_ocp(amax, max_norm) if scale_alg == 0 else _share_exp_cublas(amax, max_norm)
    share[share > 127] = np.nan
    share[share < -127] = -127
    with np.errstate(invalid="ignore", over="ignore"):
        ret = blocks.astype(np.float64) / np.exp2(share)
        private = np.floor(np.log2(np.abs(ret) + (ret == 0)))
        private = np.clip(private, -(2 ** (ebits - 1)) + 2, None)
        ret = np.rint(ret / np.exp2(private) * 2**mbits) / 2**mbits * np.exp2(private)
        ret = np.clip(ret, -max_norm, max_norm)
    ret = np.nan_to_num(ret, nan=0.0)  # golden: "NPU will cast NaN ... to positive ZERO"
    y = ret.reshape(padded.shape)[..., :d].astype(np.float32).astype(np_fmt).view(np.uint8)
    scale = np.exp2(share[..., 0])  # [.., nb]
    if nb % 2:
        scale = np.concatenate([scale, np.full(scale.shape[:-1] + (1,), 2.0**-127)], axis=-1)
    codes = scale.astype(np.float32).astype(en_dtypes.float8_e8m0).view(np.uint8)
    codes = codes.reshape(codes.shape[:-1] + (codes.shape[-1] // 2, 2))
    return np.moveaxis(y, -1, axis), np.moveaxis(codes, -2, axis)


def grouped_mx_quantize(x: np.ndarray, ends: list[int], fmt: str):
    """golden ``_grouped_mx_quantize`` + ``_reshape_scale_array_pad``: per-group blocks along
    axis 0, the group's pad-to-even with 2**-127 (code 0) and the rows up to the next group start
    ``end // 64 + g + 1`` filled with 1 (code 127) "for its own comparison"."""
    ys, rows, start = [], [], 0
    n = x.shape[1]
    for g, end in enumerate(ends):
        y_g, s_g = mx_quantize(x[start:end], fmt, axis=0) if end > start else (np.zeros((0, n), np.uint8), np.zeros((0, n, 2), np.uint8))
        ys.append(y_g)
        rows.append(s_g)
        filled = sum(r.shape[0] for r in rows)
        target = end // 64 + g + 1
        rows.append(np.full((target - filled, n, 2), 127, np.uint8))
        start = end
    return np.concatenate(ys), np.concatenate(rows)[: x.shape[0] // 64 + len(ends)]


def dynamic_quant_pertensor_hif8(x: np.ndarray, max_value: float = 32768.0):
    """golden ``_dynamic_quant_common`` (pertensor, symmetric, dst_type 34): scale = amax *
    (1 / max) in float32, y = x / scale cast with en_dtypes.hifloat8 (no zero guard)."""
    values = x.astype(np.float32)
    scale = np.max(np.abs(values)) * (np.float32(1.0) / np.float32(max_value))
    with np.errstate(invalid="ignore", divide="ignore"):
        y = (values / np.float32(scale)).astype(en_dtypes.hifloat8).view(np.uint8)
    return y, np.float32(scale)
