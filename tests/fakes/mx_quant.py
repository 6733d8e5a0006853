"""npu_dynamic_mx_quant, npu_dynamic_mx_quant_with_dual_axis, npu_grouped_dynamic_mx_quant.

Each function takes the fake's config and the schema-bound arguments and returns what the real op
returns: y as torch.float8_e4m3fn / float8_e5m2, mxscale as uint8 E8M0 codes (op-plugin allocates
mxscale as ``at::ScalarType::Byte`` and wraps it as ACL_FLOAT8_E8M0). Checks are applied in the
order the real stack applies them: op-plugin TORCH_CHECKs, kernel version selection, then the
aclnn / tiling checks. Sources per rule in comments; paths are hicann/ops-nn unless stated,
"op-plugin" = Ascend/op-plugin ``op_plugin/ops/opapi/<Op>KernelNpuOpApi.cpp``,
"docs" = the torch_npu wheel's ``_op_plugin_docs.py`` entry of the op.
"""
from __future__ import annotations

import math

import torch

from tests.fakes.capability import FakeNpuConfig
from tests.fakes.dtypes import acl_of_code, acl_of_tensor
from tests.fakes.mx_block import quantize_along
from tests.fakes.vendor_errors import aclnn_check, missing_kernel, not_modelled, torch_check

FP8_ACL = {"FLOAT8_E4M3FN": torch.float8_e4m3fn, "FLOAT8_E5M2": torch.float8_e5m2}
FP4_ACL = ("FLOAT4_E2M1", "FLOAT4_E1M2")
ROUND_MODES = ("rint", "round", "floor")  # tiling GetRoundMode: rint / round / floor
POISON_SCALE = 0xFF  # E8M0 NaN: bytes the kernel never writes (outputs are allocated uninitialised)
POISON_DATA = 0x7F  # E4M3 / E5M2 NaN, same purpose for y


def _dst_format(api: str, dst_type: int) -> torch.dtype:
    """dst_type code -> float8 dtype (c10_npu::GetAclDataType; FP8 and FP4 are the supported y types,
    tiling Y_SUPPORT_DTYPE_SET)."""
    acl = acl_of_code(dst_type)
    if acl in FP4_ACL:
        raise not_modelled(f"{api} with FP4 dst_type {dst_type}")
    aclnn_check(acl in FP8_ACL, api, f"The dtype of y must be DT_FLOAT4_E2M1, DT_FLOAT4_E1M2, "
                f"DT_FLOAT8_E4M3FN, or DT_FLOAT8_E5M2, got dst_type {dst_type}")
    return FP8_ACL[acl]


def _require_950(config: FakeNpuConfig, api: str, *, dt_only: bool = False) -> None:
    # op_host/config/ascend950/*_binary.json: the only SoC these kernels are built for; the aclnn
    # docs list "Ascend 950PR/Ascend 950DT" only. dt_only: torch_npu docs of the dual-axis and
    # grouped ops say "该接口仅在Ascend 950DT上支持".
    aclnn_check(config.is_950(), api, f"SoC {config.chip} is not supported (kernel built for ascend950 only)")
    if dt_only:
        aclnn_check(config.is_950dt(), api, f"SoC {config.chip}: the torch_npu docs support this op on Ascend 950DT only")


def _check_round_mode(api: str, round_mode: str) -> None:
    # dynamic_mx_quant_tiling_arch35.cpp GetAttr: "The value of round_mode must be [rint, round,
    # floor]" and "If the dtype of output y is FLOAT8_E4M3FN/FLOAT8_E5M2, parameter round_mode must be rint"
    aclnn_check(round_mode in ROUND_MODES, api, "The value of round_mode must be [rint, round, floor]")
    aclnn_check(round_mode == "rint", api,
                "If the dtype of output y is FLOAT8_E4M3FN/FLOAT8_E5M2, parameter round_mode must be rint")


