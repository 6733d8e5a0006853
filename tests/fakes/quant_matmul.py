"""npu_quant_matmul in MX mode (FP8 x FP8 with E8M0 block scales) and HiFloat8 modes (2-D operands).

Sources: op-plugin ``QuantMatmulKernelNpuOpApi.cpp`` (kernel selection, group_sizes, output
allocation, transposition checks, ``npu_trans_quant_param`` of a float32 scale without
pertoken_scale), op-plugin ``op_api_common.h`` ``make_wrapper`` (a dtype code re-labels a 1-byte
tensor), hicann/ops-nn ``matmul/quant_batch_matmul_v4/docs/aclnnQuantMatmulV5.md`` (modes, shapes,
formulas) and ``matmul/quant_batch_matmul_v3/op_api/quant_matmul_checker.cpp`` (MX checks),
``quant/trans_quant_param_v2/README.md`` (FP19 truncation). torch_npu maps ``pertoken_scale`` to
x1Scale and ``scale`` to x2Scale.

View-shape contract (torch views; transposition lives in the strides):
  MX:   x1 [m, k] fp8, x2 [k, n] fp8, pertoken_scale [m, ceil(k/64), 2] uint8 with
        pertoken_scale_dtype=torch_npu.float8_e8m0fnu, scale [ceil(k/64), n, 2] likewise;
        x1 and pertoken_scale transposed alike, x2 and scale transposed alike.
  HiF8: x1 [m, k], x2 [k, n] uint8 with x1_dtype = x2_dtype = torch_npu.hifloat8; scale float32
        (1,) or (n,); pertoken_scale None or float32 (1,) or (m,).
"""
from __future__ import annotations

import math

import torch

from tests.fakes.capability import FakeNpuConfig
from tests.fakes.dtypes import acl_of_code, acl_of_tensor, code_name, torch_dtype_of_acl
from tests.fakes.gemm_common import (
    cast_out, decode_hif8, decode_mx, mx_codes_along_k, op_plugin_same_transpose,
)
from tests.fakes.vendor_errors import aclnn_check, not_modelled, torch_check

API = "aclnnQuantMatmulV5"
ACL_ITEMSIZE = {"HIFLOAT8": 1, "FLOAT8_E8M0": 1, "FLOAT8_E4M3FN": 1, "FLOAT8_E5M2": 1, "FLOAT4_E2M1": 1,
                "FLOAT4_E1M2": 1, "INT8": 1, "UINT8": 1, "FLOAT": 4, "FLOAT16": 2, "BF16": 2, "INT32": 4, "INT64": 8}
FP8 = ("FLOAT8_E4M3FN", "FLOAT8_E5M2")
FLOAT_OUT = ("FLOAT16", "BF16", "FLOAT")
MX_GROUP_SIZE = (1, 1, 32)  # quant_matmul_checker.cpp CheckMxGroupSize: groupSize 4295032864


def wrapped_acl(t: torch.Tensor | None, code: int | None) -> str | None:
    """op-plugin make_wrapper: the ACL type the kernel sees for ``t`` (``code`` re-labels it)."""
    if t is None:
        return None
    if code is None:
        return acl_of_tensor(t)
    acl = acl_of_code(code)
    torch_check(acl is not None and t.element_size() == ACL_ITEMSIZE.get(acl, -1),
                f"Tensor dtype:{t.dtype} itemsize:{t.element_size()}, is not compatible with "
                f"tensor_dtype:{code_name(code)} itemsize:{ACL_ITEMSIZE.get(acl, '?')}")
    return acl


def trans_quant_param_fp19(scale: torch.Tensor) -> torch.Tensor:
    """aclnnTransQuantParamV2/V3 with round_mode 0 (op-plugin's default): keep the top 19 bits of
    each float32 scale, ``scale & 0xFFFFE000`` (TransQuantParamV2 README), as float32."""
    bits = scale.to(torch.float32).contiguous().view(torch.int32)
    return (bits & torch.tensor(-8192, dtype=torch.int32)).view(torch.float32)  # -8192 == 0xFFFFE000


