"""npu_grouped_matmul (Tensor group_list overload) in MX and HiFloat8 modes, group_type 0 and 2.

Sources: op-plugin ``GroupedMatmulKernelNpuOpApi.cpp`` (group_type, kernel selection, check_dims,
output allocation, dtype wrappers), cannmirror/ops-transformer master ``gmm/grouped_matmul/
op_api/grouped_matmul_950_checker.cpp`` (quant checks on Ascend 950), ``op_api/aclnn_grouped_matmul.cpp``
(CheckCommonParam, CheckGroupListCommonTensor), ``docs/aclnnGroupedMatmulV4.md`` (formulas,
shapes, per-group scale offsets), ``gmm/common/cgmct/kernel/kernel_qgmm_mx.h`` (group walk and
scale offsets), ``op_kernel/arch35/quant_adaptive_sliding_window_templates/gqmm_init_output.h``
(split-K groups with k = 0 get a zero output).

View-shape contract (single tensors, ``split_item`` 2 or 3):
  group_type 0 (split M): x [M, K] (not transposed), weight [G, K, N] (a transposed view of
    [G, N, K] allowed), group_list int64 [G]; MX: scale [G, ceil(K/64), N, 2] (transposed like
    weight), per_token_scale [M, ceil(K/64), 2], both uint8 + *_dtype=torch_npu.float8_e8m0fnu;
    out [M, N]; rows past the last group are never written.
  group_type 2 (split K): x [M, K] must be a transposed view (of a contiguous [K, M]), weight
    [K, N] contiguous; MX: per_token_scale [M, K//64 + G, 2] transposed view (of [K//64 + G, M, 2]),
    scale [K//64 + G, N, 2]; group g reads pair-rows from ``cumK_g // 64 + g``
    (kernel_qgmm_mx.h UpdateOffset ``scaleK = (bOffset / n / 64 + groupIdx) * 2``; docs: scale_i
    offset "((K_0 + ... + K_{i-1}) / 64 + g_i) * N * 2"); out [G, M, N].
  HiF8: x / weight uint8 with x_dtype = weight_dtype = torch_npu.hifloat8, scale float32 [G],
    [G, 1] or [G, N]; per_token_scale float32: split M [M] (pertoken) or [G] / [G, 1]
    (pertensor); split K [G, M] or [G] / [G, 1]; out_g = (x_g @ w_g) * scale_g * per_token_scale_g.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tests.fakes.capability import FakeNpuConfig
from tests.fakes.dtypes import acl_of_code, acl_of_tensor, torch_dtype_of_acl
from tests.fakes.gemm_common import (
    cast_out, decode_hif8, decode_mx, gmm_is_special_mx_case, gmm_is_transpose_for_mx_shape,
    gmm_is_transpose_last_two_dims, mx_codes_along_k,
)
from tests.fakes.vendor_errors import aclnn_check, not_modelled, torch_check

SPLIT_M, SPLIT_K = 0, 2
FP8 = ("FLOAT8_E4M3FN", "FLOAT8_E5M2")
MAX_GROUPS = 1024  # docs: "groupListOptional第1维最大支持1024"
POISON_OUT = float("nan")  # output elements the kernel never writes (allocated uninitialised)


def _wrapper_acl(tensors, code, default_when_empty):
    """op-plugin TensorListWrapper dtype: the *_dtype code when given, else the first tensor's type."""
    if code is not None:
        return acl_of_code(code)
    if not tensors:
        return default_when_empty
    return acl_of_tensor(tensors[0])


@dataclass(frozen=True)
class GmmOperands:
    """One quantized call after the front checks: single tensors, their ACL types and layout facts."""

    api: str
    x: torch.Tensor
    w: torch.Tensor
    scale: torch.Tensor
    pts: torch.Tensor | None
    x_acl: str
    w_acl: str
    scale_acl: str
    pts_acl: str
    bias: object
    group_type: int
    transpose_x: bool
    transpose_w: bool
    sizes: list[int]
    out_dtype: torch.dtype