def _check_fp8_scale_alg(api: str, scale_alg: int) -> None:
    # tiling: "The value of scale_alg must be [0, 1, 2]"; "If the dtype of output y is
    # FLOAT8_E4M3FN/FLOAT8_E5M2, parameter scale_alg must be 0 or 1"
    aclnn_check(scale_alg in (0, 1, 2), api, "The value of scale_alg must be [0, 1, 2]")
    aclnn_check(scale_alg != 2, api,
                "If the dtype of output y is FLOAT8_E4M3FN/FLOAT8_E5M2, parameter scale_alg must be 0 or 1")


def _check_dst_type_max_range(api: str, dst_type_max: float) -> None:
    # dynamic_mx_quant_tiling_arch35.cpp / dual-axis tiling: range-checked whatever the y dtype; the FP8
    # paths then ignore it (docs: "不支持设置dst_type_max" for FP8 -- sources disagree, see README)
    aclnn_check(dst_type_max == 0 or 6 <= dst_type_max <= 12, api,
                "The value of dst_type_max must be within the range [6, 12] or equal to 0")


# --------------------------------------------------------------------------- npu_dynamic_mx_quant
def dynamic_mx_quant(config: FakeNpuConfig, input, axis, round_mode, dst_type, block_size, scale_alg,
                     dst_type_max, max_low_bound):
    """x [..] fp16/bf16 (fp32 from CANN 9.1.0) -> (y like x, mxscale [.., P along axis, .., 2])."""
    x = input
    ndim = x.dim()
    # op-plugin DynamicMxQuantKernelNpuOpApi.cpp
    torch_check(-ndim <= axis < ndim, "Param (axis) is out of input dimension range")
    torch_check(block_size % 32 == 0 and 0 < block_size <= 1024,
                "Param (block_size) must be divisible by 32 and no greater than 1024, greater than 0")
    scale_alg = 0 if scale_alg is None else scale_alg  # op-plugin: scale_alg.value_or(DEFAULT_SCALE_ALG)
    # op-plugin: V3 if present, else V2 (no max_low_bound), else V1 (no dst_type_max, no max_low_bound)
    if config.has_kernel("aclnnDynamicMxQuantV3"):
        api = "aclnnDynamicMxQuantV3"
    elif config.has_kernel("aclnnDynamicMxQuantV2"):
        api, max_low_bound = "aclnnDynamicMxQuantV2", 0.0
    elif config.has_kernel("aclnnDynamicMxQuant"):
        api, max_low_bound, dst_type_max = "aclnnDynamicMxQuant", 0.0, 0.0
    else:
        raise missing_kernel("aclnnDynamicMxQuant")
    fmt = _dst_format(api, dst_type)
    _require_950(config, api)
    # tiling CheckDtype: x in {FLOAT16, BF16, FLOAT}; FLOAT only since CANN 9.1.0 (def.cpp per branch)
    x_acl = acl_of_tensor(x)
    allowed = ("FLOAT16", "BF16", "FLOAT") if config.has_feature("dynamic_mx_quant_fp32_input") else ("FLOAT16", "BF16")
    aclnn_check(x_acl in allowed, api, f"x dtype {x.dtype} is not supported, expected one of {allowed}")
    _check_round_mode(api, round_mode)
    # tiling GetAttr: block_size (0, 1024] and a multiple of 32; FLOAT x needs block_size 32
    aclnn_check(x_acl != "FLOAT" or block_size == 32, api,
                "If the dtype of input x is FLOAT, parameter block_size must be 32")
    _check_fp8_scale_alg(api, scale_alg)
    _check_dst_type_max_range(api, dst_type_max)
    # tiling (V3 attr): "max_low_bound must be 0 when scale_alg != 1", "must be non-negative"
    aclnn_check(scale_alg == 1 or max_low_bound == 0, api, "max_low_bound must be 0 when scale_alg != 1")
    aclnn_check(max_low_bound >= 0, api, "max_low_bound must be non-negative")
    # tiling CheckShape: "The shape dim of x must be within the range [1, 7]"
    aclnn_check(1 <= ndim <= 7, api, "The shape dim of x must be within the range [1, 7]")
    axis = axis + ndim if axis < 0 else axis
    # tiling BaseCalc: "FP32 input with quantization axis size less than 32 is not supported"
    aclnn_check(x_acl != "FLOAT" or x.shape[axis] >= 32, api,
                "FP32 input with quantization axis size less than 32 is not supported")
    # Tail axis with block_size 32 runs the tail-axis kernel, everything else the not-tail-axis
    # kernels; both zero the elements of blocks whose shared exponent clamps to 0 (mx_block.py).
    return quantize_along(x, axis, block_size, fmt, scale_alg, zero_tiny_blocks=True, max_low_bound=max_low_bound)