def quant_matmul(config: FakeNpuConfig, x1, x2, scale, offset, pertoken_scale, bias, output_dtype, x1_dtype, x2_dtype,
                 pertoken_scale_dtype, scale_dtype, group_sizes, y_scale):
    """-> out [m, n] of ``output_dtype`` (see the module docstring for the operand contract)."""
    # op-plugin: x2 not NZ -> aclnnQuantMatmulV5 must exist
    torch_check(config.has_kernel(API), "Get aclnnQuantMatmulV5 or aclnnQuantMatmulV5 failed, only "
                "aclnnQuantMatmulV5 support A8W4, please upgrade CANN.")
    # op-plugin check_and_get_groups
    if group_sizes is not None and len(group_sizes) > 0:
        torch_check(len(group_sizes) == 3, f"group_sizes only support input with three elements, but got {len(group_sizes)}")
        torch_check(all(0 <= g <= 65535 for g in group_sizes), "group param value must conform to range [0, 65535]")
    gs = tuple(group_sizes) if group_sizes else (0, 0, 0)
    # op-plugin: output dtype None -> int8, else GetAclDataType(output_dtype)
    out_acl = "INT8" if output_dtype is None else acl_of_code(output_dtype)
    torch_check(out_acl is not None, f"output_dtype {output_dtype} has no ACL type")
    x1_acl, x2_acl = wrapped_acl(x1, x1_dtype), wrapped_acl(x2, x2_dtype)
    x1s_acl, x2s_acl = wrapped_acl(pertoken_scale, pertoken_scale_dtype), wrapped_acl(scale, scale_dtype)
    # op-plugin need_check_trans: pertoken_scale given, (same ranks as x1/x2 or E8M0), both >= 2-D
    if pertoken_scale is not None and pertoken_scale.dim() >= 2 and scale.dim() >= 2 and (
            (pertoken_scale.dim() == x1.dim() and scale.dim() == x2.dim()) or x1s_acl == "FLOAT8_E8M0"):
        if x1s_acl != "FLOAT8_E8M0":
            d1s, d2s = pertoken_scale.dim() - 2, scale.dim() - 2
        elif pertoken_scale.dim() > 2:
            d1s, d2s = pertoken_scale.dim() - 3, scale.dim() - 3
        else:
            d1s = d2s = 0
        torch_check(op_plugin_same_transpose(x1, pertoken_scale, x1.dim() - 2, d1s),
                    "Input x1 tensor and pertoken_scale tensor's transpose are not same, please check input.")
        torch_check(op_plugin_same_transpose(x2, scale, x2.dim() - 2, d2s),
                    "Input x2 tensor and scale tensor's transpose are not same, please check input.")
    # op-plugin use_trans_quant_param: a float32 scale without pertoken_scale becomes an int64
    # quant param through npu_trans_quant_param(scale, offset) (round_mode 0)
    use_v5 = x1_dtype is not None or x1.dtype not in (torch.int32, torch.int8)
    static_fp32_scale = (scale.dtype == torch.float32 and pertoken_scale is None
                         and (out_acl != "BF16" or use_v5) and out_acl != "INT32")
    # aclnnQuantMatmulV5 on anything but Ascend 950 has no FP8 / HiF8 / MX mode (docs 产品支持情况)
    aclnn_check(config.is_950() or (x1_acl == x2_acl == "INT8"), API,
                f"x1/x2 dtypes {x1_acl}/{x2_acl} are only supported on Ascend 950, SoC is {config.chip}")
    if x1.dim() != 2 or x2.dim() != 2:
        raise not_modelled("npu_quant_matmul with batch dimensions")
    m, k = x1.shape
    k2, n = x2.shape
    # quant_matmul_checker.cpp: "k dim of x1 and x2 need be same" (meta: same message)
    aclnn_check(k == k2, API, "k dim of x1 and x2 need be same, please check k dim of x1 and x2")
    if x1s_acl == "FLOAT8_E8M0" and x2s_acl == "FLOAT8_E8M0":
        return _mx(config, x1, x2, scale, pertoken_scale, bias, out_acl, x1_acl, x2_acl, gs, m, k, n, offset, y_scale)
    if x1_acl == "HIFLOAT8" and x2_acl == "HIFLOAT8":
        return _hif8(x1, x2, scale, pertoken_scale, bias, out_acl, x1s_acl, x2s_acl, gs, m, n, offset, y_scale,
                     static_fp32_scale)
    raise not_modelled(f"npu_quant_matmul with x1 {x1_acl}, x2 {x2_acl}, x1Scale {x1s_acl}, x2Scale {x2s_acl}")


def _check_float_out(out_acl: str, mode: str) -> torch.dtype:
    # aclnnQuantMatmulV5.md "MX量化场景约束" / "T-C && T-T": out FLOAT16/BFLOAT16/FLOAT32
    aclnn_check(out_acl in FLOAT_OUT, API, f"in {mode} mode the output dtype must be FLOAT16, BFLOAT16 or FLOAT32, "
                f"got {out_acl} (output_dtype None means int8)")
    return torch_dtype_of_acl(out_acl)