def grouped_matmul(config: FakeNpuConfig, x, weight, bias, scale, offset, antiquant_scale, antiquant_offset,
                   per_token_scale, group_list, activation_input, activation_quant_scale, activation_quant_offset,
                   split_item, group_type, group_list_type, act_type, tuning_config, output_dtype, x_dtype,
                   weight_dtype, scale_dtype, per_token_scale_dtype):
    """-> [y]: one output tensor (see the module docstring)."""
    num_weight, num_group_list, split_item = _op_plugin_front(config, x, weight, group_list, split_item, group_type)
    ops = _quant_common(config, x, weight, bias, scale, offset, per_token_scale, group_list, split_item, group_type,
                        group_list_type, act_type, output_dtype, x_dtype, weight_dtype, scale_dtype,
                        per_token_scale_dtype, num_weight, num_group_list)
    if ops.x_acl in FP8 and ops.w_acl in FP8 and ops.scale_acl == "FLOAT8_E8M0":
        _mx_checks(ops)
        return [cast_out(_mx_split_m(ops) if ops.group_type == SPLIT_M else _mx_split_k(ops), ops.out_dtype)]
    if ops.x_acl == "HIFLOAT8" and ops.w_acl == "HIFLOAT8":
        scale_gn = _hif8_checks(ops)
        out = _hif8_split_m(ops, scale_gn) if ops.group_type == SPLIT_M else _hif8_split_k(ops, scale_gn)
        return [cast_out(out, ops.out_dtype)]
    raise not_modelled(f"quantized npu_grouped_matmul with x {ops.x_acl}, weight {ops.w_acl}, scale {ops.scale_acl}")


def _op_plugin_front(config, x, weight, group_list, split_item, group_type) -> tuple[int, int, int]:
    """op-plugin npu_grouped_matmul (Tensor group_list) before the aclnn call."""
    torch_check(group_type is not None, "Requires manual passing group_type, current is None.")
    torch_check(group_type in (-1, SPLIT_M, SPLIT_K), "Use Tensor input with current cann version, "
                f"The group type must be -1, 0 or 2, but now is [{group_type}]")
    if not config.has_kernel("aclnnGroupedMatmulV4"):
        torch_check(group_list is None, "group_list don't support Tensor input with current cann version. "
                    "Please update cann version to 8.0.RC3 or higher, or use List[int] as input.")
        raise not_modelled("npu_grouped_matmul through aclnnGroupedMatmul (no GroupedMatmulV4 in this CANN)")
    single_weight = len(weight) == 1 and weight[0].dim() == 3
    num_weight = weight[0].size(0) if single_weight else len(weight)
    num_group_list = group_list.size(0) if group_list is not None else 0
    split_item = 0 if split_item is None else split_item
    _check_dims(split_item, len(x), num_weight, num_group_list)
    return num_weight, num_group_list, split_item


