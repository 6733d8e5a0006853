"""npu_dynamic_quant (symmetric) for HiFloat8 and FP8 outputs.

Numerics (hicann/ops-nn ``quant/dynamic_quant/op_kernel/arch35/dynamic_quant_regbase_full_load_pertensor.h``,
``..._large_shape_db_pertensor.h``, and ``tests/assets/golden.py``):
  scale = max over the reduction of fp32(|x| * fp32(1.0f / maxValue))   (Muls then ReduceMax)
  y     = cast(fp32(x) / scale)                                           (Div, then SAT cast)
with maxValue = dst_type_max for HiFloat8 (0 -> 32768, ``dynamic_quant_tiling_arch35.cpp``), 448 /
57344 for FP8; the HiFloat8 cast is CAST_ROUND (half away from zero), FP8 CAST_RINT, both SAT.
There is no zero guard: an all-zero reduction gives scale 0 and y = 0 / 0 = NaN, which the
golden encodes as the HiFloat8 NaN code 0x80 (``en_dtypes`` astype). The reduction is per row
(pertoken), over the whole tensor (pertensor, scale shape (1,)) or per column over dim -2
(perchannel). ``smooth_scales`` multiply x first (fp32).
"""
from __future__ import annotations

import torch

from tests.fakes.capability import FakeNpuConfig
from tests.fakes.dtypes import FP8_MAX, acl_of_code, acl_of_tensor, fp8_saturating, hif8_encode
from tests.fakes.vendor_errors import aclnn_check, not_modelled, torch_check

HIF8_DEFAULT_MAX = 32768.0  # dynamic_quant_tiling_arch35.cpp HIFLOAT8_MAX_VALUE
QUANT_MODES = ("pertoken", "pertensor", "perchannel")


def _select_api(config: FakeNpuConfig, quant_mode: str, dst_type_max: float) -> str:
    """op-plugin DynamicQuantKernelNpuOpApi.cpp select_version (+ DO_COMPATIBILITY for V2)."""
    if not config.has_kernel("aclnnDynamicQuantV2"):
        return "aclnnDynamicQuant"
    v3, v4 = config.has_kernel("aclnnDynamicQuantV3"), config.has_kernel("aclnnDynamicQuantV4")
    if not v3 and not v4:
        return "aclnnDynamicQuantV2"
    if dst_type_max != 0.0:
        torch_check(v4, "Can't support attr dst_type_max, please check CANN version.")
        return "aclnnDynamicQuantV4"
    if quant_mode != "pertoken":
        torch_check(v3, "Can't support attr quant_mode, please check CANN version.")
        return "aclnnDynamicQuantV4" if v4 else "aclnnDynamicQuantV3"
    return "aclnnDynamicQuantV2"


def dynamic_quant(config: FakeNpuConfig, input, smooth_scales, group_index, dst_type, quant_mode, dst_type_max):
    """x [.., T, H] fp16/bf16 -> (y like x, scale fp32: pertoken x.shape[:-1], pertensor (1,),
    perchannel x.shape[:-2] + (H,)). y is uint8 HiFloat8 codes for dst_type 290, float8 for FP8."""
    x = input
    # op-plugin: "Input shape dim should be greater than 1"
    torch_check(x.dim() > 1, "Input shape dim should be greater than 1")
    api = _select_api(config, quant_mode, dst_type_max)
    if api in ("aclnnDynamicQuant", "aclnnDynamicQuantV2") and quant_mode != "pertoken":
        # V2 has no quant_mode: op-plugin still allocates the pertensor / perchannel scale shape,
        # which aclnnDynamicQuantV2's shape check rejects (aclnn_dynamic_quant.cpp CheckShape).
        aclnn_check(False, api, "The shapes of x and scale should be consistent except for the last dimension of x.")
    # aclnnDynamicQuantV3/V4GetWorkspaceSize: "only support socVersion Ascend950" (IsRegbase)
    if api in ("aclnnDynamicQuantV3", "aclnnDynamicQuantV4"):
        aclnn_check(config.is_950(), api, f"{api} only support socVersion Ascend950")
    acl = _check_inputs(api, config, x, smooth_scales, group_index, dst_type, quant_mode, dst_type_max)
    values = x.to(torch.float32)
    if smooth_scales is not None:
        values = values * _smooth_factor(smooth_scales, group_index, values, quant_mode)
    if acl == "HIFLOAT8":
        max_value = dst_type_max if dst_type_max != 0 else HIF8_DEFAULT_MAX  # dstTypeMax only for HiFloat8
    else:
        max_value = FP8_MAX[torch.float8_e4m3fn if acl == "FLOAT8_E4M3FN" else torch.float8_e5m2]
    recip = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(max_value, dtype=torch.float32)
    scaled_abs = values.abs() * recip
    if quant_mode == "pertensor":
        scale = scaled_abs.amax().reshape(1)
        per_element = scale
    elif quant_mode == "pertoken":
        scale = scaled_abs.amax(dim=-1)
        per_element = scale.unsqueeze(-1)
    else:
        scale = scaled_abs.amax(dim=-2)
        per_element = scale.unsqueeze(-2)
    quotient = values / per_element  # no zero guard: 0 / 0 -> NaN
    if acl == "HIFLOAT8":
        y = hif8_encode(quotient)
    else:
        y = fp8_saturating(quotient, torch.float8_e4m3fn if acl == "FLOAT8_E4M3FN" else torch.float8_e5m2)
    return y, scale.to(torch.float32)


