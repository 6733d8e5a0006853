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


def grouped_matmul(config: FakeNpuConfig, x, weight, bias, scale, offset, antiquant_scale, antiquant_offset,
                   per_token_scale, group_list, activation_input, activation_quant_scale, activation_quant_offset,
                   split_item, group_type, group_list_type, act_type, tuning_config, output_dtype, x_dtype,
                   weight_dtype, scale_dtype, per_token_scale_dtype):
    """-> [y]: one output tensor (see the module docstring)."""
    # op-plugin npu_grouped_matmul (Tensor group_list)
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
    out_acl = acl_of_code(output_dtype) if output_dtype is not None else acl_of_tensor(x[0])
    x_acl = _wrapper_acl(x, x_dtype, None)
    w_acl = _wrapper_acl(weight, weight_dtype, None)
    scale_acl = _wrapper_acl(scale or [], scale_dtype, "UINT64")
    pts_acl = _wrapper_acl(per_token_scale or [], per_token_scale_dtype, "FLOAT")
    y_count = 1 if split_item in (2, 3) else (num_weight if group_type == SPLIT_K else max(num_group_list, len(x)))
    api = "aclnnGroupedMatmulV4"  # FP8 / x_dtype inputs always take V4 (op-plugin dtypeValid)
    quant = x_acl in FP8 + ("HIFLOAT8", "INT8")
    if not quant:
        raise not_modelled(f"npu_grouped_matmul with x {x_acl} (non-quantized or unmodelled mode)")
    # grouped_matmul_950_checker.cpp CheckGroupedMatmulDAV3510 runs on Ascend 950 only
    aclnn_check(config.is_950(), api, f"quantized {x_acl} grouped matmul is not supported on SoC {config.chip}")
    # aclnn_grouped_matmul.cpp CheckCommonParam
    if group_list is not None:
        aclnn_check(group_list.dim() == 1, api, f"the shape of [groupList] is not supported, got [dim num "
                    f"{group_list.dim()}]. Constraint:[dim num should be 1 when groupListType is {group_list_type}]")
    act_type = 0 if act_type is None else act_type
    aclnn_check(act_type == 0, api, f"[actType] is not supported, got [{act_type}]")  # docs: quant (non-int8) actType 0 only
    group_list_type = 0 if group_list_type is None else group_list_type
    if group_list_type == 2:
        raise not_modelled("npu_grouped_matmul with group_list_type 2 (sparse [E, 2] group list)")
    aclnn_check(group_list_type in (0, 1), api, f"[groupListType] is not supported, got [{group_list_type}].")
    # CheckGroupedMatmulDAV3510
    y_int32 = out_acl == "INT32"
    aclnn_check(y_int32 or scale, api, "in quant case and when the output dtype is not int32, the value of scale "
                "cannot be nullptr")
    aclnn_check(group_list is not None, api, "in quant case, the value of groupList cannot be nullptr")
    aclnn_check(not offset, api, "offset must be nullptr")
    aclnn_check(group_type != 1, api, "the value of groupType must be in 0 or 2")
    aclnn_check(len(x) == 1 and len(weight) == 1 and y_count == 1, api,
                "in quant case, only single-single-single or weightNz single-multi-single tensor layout is supported")
    aclnn_check(len(scale) == 1 and (per_token_scale is None or len(per_token_scale) == 1), api,
                "the number of scale / perTokenScale tensors must equal the number of x tensors")
    if group_type == -1:
        raise not_modelled("quantized npu_grouped_matmul with group_type -1")
    xt, wt, st = x[0], weight[0], scale[0]
    pt = per_token_scale[0] if per_token_scale else None
    groups = num_weight if group_type == SPLIT_M else num_group_list
    # CheckGroupListCommonTensor
    aclnn_check(group_list.dtype == torch.int64, api, "Invalid dtype: Only int64 is supported for groupList.")
    aclnn_check(num_group_list <= MAX_GROUPS, api, f"size of groupList {num_group_list} should be less than or equal to 1024")
    aclnn_check(num_group_list == groups or groups == 1, api, f"When groupList is not null, size of groupList(tensor) "
                f"{num_group_list} should be equal to {'weight dim 0' if group_type == SPLIT_M else 'y dim 0'} {groups} "
                f"with groupType {group_type}.")
    transpose_x = gmm_is_transpose_last_two_dims(xt)
    transpose_w = gmm_is_transpose_last_two_dims(wt)
    aclnn_check(out_acl in ("FLOAT16", "BF16", "FLOAT"), api,
                f"y dtype {out_acl} not in FLOAT16, BFLOAT16 or FLOAT32 (output_dtype None means the dtype of x)")
    out_dtype = torch_dtype_of_acl(out_acl)
    sizes = _group_sizes(group_list, group_list_type, xt, group_type, api)
    if x_acl in FP8 and w_acl in FP8 and scale_acl == "FLOAT8_E8M0":
        return [_mx(api, xt, wt, st, pt, pts_acl, bias, group_type, transpose_x, transpose_w, sizes, out_dtype)]
    if x_acl == "HIFLOAT8" and w_acl == "HIFLOAT8":
        return [_hif8(api, xt, wt, st, pt, pts_acl, scale_acl, bias, group_type, transpose_x, transpose_w, sizes,
                      out_dtype)]
    raise not_modelled(f"quantized npu_grouped_matmul with x {x_acl}, weight {w_acl}, scale {scale_acl}")


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