def _quant_common(config, x, weight, bias, scale, offset, per_token_scale, group_list, split_item, group_type,
                  group_list_type, act_type, output_dtype, x_dtype, weight_dtype, scale_dtype, per_token_scale_dtype,
                  num_weight, num_group_list) -> GmmOperands:
    """aclnn_grouped_matmul.cpp CheckCommonParam / CheckGroupListCommonTensor and
    grouped_matmul_950_checker.cpp CheckGroupedMatmulDAV3510 for the quantized modes."""
    api = "aclnnGroupedMatmulV4"  # FP8 / x_dtype inputs always take V4 (op-plugin dtypeValid)
    out_acl = acl_of_code(output_dtype) if output_dtype is not None else acl_of_tensor(x[0])
    x_acl, w_acl = _wrapper_acl(x, x_dtype, None), _wrapper_acl(weight, weight_dtype, None)
    scale_acl = _wrapper_acl(scale or [], scale_dtype, "UINT64")
    pts_acl = _wrapper_acl(per_token_scale or [], per_token_scale_dtype, "FLOAT")
    y_count = 1 if split_item in (2, 3) else (num_weight if group_type == SPLIT_K else max(num_group_list, len(x)))
    if x_acl not in FP8 + ("HIFLOAT8", "INT8"):
        raise not_modelled(f"npu_grouped_matmul with x {x_acl} (non-quantized or unmodelled mode)")
    aclnn_check(config.is_950(), api, f"quantized {x_acl} grouped matmul is not supported on SoC {config.chip}")
    if group_list is not None:
        aclnn_check(group_list.dim() == 1, api, f"the shape of [groupList] is not supported, got [dim num "
                    f"{group_list.dim()}]. Constraint:[dim num should be 1 when groupListType is {group_list_type}]")
    act_type = 0 if act_type is None else act_type
    aclnn_check(act_type == 0, api, f"[actType] is not supported, got [{act_type}]")  # docs: quant (non-int8) actType 0 only
    group_list_type = 0 if group_list_type is None else group_list_type
    if group_list_type == 2:
        raise not_modelled("npu_grouped_matmul with group_list_type 2 (sparse [E, 2] group list)")
    aclnn_check(group_list_type in (0, 1), api, f"[groupListType] is not supported, got [{group_list_type}].")
    aclnn_check(out_acl == "INT32" or scale, api, "in quant case and when the output dtype is not int32, the value "
                "of scale cannot be nullptr")
    aclnn_check(group_list is not None, api, "in quant case, the value of groupList cannot be nullptr")
    aclnn_check(not offset, api, "offset must be nullptr")
    aclnn_check(len(x) == 1 and len(weight) == 1 and y_count == 1, api,
                "in quant case, only single-single-single or weightNz single-multi-single tensor layout is supported")
    aclnn_check(len(scale) == 1 and (per_token_scale is None or len(per_token_scale) == 1), api,
                "the number of scale / perTokenScale tensors must equal the number of x tensors")
    if group_type == -1:
        raise not_modelled("quantized npu_grouped_matmul with group_type -1")
    groups = num_weight if group_type == SPLIT_M else num_group_list
    aclnn_check(group_list.dtype == torch.int64, api, "Invalid dtype: Only int64 is supported for groupList.")
    aclnn_check(num_group_list <= MAX_GROUPS, api, f"size of groupList {num_group_list} should be less than or equal to 1024")
    aclnn_check(num_group_list == groups or groups == 1, api, f"When groupList is not null, size of groupList(tensor) "
                f"{num_group_list} should be equal to {'weight dim 0' if group_type == SPLIT_M else 'y dim 0'} {groups} "
                f"with groupType {group_type}.")
    aclnn_check(out_acl in ("FLOAT16", "BF16", "FLOAT"), api,
                f"y dtype {out_acl} not in FLOAT16, BFLOAT16 or FLOAT32 (output_dtype None means the dtype of x)")
    return GmmOperands(api, x[0], weight[0], scale[0], per_token_scale[0] if per_token_scale else None, x_acl, w_acl,
                       scale_acl, pts_acl, bias, group_type, gmm_is_transpose_last_two_dims(x[0]),
                       gmm_is_transpose_last_two_dims(weight[0]),
                       _group_sizes(group_list, group_list_type, x[0], group_type, api), torch_dtype_of_acl(out_acl))


def _check_dims(split_item: int, num_x: int, num_weight: int, num_group_list: int) -> None:
    """op-plugin check_dims."""
    torch_check(num_x > 0 and num_weight > 0, "Invalid inputs: neither x nor weight could be empty.")
    torch_check(split_item in (0, 1, 2, 3), f"Invalid value of split_item [{split_item}], which should only be one of 0/1/2/3.")
    if split_item in (0, 1):
        if num_group_list > 0:
            torch_check(num_x == 1 and num_weight == num_group_list,
                        "Invalid inputs. When split_item = 0 or 1 and input group_list is not None, the following two "
                        "conditions are supposed to be satisfied: (1) length of x equals 1; (2) length of weight equals "
                        f"that of group_list. Actual lengths: x [{num_x}], weight [{num_weight}], group_list [{num_group_list}].")
        else:
            torch_check(num_x == num_weight, "When split_item = 0 or 1 and input group_list is None, the num of x "
                        f"tensors must equal the num of weight tensors.Actual lengths: x [{num_x}], weight [{num_weight}].")