# ------------------------------------------------------------ npu_dynamic_mx_quant_with_dual_axis
def dynamic_mx_quant_with_dual_axis(config: FakeNpuConfig, input, round_mode, dst_type, scale_alg, dst_type_max):
    """x [.., M, N] fp16/bf16 -> (y1, mxscale1 [.., M, ceil(N/64), 2], y2, mxscale2 [.., ceil(M/64), N, 2])."""
    x = input
    # op-plugin DynamicMxQuantWithDualAxisKernelNpuOpApi.cpp
    torch_check(x.dim() >= 2, "The input should be at least 2D")
    if config.has_kernel("aclnnDynamicMxQuantWithDualAxisV2"):
        api = "aclnnDynamicMxQuantWithDualAxisV2"
    elif config.has_kernel("aclnnDynamicMxQuantWithDualAxis"):
        # op-plugin: without V2, dst_type_max is dropped with a TORCH_NPU_WARN_ONCE
        api, dst_type_max = "aclnnDynamicMxQuantWithDualAxis", 0.0
    else:
        raise missing_kernel("aclnnDynamicMxQuantWithDualAxis")
    dst_type_max = 0.0 if dst_type_max is None else dst_type_max
    fmt = _dst_format(api, dst_type)
    _require_950(config, api, dt_only=True)
    # dual-axis tiling: "The dtype of x must be DT_FLOAT16 or DT_BF16"
    aclnn_check(acl_of_tensor(x) in ("FLOAT16", "BF16"), api, "The dtype of x must be DT_FLOAT16 or DT_BF16")
    # tiling: "The value of round_mode must be rint, floor, or round" / FP8 -> rint only
    _check_round_mode(api, round_mode)
    _check_fp8_scale_alg(api, scale_alg)
    _check_dst_type_max_range(api, dst_type_max)
    aclnn_check(x.dim() <= 7, api, "The shape dim of x must be within the range [2, 7]")  # aclnn doc: 2-7 dims
    # The dual-axis kernel's zero mask is on the raw block exponent (mx_block.py).
    y1, s1 = quantize_along(x, x.dim() - 1, 32, fmt, scale_alg, zero_tiny_blocks=False)
    y2, s2 = quantize_along(x, x.dim() - 2, 32, fmt, scale_alg, zero_tiny_blocks=False)
    return y1, s1, y2, s2