def _mx(config, x1, x2, scale, pertoken_scale, bias, out_acl, x1_acl, x2_acl, gs, m, k, n, offset, y_scale):
    if x1_acl not in FP8 or x2_acl not in FP8:
        raise not_modelled(f"MX npu_quant_matmul with {x1_acl} x {x2_acl}")
    out_dtype = _check_float_out(out_acl, "mx")
    aclnn_check(offset is None and y_scale is None, API, "x2Offset / yScale must be null in mx mode")
    # quant_matmul_checker.cpp CheckMxGroupSize after InferGroupSize (zeros are inferred from shapes;
    # the fake assumes the inference lands on [1, 1, 32] for the shapes it accepts)
    inferred = tuple(want if got == 0 else got for got, want in zip(gs, MX_GROUP_SIZE))
    aclnn_check(inferred == MX_GROUP_SIZE, API, "when the quantization mode is mx, groupSize must be 4295032864 and "
                "Torch API group_sizes must be [1, 1, 32]")
    # CheckMxScaleMinDim / batch match: the fake models 2-D operands, so 3-D scales
    aclnn_check(pertoken_scale.dim() == 3 and scale.dim() == 3, API, "in mx mode x1Scale and x2Scale must be 3-D for 2-D x1/x2")
    # CheckDimValueMicroScaling (view order: pertoken_scale [M, K/64, 2], scale [K/64, N, 2])
    pk = math.ceil(k / 64)
    s1m, s1k = pertoken_scale.shape[0], pertoken_scale.shape[1]
    s2k, s2n = scale.shape[0], scale.shape[1]
    one1 = (s1m == 1 and s1k == m) or (s1m == m and s1k == 1) or (s1m == 1 and s1k == pk) or (s1m == pk and s1k == 1)
    one2 = (s2n == 1 and s2k == n) or (s2n == n and s2k == 1) or (s2n == 1 and s2k == pk) or (s2n == pk and s2k == 1)
    aclnn_check((one1 or s1m == m) and (one2 or s2n == n), API,
                "when the quantization mode is mx, the M dimension of x1 and x1Scale must be equal, and the N "
                "dimension of x2 and x2Scale must be equal")
    aclnn_check((one1 or s1k == pk) and (one2 or s2k == pk), API,
                "when the quantization mode is mx, the K dimension of x1Scale must be equal to the K dimension of x1 "
                "ceildivided by 64, and the K dimension of x2Scale must be equal to the K dimension of x2 ceildivided by 64")
    aclnn_check(pertoken_scale.shape[-1] == 2 and scale.shape[-1] == 2, API,
                "when the quantization mode is mx, the last dimension of x1Scale and x2Scale must be 2")
    if one1 and (s1m, s1k) != (m, pk) or one2 and (s2k, s2n) != (pk, n):
        raise not_modelled("MX npu_quant_matmul with broadcast (size-1) scale dims")
    if bias is not None:
        # aclnnQuantMatmulV5.md MX table: bias null/FLOAT32, shape (n,) or (1, n)
        aclnn_check(bias.dtype == torch.float32 and tuple(bias.shape) in ((n,), (1, n)), API,
                    "in mx mode bias must be FLOAT32 of shape (n,) or (1, n)")
    a = decode_mx(x1, mx_codes_along_k(pertoken_scale, k, k_axis=1))  # [m, k]
    b = decode_mx(x2, mx_codes_along_k(scale, k, k_axis=0))  # [k, n]
    out = a @ b
    if bias is not None:
        out = out + bias.reshape(1, n).to(torch.float32)
    return cast_out(out, out_dtype)


def _hif8(x1, x2, scale, pertoken_scale, bias, out_acl, x1s_acl, x2s_acl, gs, m, n, offset, y_scale, static_fp32_scale):
    out_dtype = _check_float_out(out_acl, "hifloat8")
    aclnn_check(offset is None and y_scale is None, API, "x2Offset / yScale must be null for hifloat8 inputs")
    if x2s_acl in ("INT64", "UINT64"):
        raise not_modelled("HiF8 npu_quant_matmul with a pre-converted int64 quant param")
    # aclnnQuantMatmulV5.md T-C/T-T and K-C/K-T tables: x1Scale null/FLOAT32, x2Scale FLOAT32
    aclnn_check(x2s_acl == "FLOAT" and (x1s_acl in (None, "FLOAT")), API,
                f"for hifloat8 inputs x1Scale must be null or FLOAT32 and x2Scale FLOAT32, got {x1s_acl}, {x2s_acl}")
    if any(gs):
        raise not_modelled("HiF8 npu_quant_matmul with group_sizes (G-B / B-B modes)")
    aclnn_check(scale.dim() == 1 and scale.shape[0] in (1, n), API, f"the shape of x2Scale must be [1] or [{n}]")
    if pertoken_scale is not None:
        aclnn_check(pertoken_scale.dim() == 1 and pertoken_scale.shape[0] in (1, m), API,
                    f"the shape of x1Scale must be [1] or [{m}]")
    if bias is not None:
        aclnn_check(bias.dtype == torch.float32 and tuple(bias.shape) in ((n,), (1, n)), API,
                    "for hifloat8 inputs bias must be FLOAT32 of shape (n,) or (1, n)")
    acc = decode_hif8(x1) @ decode_hif8(x2)
    bias_row = bias.reshape(1, n).to(torch.float32) if bias is not None else None
    if static_fp32_scale:
        # static T-T / T-C: out = (x1 @ x2 + bias) * x2Scale, x2Scale truncated to FP19
        out = acc + bias_row if bias_row is not None else acc
        out = out * trans_quant_param_fp19(scale).reshape(1, -1)
    else:
        # dynamic: out = x1 @ x2 * x2Scale * x1Scale + bias
        out = acc * scale.to(torch.float32).reshape(1, -1)
        if pertoken_scale is not None:
            out = out * pertoken_scale.to(torch.float32).reshape(-1, 1)
        out = out + bias_row if bias_row is not None else out
    return cast_out(out, out_dtype)