def _group_sizes(group_list: torch.Tensor, group_list_type: int, xt: torch.Tensor, group_type: int, api: str) -> list[int]:
    """Per-group sizes along the grouped axis (kernel GetSplitValueFromGroupList: type 0 cumulative
    ends, type 1 sizes). docs: type 0 non-negative non-decreasing, type 1 non-negative, total <= the
    grouped axis. The kernel reads the values on the device without checks; the fake rejects what
    the docs forbid (README: stricter than the real op here)."""
    values = [int(v) for v in group_list.tolist()]
    sizes = [b - a for a, b in zip([0] + values[:-1], values)] if group_list_type == 0 else values
    axis_len = xt.shape[0] if group_type == SPLIT_M else xt.shape[1]
    if any(s < 0 for s in sizes) or sum(sizes) > axis_len:
        raise RuntimeError(f"fake torch_npu: group_list {values} (type {group_list_type}) breaks the documented "
                           f"contract for an axis of {axis_len}; the real kernel's result is undefined")
    return sizes


def _mx_checks(o: GmmOperands) -> None:
    """CheckGroupedMatmulMxfp8: dtypes, transposition, dims and shapes of the MX operands."""
    api, pt, st, wt, xt = o.api, o.pts, o.scale, o.w, o.x
    aclnn_check(o.bias is None, api, "bias must be nullptr")
    aclnn_check(pt is not None, api, "in mx case, the value of perTokenScale cannot be nullptr")
    aclnn_check(o.pts_acl == "FLOAT8_E8M0", api, f"perTokenScale dtype {o.pts_acl} not FLOAT8_E8M0")
    if o.group_type == SPLIT_M:
        aclnn_check(not o.transpose_x, api, "when groupType is 0 (split m) and in mx case, the value of x transposition must be false")
    else:
        aclnn_check(not o.transpose_w and o.transpose_x, api, "when groupType is 2 (split K) and in mx case, the value of x "
                    "and weight transposition must be true/false")
    # CheckGroupedMatmulMxScaleTranspose
    if not gmm_is_special_mx_case(st):
        aclnn_check(gmm_is_transpose_for_mx_shape(st) == o.transpose_w, api,
                    "in mx case, the values of scale and weight transposition must be the same")
    if not gmm_is_special_mx_case(pt):
        aclnn_check(gmm_is_transpose_for_mx_shape(pt) == o.transpose_x, api,
                    "in mx case, the values of perTokenScale and x transposition must be the same")
    g = len(o.sizes)
    aclnn_check(xt.dim() == 2, api, f"x dim {xt.dim()} must be 2")
    m, k = xt.shape
    if o.group_type == SPLIT_M:  # CheckGroupedMatmulPerGroupDim + CheckMxTypeMCaseInputShape
        aclnn_check(wt.dim() == 3 and st.dim() == 4 and pt.dim() == 3, api,
                    "split m mx: weight must be 3-D, scale 4-D and perTokenScale 3-D")
        n, pk = wt.shape[2], math.ceil(k / 64)
        aclnn_check(wt.shape[1] == k, api, "axis K of weight must equal axis K of x")
        aclnn_check(pt.shape[0] == m, api, f"axis M of x must be equal to axis M of perTokenScale [{pt.shape[0]}]")
        aclnn_check(st.shape[2] == n, api, f"axis N of weight must be equal to axis N of scale [{st.shape[2]}]")
        aclnn_check(st.shape[0] == g, api, f"axis group of scale must be equal to axis 0 of groupTensor [{g}]")
        aclnn_check(st.shape[1] == pk, api, f"axis K of scale must be equal to ceil(k/64) [{pk}]")
        aclnn_check(pt.shape[1] == pk, api, f"axis K of perTokenScale must be equal to ceil(k/64) [{pk}]")
        aclnn_check(pt.shape[2] == 2 and st.shape[3] == 2, api, "current scale / perTokenScale last axis is not 2")
        return
    # CheckMxFp8TypeKCaseInputShape
    aclnn_check(wt.dim() == 2 and st.dim() == 3 and pt.dim() == 3, api,
                "split k mx: x and weight must be 2-D, scale and perTokenScale 3-D")
    rows = k // 64 + g
    aclnn_check(wt.shape[0] == k, api, "axis K of weight must equal axis K of x")
    aclnn_check(pt.shape[0] == m, api, f"axis M of x must be equal to axis M of perTokenScale [{pt.shape[0]}]")
    aclnn_check(st.shape[1] == wt.shape[1], api, f"axis N of weight must be equal to axis N of scale [{st.shape[1]}]")
    aclnn_check(pt.shape[1] == rows, api, "axis K of perTokenScale must be equal to axis K of x divided by 64, plus "
                f"groupSize [{rows}]")
    aclnn_check(st.shape[0] == rows, api, f"axis K of scale must be equal to axis K of x divided by 64, plus groupSize [{rows}]")
    aclnn_check(st.shape[2] == 2 and pt.shape[2] == 2, api, "when split K in MX quant mode, current scale last axis is not 2")