def _mx(api, xt, wt, st, pt, pts_acl, bias, group_type, transpose_x, transpose_w, sizes, out_dtype):
    """CheckGroupedMatmulMxfp8 then the MX product per group."""
    aclnn_check(bias is None, api, "bias must be nullptr")
    aclnn_check(pt is not None, api, "in mx case, the value of perTokenScale cannot be nullptr")
    aclnn_check(pts_acl == "FLOAT8_E8M0", api, f"perTokenScale dtype {pts_acl} not FLOAT8_E8M0")
    if group_type == SPLIT_M:
        aclnn_check(not transpose_x, api, "when groupType is 0 (split m) and in mx case, the value of x transposition must be false")
    else:
        aclnn_check(not transpose_w and transpose_x, api, "when groupType is 2 (split K) and in mx case, the value of x and "
                    "weight transposition must be true/false")
    # CheckGroupedMatmulMxScaleTranspose
    if not gmm_is_special_mx_case(st):
        aclnn_check(gmm_is_transpose_for_mx_shape(st) == transpose_w, api,
                    "in mx case, the values of scale and weight transposition must be the same")
    if not gmm_is_special_mx_case(pt):
        aclnn_check(gmm_is_transpose_for_mx_shape(pt) == transpose_x, api,
                    "in mx case, the values of perTokenScale and x transposition must be the same")
    g = len(sizes)
    aclnn_check(xt.dim() == 2, api, f"x dim {xt.dim()} must be 2")
    m, k = xt.shape
    if group_type == SPLIT_M:
        # CheckGroupedMatmulPerGroupDim + CheckMxTypeMCaseInputShape
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
        a = decode_mx(xt, mx_codes_along_k(pt, k, k_axis=1))
        out = torch.full((m, n), POISON_OUT, dtype=torch.float32)
        start = 0
        for gi, size in enumerate(sizes):
            if size:
                b = decode_mx(wt[gi], mx_codes_along_k(st[gi], k, k_axis=0))
                out[start:start + size] = a[start:start + size] @ b
            start += size
        return cast_out(out, out_dtype)
    # split K: CheckMxFp8TypeKCaseInputShape
    aclnn_check(wt.dim() == 2 and st.dim() == 3 and pt.dim() == 3, api,
                "split k mx: x and weight must be 2-D, scale and perTokenScale 3-D")
    n = wt.shape[1]
    rows = k // 64 + g
    aclnn_check(wt.shape[0] == k, api, "axis K of weight must equal axis K of x")
    aclnn_check(pt.shape[0] == m, api, f"axis M of x must be equal to axis M of perTokenScale [{pt.shape[0]}]")
    aclnn_check(st.shape[1] == n, api, f"axis N of weight must be equal to axis N of scale [{st.shape[1]}]")
    aclnn_check(pt.shape[1] == rows, api, "axis K of perTokenScale must be equal to axis K of x divided by 64, plus "
                f"groupSize [{rows}]")
    aclnn_check(st.shape[0] == rows, api, f"axis K of scale must be equal to axis K of x divided by 64, plus groupSize [{rows}]")
    aclnn_check(st.shape[2] == 2 and pt.shape[2] == 2, api, "when split K in MX quant mode, current scale last axis is not 2")
    out = torch.empty((g, m, n), dtype=torch.float32)
    start = 0
    for gi, size in enumerate(sizes):
        first = start // 64 + gi  # kernel_qgmm_mx.h UpdateOffset
        if size == 0:
            out[gi] = 0.0  # gqmm_init_output.h: split-K group with k = 0 -> zeros
        else:
            pairs = math.ceil(size / 64)
            a = decode_mx(xt[:, start:start + size], mx_codes_along_k(pt[:, first:first + pairs], size, k_axis=1))
            b = decode_mx(wt[start:start + size], mx_codes_along_k(st[first:first + pairs], size, k_axis=0))
            out[gi] = a @ b
        start += size
    return cast_out(out, out_dtype)


