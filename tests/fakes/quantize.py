"""npu_quantize with div_mode=True (aclnnQuantize) for HiFloat8 and FP8 outputs.

Numerics (hicann/ops-nn ``quant/quantize/op_kernel/arch35/quantize_per_tensor_no_offset_regbase.h``
and the per-channel variants, ``quantize.h`` cast traits; formula in ``docs/aclnnQuantize.md``
``out = round((x / scales) + zeroPoints)``): x and scales cast to fp32, ``Div`` (div mode), add
the zero point when given, then cast: HiFloat8 SAT + CAST_ROUND (the tiling passes
TPL_ROUND_MODE_NONE, whose HiFloat8 trait is CAST_ROUND), FP8 SAT + CAST_RINT. FLOAT16 scales are
cast to FLOAT32 first (``aclnn_quantize.cpp``: ``l0op::Cast(scalesContiguous, DT_FLOAT)``).
Scales of size 1 apply to every element; otherwise ``scales.numel() == x.shape[axis]``.
"""
from __future__ import annotations

import torch

from tests.fakes.capability import FakeNpuConfig
from tests.fakes.dtypes import HIFLOAT8, QUANTIZED_SCALAR_CODES, SCALAR_TYPE_CODE, acl_of_tensor, fp8_saturating, hif8_encode
from tests.fakes.vendor_errors import aclnn_check, missing_kernel, not_modelled, torch_check

API = "aclnnQuantize"
# op-plugin QuantizeKernelNpuOpApi.cpp QUANTIZE_SUPPORT_MAP keys (note: torch_npu.float8_e4m3fn
# (292) / float8_e5m2 (291) are NOT accepted, torch.float8_e4m3fn (24) / torch.float8_e5m2 (23) are)
SUPPORTED_DTYPE_CODES = {
    QUANTIZED_SCALAR_CODES["QUInt8"]: torch.uint8, QUANTIZED_SCALAR_CODES["QInt8"]: torch.int8,
    QUANTIZED_SCALAR_CODES["QInt32"]: torch.int32, SCALAR_TYPE_CODE[torch.uint8]: torch.uint8,
    SCALAR_TYPE_CODE[torch.int8]: torch.int8, SCALAR_TYPE_CODE[torch.int32]: torch.int32,
    SCALAR_TYPE_CODE[torch.float8_e4m3fn]: torch.float8_e4m3fn, SCALAR_TYPE_CODE[torch.float8_e5m2]: torch.float8_e5m2,
    HIFLOAT8: torch.uint8,
}


def quantize(config: FakeNpuConfig, input, scales, zero_points, dtype, axis, div_mode):
    """x [..] fp32/fp16/bf16, scales [1] or [x.shape[axis]] -> y like x (uint8 HiFloat8 codes or float8)."""
    x = input
    if not div_mode:
        raise not_modelled("npu_quantize(div_mode=False) (aclnnAscendQuant path)")
    # op-plugin: DO_COMPATIBILITY(aclnnQuantize, acl_op::npu_quantize(...)) falls back to the acl_op
    # path when the kernel is missing; the fake does not model that path.
    if not config.has_kernel(API):
        raise missing_kernel(API)
    torch_check(dtype in SUPPORTED_DTYPE_CODES,
                "Param (dtype) must be Int8, UInt8, Int32, HiFloat8, Float8_e4m3fn, Float8_e5m2")
    if dtype not in (HIFLOAT8, SCALAR_TYPE_CODE[torch.float8_e4m3fn], SCALAR_TYPE_CODE[torch.float8_e5m2]):
        raise not_modelled(f"npu_quantize to integer dtype code {dtype}")
    # aclnn_quantize.cpp GetSocSupportDtypeMap: HIFLOAT8 / FLOAT8 outputs exist on DAV_3510 (950) only
    aclnn_check(config.is_950(), API, f"Param dtype should be in dtype support list of SoC {config.chip}")
    # aclnn CheckDtypeValid (DAV_3510): x, scales in {FLOAT, FLOAT16, BF16}; BF16 scales need BF16 x
    x_acl, s_acl = acl_of_tensor(x), acl_of_tensor(scales)
    aclnn_check(x_acl in ("FLOAT", "FLOAT16", "BF16"), API, f"x dtype {x.dtype} not in [FLOAT, FLOAT16, BF16]")
    aclnn_check(s_acl in ("FLOAT", "FLOAT16", "BF16"), API, f"scales dtype {scales.dtype} not in [FLOAT, FLOAT16, BF16]")
    aclnn_check(s_acl != "BF16" or x_acl == "BF16", API, "scales BF16 requires x BF16")
    # docs/aclnnQuantize.md: "如果x的dtype不是FLOAT32，scales的dtype需要和x的dtype一致" (the
    # checks above would let FLOAT32 scales with BF16 x through; the fake enforces the documented rule)
    aclnn_check(x_acl == "FLOAT" or s_acl == x_acl, API,
                f"If the dtype of x ({x.dtype}) is not FLOAT32, the dtype of scales ({scales.dtype}) must be the same")
    if zero_points is not None:
        aclnn_check(zero_points.dim() == 1, API, "Input zeroPoints shape only support 1 dimension.")
        aclnn_check(zero_points.numel() == scales.numel(), API, "Scales size should be equal to zeroPoints size.")
    # aclnn CheckShapeValid
    aclnn_check(x.dim() <= 8, API, "x dim must be <= 8")
    aclnn_check(scales.dim() == 1, API, "Input scales shape only support 1 dimension.")
    size = scales.shape[0]
    if size != 1:
        aclnn_check(-x.dim() <= axis < x.dim(), API,
                    f"Axis out of range (expected to be in range of [-{x.dim()}, {x.dim() - 1}], but got {axis})")
        axis = axis + x.dim() if axis < 0 else axis
        aclnn_check(size == x.shape[axis], API,
                    f"The size of scales must equal to 1 or the specified dimension of x, which is {x.shape[axis]}.")
    values = x.to(torch.float32)
    s = scales.to(torch.float32)
    zp = zero_points.to(torch.float32) if zero_points is not None else None
    if size != 1:
        view = [1] * x.dim()
        view[axis] = size
        s = s.reshape(view)
        zp = zp.reshape(view) if zp is not None else None
    quotient = values / s
    if zp is not None:
        quotient = quotient + zp
    if dtype == HIFLOAT8:
        return hif8_encode(quotient)
    fmt = torch.float8_e4m3fn if dtype == SCALAR_TYPE_CODE[torch.float8_e4m3fn] else torch.float8_e5m2
    return fp8_saturating(quotient, fmt)