# --------------------------------------------------------------------- npu_grouped_dynamic_mx_quant
def grouped_dynamic_mx_quant(config: FakeNpuConfig, x, group_index, round_mode, dst_type, blocksize, scale_alg,
                             dst_type_max):
    """x [M, N] fp16/bf16, group_index [G] int32 cumulative group ends ->
    (y [M, N], mxscale [M // 64 + G, N, 2]) where group g (rows s_g..e_g) fills pair-rows
    ``s_g // 64 + g ...`` and no byte outside the groups' pair-rows is written.

    grouped_dynamic_mx_quant_combine.h ProcessOneLoop:
    ``scaleOffset = (groupStart / 64 + groupIdx + blockColIdx) * rowSize_ * 2 + ...`` with 64-row
    chunks (two 32-row blocks, DIST_INTLV_B8 into the pair) relative to groupStart; a chunk of
    <= 32 rows writes code 0 in the second slot (``Duplicate(scaleReg1, 0)``).
    quant_common/op_kernel/grouped_split_base.h ProcessBase: groups with end - start <= 0 are skipped.
    """
    # op-plugin GroupedDynamicMxQuantKernelNpuOpApi.cpp
    torch_check(x.dim() == 2, f"X dimNum should be 2, got {x.dim()}")
    torch_check(group_index.dim() == 1, f"Group_index dimNum should be 1, got {group_index.dim()}")
    torch_check(blocksize == 32, f"Parameter blocksize must be 32, got {blocksize}")
    torch_check(scale_alg in (0, 1, 2), f"Parameter scale_alg must be 0, 1 or 2, got {scale_alg}")
    if config.has_kernel("aclnnGroupedDynamicMxQuantV2"):
        api = "aclnnGroupedDynamicMxQuantV2"
    elif config.has_kernel("aclnnGroupedDynamicMxQuant"):
        api = "aclnnGroupedDynamicMxQuant"
        # op-plugin: the schema defaults (scale_alg=0, dst_type_max=0.0) already count as set, so
        # on a CANN without V2 every call must pass scale_alg=None, dst_type_max=None explicitly.
        torch_check(scale_alg is None and dst_type_max is None,
                    "The current CANN version does not support the parameter scale_alg and dst_type_max. "
                    "It is recommended to upgrade the CANN package.")
    else:
        raise missing_kernel("aclnnGroupedDynamicMxQuant")
    scale_alg = 0 if scale_alg is None else scale_alg
    fmt = _dst_format(api, dst_type)
    _require_950(config, api, dt_only=True)
    # aclnn_grouped_dynamic_mx_quant_v2.cpp CheckDtypeValid: x FLOAT16/BF16, groupIndex INT32
    aclnn_check(acl_of_tensor(x) in ("FLOAT16", "BF16"), api, f"x dtype {x.dtype} not in [FLOAT16, BFLOAT16]")
    aclnn_check(group_index.dtype == torch.int32, api, f"groupIndex dtype {group_index.dtype} not in [INT32]")
    _check_round_mode(api, round_mode)
    _check_fp8_scale_alg(api, scale_alg)
    # aclnn: "groupIndex does not support empty values."
    aclnn_check(group_index.numel() > 0, api, "groupIndex does not support empty values.")
    m, n = x.shape
    ends = [int(v) for v in group_index.tolist()]
    # Sources: the docs require group_index >= 0, non-decreasing, last == x.shape[0]; the kernel does
    # not check (values live on the device). The fake rejects what would read out of bounds or
    # overlap instead of guessing (README: stricter than the real op here).
    prev = 0
    for g, end in enumerate(ends):
        if end < prev or end > m:
            raise RuntimeError(f"fake torch_npu: group_index {ends} breaks the documented contract "
                               f"(non-decreasing, within [0, {m}]); the real kernel's result is undefined")
        prev = end
    scale = torch.full((m // 64 + len(ends), n, 2), POISON_SCALE, dtype=torch.uint8)
    y = torch.full((m, n), POISON_DATA, dtype=torch.uint8).view(fmt)
    start = 0
    for g, end in enumerate(ends):
        if end - start > 0:
            y_g, s_g = quantize_along(x[start:end], 0, 32, fmt, scale_alg, zero_tiny_blocks=True)
            y[start:end] = y_g
            first = start // 64 + g
            scale[first:first + s_g.shape[0]] = s_g
        start = end
    return y, scale


def grouped_scale_rows(sizes: list[int]) -> list[tuple[int, int]]:
    """[(first pair-row, number of pair-rows)] per group for group sizes ``sizes`` (kernel rule)."""
    out, start = [], 0
    for g, size in enumerate(sizes):
        out.append((start // 64 + g, math.ceil(size / 64)))
        start += size
    return out


__all__ = ["dynamic_mx_quant", "dynamic_mx_quant_with_dual_axis", "grouped_dynamic_mx_quant",
           "grouped_scale_rows", "POISON_SCALE", "POISON_DATA"]