def _mx_split_m(o: GmmOperands) -> torch.Tensor:
    """out [M, N] float32: rows of group g = x_g @ w_g with their E8M0 scales; rows past the groups: poison."""
    m, k = o.x.shape
    a = decode_mx(o.x, mx_codes_along_k(o.pts, k, k_axis=1))
    out = torch.full((m, o.w.shape[2]), POISON_OUT, dtype=torch.float32)
    start = 0
    for g, size in enumerate(o.sizes):
        if size:
            b = decode_mx(o.w[g], mx_codes_along_k(o.scale[g], k, k_axis=0))
            out[start:start + size] = a[start:start + size] @ b
        start += size
    return out


def _mx_split_k(o: GmmOperands) -> torch.Tensor:
    """out [G, M, N] float32: group g = x[:, K_g] @ w[K_g] with scales from pair-row cumK_g // 64 + g."""
    m = o.x.shape[0]
    out = torch.empty((len(o.sizes), m, o.w.shape[1]), dtype=torch.float32)
    start = 0
    for g, size in enumerate(o.sizes):
        first = start // 64 + g  # kernel_qgmm_mx.h UpdateOffset
        if size == 0:
            out[g] = 0.0  # gqmm_init_output.h: split-K group with k = 0 -> zeros
        else:
            pairs = math.ceil(size / 64)
            a = decode_mx(o.x[:, start:start + size], mx_codes_along_k(o.pts[:, first:first + pairs], size, k_axis=1))
            b = decode_mx(o.w[start:start + size], mx_codes_along_k(o.scale[first:first + pairs], size, k_axis=0))
            out[g] = a @ b
        start += size
    return out


