"""MX block scale and element math of the Ascend 950 quant kernels, and their scale layouts.

Shape legend: ``nb`` blocks of ``bs`` elements along the quantized axis, ``P = ceil(nb / 2)``
E8M0 pairs. All functions are pure: float32 / uint8 tensors in, tensors out.

Sources (hicann/ops-nn, master e5c3fa93):
* scale_alg 0 (OCP): ``ComputeScaleOcp`` in ``quant/dynamic_mx_quant/op_kernel/arch35/
  dynamic_mx_quant_tail_axis_fp8.h``, ``ComputeMxScaleOCP`` in
  ``quant/quant_common/op_kernel/mx_quant_common.h`` (grouped op), ``ComputeScale`` of
  ``quant/dynamic_mx_quant_with_dual_axis/op_kernel/arch35/dynamic_mx_quant_with_dual_axis_base.h``.
  The kernels work on the biased exponent field only: E = max over the block of the exponent
  bits of each element (bf16 as is; fp16 through a truncating cast to bf16, which keeps the
  exponent of every fp16 value, inf/NaN -> 0xFF; fp32 bits >> 16). With emax = 8 (E4M3) /
  15 (E5M2):
    E == 0xFF      -> scale code 0xFF (NaN), reciprocal NaN
    E <= emax      -> scale code 0, reciprocal 0 in dynamic_mx_quant and grouped_dynamic_mx_quant
                      (their zero mask is on the shared exponent), but 2**127 in the dual-axis
                      kernel unless E == 0 (its zero mask is on the raw block exponent)
    otherwise      -> code E - emax, reciprocal 2**(127 - code) (a bf16 built from its exponent)
  The golden (``tests/assets/golden.py``: floor(log2(amax)) - emax clipped to [-127, 127]) agrees
  except for the E <= emax blocks of the first two ops (|amax| < 2**(emax - 126)), where the
  golden keeps x * 2**127: the fake follows the kernels.
* scale_alg 1 (cuBLAS): ``ComputeScaleCublas`` (tail-axis FP8) / ``ComputeMxScaleCuBLAS``
  (mx_quant_common.h): S = fp32(amax) * fp32(1 / dtype_max) (a multiplication by the rounded
  reciprocal, 0x3b124925 for E4M3; the golden divides, which can differ by one ulp), exponent
  rounded up when the mantissa is non-zero (0 < exp < 254) or, for subnormal S, above half;
  code = that biased exponent; amax inf/NaN -> 0xFF. ``max_low_bound`` (aclnnDynamicMxQuantV3)
  is ``Maxs(amax, max_low_bound)`` before the multiplication.
* Elements: ``fp32(x) * reciprocal`` then the SAT + CAST_RINT cast (``dtypes.fp8_saturating``);
  a NaN reciprocal makes the whole block NaN, which the cast turns into +0.
* Layout: codes padded with code 0 to an even count, pairs ``[..., P, 2]`` along the quantized
  axis; for a non-tail axis the pair dim sits at the axis position and the 2 stays last
  (aclnn docs: "axis为非尾轴时需要对每两行数据进行交织处理"; golden ``_interleave``).
"""
from __future__ import annotations

import math

import torch

from tests.fakes.dtypes import FP8_MAX, fp8_saturating

EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
E8M0_NAN = 0xFF