def _check_inputs(api, config, x, smooth_scales, group_index, dst_type, quant_mode, dst_type_max) -> str:
    """aclnn_dynamic_quant.cpp CheckAttr / CheckDtype / CheckShape and the arch35 tiling checks;
    returns the ACL type of y."""
    acl = acl_of_code(dst_type) if dst_type is not None else "INT8"  # op-plugin: None -> ACL_INT8
    if acl in ("INT8", "INT32", "INT4") or dst_type == 16:
        raise not_modelled(f"npu_dynamic_quant with dst_type {dst_type} (integer output)")
    # aclnn_dynamic_quant.cpp OUTPUT_DTYPE_SUPPORT_LIST_INT_WITH_FP_QUANT (regbase / Ascend 950)
    aclnn_check(acl in ("HIFLOAT8", "FLOAT8_E5M2", "FLOAT8_E4M3FN") and config.is_950(), api,
                f"y dtype for dst_type {dst_type} not in [INT4, INT8, INT32, HIFLOAT8, FLOAT8_E5M2, FLOAT8_E4M3FN]")
    # aclnn CheckAttr: quant mode values; perchannel (docs V4: also pertensor) without group_index
    aclnn_check(quant_mode in QUANT_MODES, api, "quantMode only support pertensor, pertoken and perchannel.")
    aclnn_check(quant_mode == "pertoken" or group_index is None, api,
                "If quantMode is pertensor or perchannel, groupIndexOptional must be nullptr.")
    # aclnn CheckDtype / tiling CheckInputDtype: x FLOAT16 / BF16 only on Ascend 950 (regbase)
    aclnn_check(acl_of_tensor(x) in ("FLOAT16", "BF16"), api, f"x dtype {x.dtype} not in [FLOAT16, BFLOAT16]")
    aclnn_check(x.dim() < 9, api, f"The dimNum[{x.dim()}] of x should be less than 9")
    if smooth_scales is not None:
        aclnn_check(smooth_scales.dtype == x.dtype, api, "The dtypes of x and smooth_scales are not equal.")
        if group_index is not None:
            aclnn_check(group_index.dim() == 1, api, "The dimNum of group_indexs should be equal to one.")
            # tiling CheckInputDtype: group_index DT_INT32 on Ascend 950
            aclnn_check(group_index.dtype == torch.int32, api, f"group_index dtype {group_index.dtype} not DT_INT32")
        else:
            aclnn_check(smooth_scales.dim() == 1, api, "The dimNum of smooth_scales should be equal to one.")
            want = x.shape[-2] if quant_mode == "perchannel" else x.shape[-1]
            aclnn_check(smooth_scales.shape[-1] == want, api, "The last dim of x and the dim of smooth_scales shoule be equal.")
    elif group_index is not None:
        raise not_modelled("npu_dynamic_quant group_index without smooth_scales")
    # tiling CheckAttrs: "The value of dst_type_max must be within the range [0, 32768]"
    aclnn_check(0 <= dst_type_max <= HIF8_DEFAULT_MAX, api, "The value of dst_type_max must be within the range [0, 32768]")

    return acl


def _smooth_factor(smooth_scales: torch.Tensor, group_index, values: torch.Tensor, quant_mode: str) -> torch.Tensor:
    """The smooth scale each element is multiplied with (kernel: Cast to fp32, then Mul): [H] along
    the last dim, [T] along dim -2 for perchannel, or row r of [E, H] for the rows of group r."""
    smooth = smooth_scales.to(torch.float32)
    if group_index is None:
        return smooth.unsqueeze(-1) if quant_mode == "perchannel" else smooth
    flat_rows = values.reshape(-1, values.shape[-1]).shape[0]
    owner = torch.zeros(flat_rows, dtype=torch.long)
    start = 0
    for g, end in enumerate(int(e) for e in group_index.tolist()):
        owner[start:end] = g
        start = end
    return smooth[owner].reshape(values.shape)