def _hif8_checks(o: GmmOperands) -> torch.Tensor:
    """CheckFp8Hif8QuantParams / CheckNonPerGroupQuantDim / Shape (non per-tile) -> scale as [G, 1 or N]."""
    api, pt, st = o.api, o.pts, o.scale
    aclnn_check(o.scale_acl in ("UINT64", "FLOAT", "INT64"), api, f"scale dtype {o.scale_acl} not in UINT64, INT64 or FLOAT32")
    aclnn_check(o.bias is None, api, "bias must be nullptr")
    if o.group_type == SPLIT_M:  # CheckNonMxQuantTransposeStatus
        aclnn_check(not o.transpose_x, api, "in non-pergroup quantification mode and when groupType is 0 (split M), the "
                    "value of x transposition must be false")
    else:
        aclnn_check(o.transpose_x and not o.transpose_w, api, "in non-pergroup quantification mode and when groupType "
                    "is 2 (split K), the value of x and weight transposition must be true/false")
    if o.scale_acl != "FLOAT":
        raise not_modelled("HiF8 npu_grouped_matmul with an int64/uint64 (static) scale")
    if pt is not None:
        aclnn_check(o.pts_acl == "FLOAT", api, f"perTokenScale dtype {o.pts_acl} not FLOAT32")
        aclnn_check(pt.dim() in (1, 2), api, f"perTokenScale dim {pt.dim()} not 1 or 2")
    g, (m, k), n = len(o.sizes), o.x.shape, o.w.shape[-1]
    aclnn_check(st.dim() in (1, 2), api, f"scale dim {st.dim()} not 1 or 2")
    aclnn_check(st.shape[0] == g, api, f"in non-pergroup quantification mode, axis 0 of scale must be equal to axis 0 of groupTensor [{g}]")
    if st.dim() == 2:
        aclnn_check(st.shape[1] in (1, n), api, f"in non-pergroup quantification mode, axis N of scale must be 1 or equal to axis N of weight [{n}]")
    if o.group_type == SPLIT_M:
        aclnn_check(o.w.dim() == 3 and o.w.shape[0] == g and o.w.shape[1] == k, api, "split m: weight must be [G, K, N]")
        if pt is not None and pt.dim() == 1:
            aclnn_check(pt.shape[0] in (m, g), api, f"axis 0 of perTokenScale must be equal to axis M of x [{m}] or axis 0 of groupTensor [{g}]")
        elif pt is not None:
            aclnn_check(pt.shape[0] == g and pt.shape[1] == 1, api, "perTokenScale with 2 dims must be [g, 1]")
    else:
        aclnn_check(o.w.dim() == 2 and o.w.shape[0] == k, api, "split k: weight must be [K, N]")
        if pt is not None:
            aclnn_check(pt.shape[0] == g, api, f"axis 0 of perTokenScale must be equal to axis 0 of groupTensor [{g}]")
            if pt.dim() == 2:
                aclnn_check(pt.shape[1] in (m, 1), api, f"axis 1 of perTokenScale must be equal to axis M of x [{m}] or 1")
    return st.to(torch.float32).reshape(g, -1)


def _hif8_split_m(o: GmmOperands, scale_gn: torch.Tensor) -> torch.Tensor:
    """out [M, N]: rows of group g = (x_g @ w_g) * scale_g * per_token_scale (docs: pertoken when the
    shape is (M,), also when g == M; pertensor when (g,) / (g, 1)); rows past the groups: poison."""
    m = o.x.shape[0]
    a = decode_hif8(o.x)
    out = torch.full((m, o.w.shape[-1]), POISON_OUT, dtype=torch.float32)
    pertoken = o.pts is not None and o.pts.dim() == 1 and o.pts.shape[0] == m
    start = 0
    for g, size in enumerate(o.sizes):
        if size:
            y = (a[start:start + size] @ decode_hif8(o.w[g])) * scale_gn[g].reshape(1, -1)
            if o.pts is not None:
                pts = o.pts.to(torch.float32)
                y = y * (pts[start:start + size].reshape(-1, 1) if pertoken else pts.reshape(-1)[g])
            out[start:start + size] = y
        start += size
    return out


def _hif8_split_k(o: GmmOperands, scale_gn: torch.Tensor) -> torch.Tensor:
    """out [G, M, N]: group g = (x[:, K_g] @ w[K_g]) * scale_g * per_token_scale_g ([M] row or scalar)."""
    m = o.x.shape[0]
    out = torch.empty((len(o.sizes), m, o.w.shape[-1]), dtype=torch.float32)
    start = 0
    for g, size in enumerate(o.sizes):
        if size == 0:
            out[g] = 0.0  # gqmm_init_output.h (built for the per-tensor cube kernels too)
        else:
            y = (decode_hif8(o.x[:, start:start + size]) @ decode_hif8(o.w[start:start + size])) * scale_gn[g].reshape(1, -1)
            if o.pts is not None:
                row = o.pts.to(torch.float32)[g]
                y = y * (row.reshape(-1, 1) if row.numel() == m and m != 1 else row.reshape(-1)[0])
            out[g] = y
        start += size
    return out