def _exponent_field(x: torch.Tensor) -> torch.Tensor:
    """Biased fp32 exponent of each element (0..255) as int32 (exact for bf16/fp16/fp32 inputs)."""
    return (x.to(torch.float32).view(torch.int32) >> 23) & 0xFF


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent (int tensor, -149..127) as float32."""
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent.to(torch.int32))


def ocp_scales(blocks: torch.Tensor, fmt: torch.dtype, *, zero_tiny_blocks: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """scale_alg 0. blocks: [..., nb, bs] (input values, zero padded) -> codes [..., nb] uint8,
    reciprocals [..., nb] float32."""
    emax = EMAX[fmt]
    e_block = _exponent_field(blocks).amax(dim=-1) if blocks.shape[-1] else torch.zeros(blocks.shape[:-1], dtype=torch.int32)
    special = e_block == 0xFF
    tiny = e_block <= emax
    code = torch.where(tiny, torch.zeros_like(e_block), e_block - emax)
    code = torch.where(special, torch.full_like(e_block, E8M0_NAN), code)
    recip = _pow2(127 - code.clamp(max=254))
    if zero_tiny_blocks:
        recip = torch.where(tiny, torch.zeros_like(recip), recip)
    else:
        recip = torch.where(e_block == 0, torch.zeros_like(recip), recip)
    recip = torch.where(special, torch.full_like(recip, float("nan")), recip)
    return code.to(torch.uint8), recip


def cublas_scales(blocks: torch.Tensor, fmt: torch.dtype, *, max_low_bound: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """scale_alg 1. blocks: [..., nb, bs] -> codes [..., nb] uint8, reciprocals [..., nb] float32."""
    amax = blocks.to(torch.float32).abs().amax(dim=-1) if blocks.shape[-1] else torch.zeros(blocks.shape[:-1])
    special = ~torch.isfinite(amax)
    amax = torch.maximum(amax, torch.tensor(max_low_bound, dtype=torch.float32))
    inv_max = torch.tensor(1.0 / FP8_MAX[fmt], dtype=torch.float32)  # 0x3b124925 / 0x37924925
    s = amax * inv_max
    bits = s.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    round_up = ((exp > 0) & (exp < 254) & (man > 0)) | ((exp == 0) & (man > 0x400000))
    code = torch.where(round_up, exp + 1, exp)
    code = torch.where(special, torch.full_like(code, E8M0_NAN), code)
    recip = _pow2(127 - code.clamp(max=254))  # code 254 -> 2**-127, the bf16 0x0040 special case
    recip = torch.where(code == E8M0_NAN, torch.full_like(recip, float("nan")), recip)
    return code.to(torch.uint8), recip


def block_view(x_last: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., D] -> [..., ceil(D / bs), bs] float32, the tail block zero padded ("缺失值视为0")."""
    d = x_last.shape[-1]
    nb = math.ceil(d / block_size)
    padded = torch.zeros(*x_last.shape[:-1], nb * block_size, dtype=torch.float32)
    padded[..., :d] = x_last.to(torch.float32)
    return padded.reshape(*x_last.shape[:-1], nb, block_size)


def quantize_last_axis(x_last: torch.Tensor, block_size: int, fmt: torch.dtype, scale_alg: int, *,
                       zero_tiny_blocks: bool, max_low_bound: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x_last: [..., D] -> (y [..., D] ``fmt``, codes [..., nb] uint8) with blocks along the last dim."""
    blocks = block_view(x_last, block_size)
    if scale_alg == 0:
        codes, recip = ocp_scales(blocks, fmt, zero_tiny_blocks=zero_tiny_blocks)
    else:
        codes, recip = cublas_scales(blocks, fmt, max_low_bound=max_low_bound)
    y = fp8_saturating(blocks * recip.unsqueeze(-1), fmt)
    y = y.reshape(*x_last.shape[:-1], -1)[..., : x_last.shape[-1]]
    return y, codes


def pair_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., nb] -> [..., P, 2], an odd count padded with code 0."""
    nb = codes.shape[-1]
    if nb % 2:
        codes = torch.cat([codes, torch.zeros(*codes.shape[:-1], 1, dtype=codes.dtype)], dim=-1)
    return codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)


def quantize_along(x: torch.Tensor, axis: int, block_size: int, fmt: torch.dtype, scale_alg: int, *,
                   zero_tiny_blocks: bool, max_low_bound: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x: any shape, ``axis`` >= 0 -> (y like x in ``fmt``, mxscale uint8 = x.shape with
    shape[axis] -> P, plus a trailing 2)."""
    moved = x.movedim(axis, -1)
    y, codes = quantize_last_axis(moved, block_size, fmt, scale_alg, zero_tiny_blocks=zero_tiny_blocks,
                                  max_low_bound=max_low_bound)
    # Fresh row-major allocations, as the real outputs are (op-plugin DynamicMxQuantKernelNpuOpApi.cpp
    # and the dual-axis / grouped ones: apply_tensor_without_format(shape)): ``.contiguous()`` would
    # keep the moved strides of size-1 dims, which the GEMMs' stride-based transpose checks read.
    fresh = torch.contiguous_format
    return y.movedim(-1, axis).clone(memory_format=fresh), pair_codes(codes).movedim(-2, axis).clone(memory_format=fresh)
