"""npu_quant_max: quantize with a given (multiplied) scale and return amax; with group_list it is the
vendor's per-group (per-expert along dim 0) variant, aclnnGroupedQuantMax.

Sources: op-plugin ``QuantMaxKernelNpuOpApi.cpp`` (group_list absent or of size <= 1 ->
aclnnQuantMax with amax [1], else aclnnGroupedQuantMax with amax [G]; y allocated as
convert_to_scalar_type(dst)), hicann/ops-nn ``quant/quant_max/README.md`` /
``quant/grouped_quant_max/README.md`` (``y = Cast(x * scale)``, ``amax = max(|x|)`` in x's dtype,
group_list int64 cumsum along dim 0 with the last value == x.shape[0], 1..384 groups, round_mode
"rint" for FP8 and "round"/"hybrid" for HiFloat8), ``op_api/aclnn_grouped_quant_max.cpp`` (dtype
checks), ``op_kernel/arch35/grouped_quant_max_regbase.h`` (fp32 ``Mul(x, scale)``, then the SAT
cast: CAST_ROUND for "round", CAST_RINT for FP8).
"""
from __future__ import annotations

import torch

from tests.fakes.capability import FakeNpuConfig
from tests.fakes.dtypes import acl_of_code, acl_of_tensor, fp8_saturating, hif8_encode
from tests.fakes.vendor_errors import aclnn_check, not_modelled, torch_check

FORMATS = {"HIFLOAT8": None, "FLOAT8_E5M2": torch.float8_e5m2, "FLOAT8_E4M3FN": torch.float8_e4m3fn}
MAX_GROUPS = 384  # grouped_quant_max README: "num_groups的范围目前仅支持1-384"


def quant_max(config: FakeNpuConfig, x, scale, round_mode, dst_dtype, group_list):
    """x [T, ..] fp32/fp16/bf16, scale fp32 [1] (or [G] with group_list [G] int64 cumsum) ->
    (y like x: uint8 HiFloat8 codes or float8, amax [1] or [G] in x's dtype)."""
    grouped = group_list is not None and group_list.shape[0] > 1
    api = "aclnnGroupedQuantMax" if grouped else "aclnnQuantMax"
    torch_check(config.has_kernel(api), "Current CANN version do not support this api: "
                f"{'npu_grouped_quant_max' if grouped else 'npu_quant_max'}. Please try to update the version of CANN.")
    aclnn_check(config.is_950(), api, f"SoC {config.chip} is not supported (arch35 kernels only)")
    acl = acl_of_code(dst_dtype)
    aclnn_check(acl in FORMATS, api, f"dstType {dst_dtype} must be 34 (HIFLOAT8), 35 (FLOAT8_E5M2) or 36 (FLOAT8_E4M3FN)")
    aclnn_check(acl_of_tensor(x) in ("FLOAT", "FLOAT16", "BF16"), api, f"x dtype {x.dtype} not in FLOAT, FLOAT16, BFLOAT16")
    aclnn_check((2 if grouped else 1) <= x.dim() <= 8, api, f"x dim {x.dim()} out of range")
    aclnn_check(scale.dtype == torch.float32, api, f"scale dtype {scale.dtype} not FLOAT")
    aclnn_check(scale.numel() > 0, api, "scale does not support empty tensor")
    if acl == "HIFLOAT8":
        aclnn_check(round_mode in ("round", "hybrid"), api, "roundMode must be 'round' or 'hybrid' for dstType HIFLOAT8(34)")
        if round_mode == "hybrid":
            raise not_modelled("npu_quant_max with round_mode 'hybrid' (CAST_HYBRID)")
    else:
        aclnn_check(round_mode == "rint", api, "roundMode must be 'rint' for dstType FLOAT8_E5M2(35) or FLOAT8_E4M3FN(36)")
    values = x.to(torch.float32)
    if grouped:
        aclnn_check(group_list.dtype == torch.int64, api, f"groupList dtype {group_list.dtype} not INT64")
        groups = group_list.shape[0]
        aclnn_check(groups <= MAX_GROUPS, api, f"num_groups {groups} not in [1, {MAX_GROUPS}]")
        aclnn_check(scale.shape == (groups,), api, f"scale shape must be [{groups}]")
        ends = [int(v) for v in group_list.tolist()]
        if any(b < a for a, b in zip([0] + ends[:-1], ends)) or ends[-1] != x.shape[0]:
            raise RuntimeError(f"fake torch_npu: group_list {ends} breaks the documented contract (increasing "
                               f"cumsum ending at x.shape[0] = {x.shape[0]}); the real kernel's result is undefined")
        owner = torch.repeat_interleave(torch.arange(groups), torch.tensor([b - a for a, b in zip([0] + ends[:-1], ends)]))
        factor = scale.to(torch.float32)[owner].reshape((-1,) + (1,) * (x.dim() - 1))
        amax = torch.stack([values[a:b].abs().amax() if b > a else torch.tensor(0.0)
                            for a, b in zip([0] + ends[:-1], ends)])
    else:
        aclnn_check(scale.numel() == 1, api, "scale shape must be [1]")
        factor = scale.to(torch.float32).reshape(())
        amax = values.abs().amax().reshape(1)
    product = values * factor
    y = hif8_encode(product) if acl == "HIFLOAT8" else fp8_saturating(product, FORMATS[acl])
    return y, amax.to(x.dtype)