def _hif8(api, xt, wt, st, pt, pts_acl, scale_acl, bias, group_type, transpose_x, transpose_w, sizes, out_dtype):
    """CheckFp8Hif8QuantParams (non per-tile) then (x_g @ w_g) * scale_g * per_token_scale_g."""
    aclnn_check(scale_acl in ("UINT64", "FLOAT", "INT64"), api, f"scale dtype {scale_acl} not in UINT64, INT64 or FLOAT32")
    aclnn_check(bias is None, api, "bias must be nullptr")
    # CheckNonMxQuantTransposeStatus
    if group_type == SPLIT_M:
        aclnn_check(not transpose_x, api, "in non-pergroup quantification mode and when groupType is 0 (split M), the "
                    "value of x transposition must be false")
    else:
        aclnn_check(transpose_x and not transpose_w, api, "in non-pergroup quantification mode and when groupType is 2 "
                    "(split K), the value of x and weight transposition must be true/false")
    if scale_acl != "FLOAT":
        raise not_modelled("HiF8 npu_grouped_matmul with an int64/uint64 (static) scale")
    if pt is not None:
        aclnn_check(pts_acl == "FLOAT", api, f"perTokenScale dtype {pts_acl} not FLOAT32")
    g = len(sizes)
    m, k = xt.shape
    n = wt.shape[-1]
    # CheckNonPerGroupQuantDim / Shape
    aclnn_check(st.dim() in (1, 2), api, f"scale dim {st.dim()} not 1 or 2")
    aclnn_check(st.shape[0] == g, api, f"in non-pergroup quantification mode, axis 0 of scale must be equal to axis 0 of groupTensor [{g}]")
    if st.dim() == 2:
        aclnn_check(st.shape[1] in (1, n), api, f"in non-pergroup quantification mode, axis N of scale must be 1 or equal to axis N of weight [{n}]")
    scale_gn = st.to(torch.float32).reshape(g, -1)  # [G, 1] or [G, N]
    if pt is not None:
        aclnn_check(pt.dim() in (1, 2), api, f"perTokenScale dim {pt.dim()} not 1 or 2")
    if group_type == SPLIT_M:
        aclnn_check(wt.dim() == 3 and wt.shape[0] == g and wt.shape[1] == k, api, "split m: weight must be [G, K, N]")
        if pt is not None:
            if pt.dim() == 1:
                aclnn_check(pt.shape[0] in (m, g), api, f"axis 0 of perTokenScale must be equal to axis M of x [{m}] or axis 0 of groupTensor [{g}]")
            else:
                aclnn_check(pt.shape[0] == g and pt.shape[1] == 1, api, "perTokenScale with 2 dims must be [g, 1]")
        a = decode_hif8(xt)
        out = torch.full((m, n), POISON_OUT, dtype=torch.float32)
        start = 0
        for gi, size in enumerate(sizes):
            if size:
                y = (a[start:start + size] @ decode_hif8(wt[gi])) * scale_gn[gi].reshape(1, -1)
                if pt is not None:
                    # docs: pertoken when shape (M,) (also when g == M), pertensor when (g,) / (g, 1)
                    pertoken = pt.dim() == 1 and pt.shape[0] == m
                    factor = pt.to(torch.float32)[start:start + size].reshape(-1, 1) if pertoken else pt.to(torch.float32).reshape(-1)[gi]
                    y = y * factor
                out[start:start + size] = y
            start += size
        return cast_out(out, out_dtype)
    aclnn_check(wt.dim() == 2 and wt.shape[0] == k, api, "split k: weight must be [K, N]")
    if pt is not None:
        aclnn_check(pt.shape[0] == g, api, f"axis 0 of perTokenScale must be equal to axis 0 of groupTensor [{g}]")
        if pt.dim() == 2:
            aclnn_check(pt.shape[1] in (m, 1), api, f"axis 1 of perTokenScale must be equal to axis M of x [{m}] or 1")
    out = torch.empty((g, m, n), dtype=torch.float32)
    start = 0
    for gi, size in enumerate(sizes):
        if size == 0:
            out[gi] = 0.0  # gqmm_init_output.h (built for the per-tensor cube kernels too)
        else:
            y = (decode_hif8(xt[:, start:start + size]) @ decode_hif8(wt[start:start + size])) * scale_gn[gi].reshape(1, -1)
            if pt is not None:
                row = pt.to(torch.float32)[gi]
                y = y * (row.reshape(-1, 1) if row.numel() == m and m != 1 else row.reshape(-1)[0])
            out[gi] = y
        start += size
    return cast_out(out, out_dtype)
