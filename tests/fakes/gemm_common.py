"""What the quantized GEMMs share: stride-based transposition tests, operand decoding, output cast.

Transposition is never an argument: op-plugin passes ``transpose=false`` and the aclnn layer reads
it from the strides of the views it gets, so the predicates below are ports of those tests.
Decoding follows the aclnn formulas (MX: ``out[m,n] = sum_j (sum_k x1Slice * x2Slice) *
(x1Scale[m, j] * x2Scale[j, n])`` with 32-wide K blocks; HiF8 T-T/K-C: ``x1 @ x2 * x2Scale *
x1Scale``): operands are decoded to float32 (element value times its block's E8M0 power of
two, exact in float32 except beyond its range), multiplied in float32, scaled in float32 in the
documented order, then rounded to the output dtype. The device's accumulation order inside the
cube unit is not published; outputs agree with it up to float32 summation order.
"""
from __future__ import annotations

import math

import torch

from tests.fakes.dtypes import e8m0_to_float, hif8_decode

MX_K_BLOCK = 32  # gsK of the MX mode (aclnnQuantMatmulV5 / GroupedMatmulV4 docs: [1, 1, 32])
MX_PAIR_K = 64  # MXFP_DIVISOR_SIZE: one E8M0 pair covers 64 K elements


def op_plugin_is_transpose_last_two_dims(t: torch.Tensor) -> bool:
    """op-plugin QuantMatmulKernelNpuOpApi.cpp ``is_transpose_last_two_dims``."""
    if t.dim() < 2 or t.dim() > 6:
        return False
    d1, d2 = t.dim() - 1, t.dim() - 2
    if t.stride(d2) == 1 and t.stride(d1) == t.size(d2):
        tmp = t.size(d1) * t.size(d2)
        for b in range(t.dim() - 3, -1, -1):
            if t.stride(b) != tmp:
                return False
            tmp *= t.size(b)
        return not (t.size(d1) == 1 and t.size(d2) == 1)
    return False


def op_plugin_is_transpose_certain_two_dims(t: torch.Tensor, dim: int) -> bool:
    """op-plugin ``is_transpose_certain_two_dims``: stride(dim + 1) == stride(dim) * size(dim)."""
    return t.stride(dim + 1) == t.stride(dim) * t.size(dim)


def op_plugin_same_transpose(x: torch.Tensor, scale: torch.Tensor, dim_x: int, dim_scale: int) -> bool:
    """op-plugin ``is_x_scale_same_transpose``."""
    if x.dim() < dim_x + 2 or scale.dim() < dim_scale + 2:
        return True
    if x.size(dim_x) == 1 and x.size(dim_x + 1) == 1:
        return True
    if scale.size(dim_scale) == 1 and scale.size(dim_scale + 1) == 1:
        return True
    return op_plugin_is_transpose_certain_two_dims(x, dim_x) == op_plugin_is_transpose_certain_two_dims(scale, dim_scale)


def gmm_is_transpose_last_two_dims(t: torch.Tensor) -> bool:
    """ops-transformer gmm/grouped_matmul/op_api/grouped_matmul_util.cpp ``IsTransposeLastTwoDims``."""
    if t.dim() < 2:
        return False
    d1, d2 = t.dim() - 1, t.dim() - 2
    if t.stride(d2) == 1 and t.stride(d1) == t.size(d2):
        if t.dim() == 2:
            return True
        tmp = t.size(d1) * t.size(d2)
        for b in range(t.dim() - 3, -1, -1):
            if t.stride(b) != tmp:
                return False
            tmp *= t.size(b)
        return True
    return False


def gmm_is_transpose_for_mx_shape(t: torch.Tensor) -> bool:
    """grouped_matmul_util.cpp ``IsTransposeForMxShape``: a [.., A, B, 2] view of a contiguous [.., B, A, 2]."""
    if t.dim() < 3:
        return False
    return t.stride(-1) == 1 and t.stride(-3) == 2 and t.stride(-2) == t.size(-3) * 2


def gmm_is_special_mx_case(t: torch.Tensor) -> bool:
    """grouped_matmul_950_checker.cpp ``IsSpecialMXCase``: shape (.., 1, 1, 2) hides transposition."""
    return t.size(-2) == 1 and t.size(-3) == 1


def mx_codes_along_k(pairs: torch.Tensor, k: int, k_axis: int) -> torch.Tensor:
    """E8M0 pairs with the pair dim at ``k_axis`` and 2 last -> per-element codes along K.

    ``pairs[..., p, ..., j]`` is the code of K block ``2p + j``; the result has K elements on
    ``k_axis`` (block b covers elements 32b .. 32b + 31; the pad code of an odd pair is unused)."""
    moved = pairs.movedim(k_axis, -2)  # [.., P, 2]
    blocks = moved.reshape(*moved.shape[:-2], moved.shape[-2] * 2)[..., : math.ceil(k / MX_K_BLOCK)]
    per_element = blocks.repeat_interleave(MX_K_BLOCK, dim=-1)[..., :k]
    return per_element.movedim(-1, k_axis)


def decode_mx(values: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """float8 values [..] and their per-element E8M0 codes [..] -> float32 values * 2**(code - 127)."""
    return values.to(torch.float32) * e8m0_to_float(codes)


def decode_hif8(codes: torch.Tensor) -> torch.Tensor:
    return hif8_decode(codes)


def cast_out(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 result -> output dtype (round to nearest even; the fixpipe cast mode is not published)."""
    return values.to(dtype)
