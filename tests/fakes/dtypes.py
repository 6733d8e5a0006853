"""torch_npu dtype codes, the ACL data types they name, and byte codecs of the 8-bit formats.

Sources:
* ``torch_npu.<name>`` are plain ints: Ascend/pytorch ``torch_npu/csrc/custom_dtype/Init.cpp``
  binds ``DType.<name>`` with ``def_readonly_static`` and ``torch_npu/_init/core/_exports.py``
  (``_export_dtype_symbols``) copies them onto the module; ``Init.h`` defines each as
  ``ACL enum + 256`` (``TORCH_NPU_ENUM_OFFSET``), ACL enums from the wheel's
  ``include/acl/acl_base_rt.h``.
* ``dst_type`` / ``dtype`` / ``output_dtype`` arguments: ``c10_npu::GetAclDataType`` (Init.h):
  codes >= 256 are ACL enum + 256, smaller codes are ``at::ScalarType`` values (torch turns a
  ``torch.dtype`` passed to an ``int`` argument into its ScalarType value).
* E8M0 / E4M3 / E5M2 / HiFloat8 byte semantics: ml_dtypes / en_dtypes, the codecs the vendor's
  own goldens use (``quant/*/tests/assets/golden.py`` in hicann/ops-nn).
"""
from __future__ import annotations

import en_dtypes
import numpy as np
import torch

ACL_ENUM_OFFSET = 256  # Init.h: g_toAclOffset

# include/acl/acl_base_rt.h (aclDataType)
ACL = {
    "FLOAT": 0, "FLOAT16": 1, "INT8": 2, "INT32": 3, "UINT8": 4, "INT16": 6, "UINT16": 7, "UINT32": 8,
    "INT64": 9, "UINT64": 10, "DOUBLE": 11, "BOOL": 12, "STRING": 13, "COMPLEX64": 16, "COMPLEX128": 17,
    "BF16": 27, "INT4": 29, "UINT1": 30, "COMPLEX32": 33, "HIFLOAT8": 34, "FLOAT8_E5M2": 35,
    "FLOAT8_E4M3FN": 36, "FLOAT8_E8M0": 37, "FLOAT6_E3M2": 38, "FLOAT6_E2M3": 39, "FLOAT4_E2M1": 40,
    "FLOAT4_E1M2": 41,
}
ACL_NAME = {v: k for k, v in ACL.items()}

# Init.cpp: the python names torch_npu exports, and the ACL type each stands for.
TORCH_NPU_DTYPES = {
    "float32": "FLOAT", "float16": "FLOAT16", "int8": "INT8", "int32": "INT32", "uint8": "UINT8",
    "int16": "INT16", "uint16": "UINT16", "uint32": "UINT32", "int64": "INT64", "uint64": "UINT64",
    "float64": "DOUBLE", "bool": "BOOL", "string": "STRING", "complex64": "COMPLEX64",
    "complex128": "COMPLEX128", "bfloat16": "BF16", "int4": "INT4", "uint1": "UINT1", "complex32": "COMPLEX32",
    "hifloat8": "HIFLOAT8", "float8_e5m2": "FLOAT8_E5M2", "float8_e4m3fn": "FLOAT8_E4M3FN",
    "float8_e8m0fnu": "FLOAT8_E8M0", "float6_e3m2": "FLOAT6_E3M2", "float6_e2m3": "FLOAT6_E2M3",
    "float4_e2m1fn_x2": "FLOAT4_E2M1", "float4_e1m2fn_x2": "FLOAT4_E1M2",
}
TORCH_NPU_DTYPE_CODES = {name: ACL[acl] + ACL_ENUM_OFFSET for name, acl in TORCH_NPU_DTYPES.items()}
HIFLOAT8 = TORCH_NPU_DTYPE_CODES["hifloat8"]  # 290
FLOAT8_E8M0 = TORCH_NPU_DTYPE_CODES["float8_e8m0fnu"]  # 293

# at::ScalarType -> aclDataType for the types these ops meet (torch_npu's
# kATenScalarTypeToAclDataTypeTable; quantized ScalarTypes map to ACL_DT_UNDEFINED there).
_TORCH_TO_ACL = {
    torch.uint8: "UINT8", torch.int8: "INT8", torch.int16: "INT16", torch.int32: "INT32", torch.int64: "INT64",
    torch.float16: "FLOAT16", torch.float32: "FLOAT", torch.float64: "DOUBLE", torch.bool: "BOOL",
    torch.bfloat16: "BF16", torch.complex64: "COMPLEX64", torch.complex128: "COMPLEX128",
    torch.float8_e5m2: "FLOAT8_E5M2", torch.float8_e4m3fn: "FLOAT8_E4M3FN",
}
# ScalarType enum values (c10/core/ScalarType.h) of the torch dtypes above.
SCALAR_TYPE_CODE = {
    torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
    torch.float32: 6, torch.float64: 7, torch.complex64: 9, torch.complex128: 10, torch.bool: 11,
    torch.bfloat16: 15, torch.float8_e5m2: 23, torch.float8_e4m3fn: 24,
}
_SCALAR_CODE_TO_TORCH = {v: k for k, v in SCALAR_TYPE_CODE.items()}
QUANTIZED_SCALAR_CODES = {"QInt8": 12, "QUInt8": 13, "QInt32": 14, "QUInt4x2": 16}

# convert_to_scalar_type(acl): the torch dtype op-plugin allocates an output with.
_ACL_TO_TORCH = {
    "FLOAT": torch.float32, "FLOAT16": torch.float16, "BF16": torch.bfloat16, "INT8": torch.int8,
    "INT32": torch.int32, "UINT8": torch.uint8, "INT64": torch.int64, "FLOAT8_E5M2": torch.float8_e5m2,
    "FLOAT8_E4M3FN": torch.float8_e4m3fn,
    # HiFloat8 and E8M0 travel in uint8 tensors (op-plugin QuantizeKernelNpuOpApi.cpp maps HIFLOAT8
    # to at::ScalarType::Byte; every MX op allocates mxscale as Byte).
    "HIFLOAT8": torch.uint8, "FLOAT8_E8M0": torch.uint8,
}


def acl_of_code(code: int) -> str | None:
    """``c10_npu::GetAclDataType(code)``: the ACL type name a dtype code stands for, None if none."""
    if code >= ACL_ENUM_OFFSET:
        return ACL_NAME.get(code - ACL_ENUM_OFFSET)
    dtype = _SCALAR_CODE_TO_TORCH.get(code)
    return _TORCH_TO_ACL.get(dtype) if dtype is not None else None


def acl_of_tensor(t: torch.Tensor) -> str | None:
    """The ACL type op-plugin gives a tensor from its torch dtype (None: not representable)."""
    return _TORCH_TO_ACL.get(t.dtype)


def torch_dtype_of_acl(acl: str) -> torch.dtype:
    """``npu_preparation::convert_to_scalar_type``: the torch dtype of an output of ACL type ``acl``."""
    return _ACL_TO_TORCH[acl]


def code_name(code: int | None) -> str:
    """Readable name of a dtype code, like op-plugin's npu_dtype_to_str (meta registrations)."""
    if code is None:
        return "None"
    for name, value in TORCH_NPU_DTYPE_CODES.items():
        if value == code:
            return f"torch_npu.{name}"
    dtype = _SCALAR_CODE_TO_TORCH.get(code)
    return str(dtype) if dtype is not None else str(code)


# ---------------------------------------------------------------- codecs (bytes <-> float32)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
HIF8_MAX = 32768.0  # golden.py _get_dtype_range: hifloat8 -> 0x1.p15
HIF8_NAN_CODE = 0x80
E8M0_NAN_CODE = 0xFF


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes [...] uint8 -> float32 [...]: 2**(code - 127), code 255 is NaN (OCP MX v1.0)."""
    as_int = codes.to(torch.int32)
    values = torch.pow(torch.tensor(2.0, dtype=torch.float64), (as_int - 127).to(torch.float64)).to(torch.float32)
    return torch.where(as_int == 255, torch.tensor(float("nan")), values)


def fp8_saturating(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> float8 ``dtype`` as the vector unit's SAT + CAST_RINT cast does: round to
    nearest even, clamp finite overflow to +-max, and NaN to +0.

    Sources: ``castTrait32to8 = {.., SatMode::SAT, .., RoundMode::CAST_RINT}`` in
    ops-nn ``quant/quant_common/op_kernel/mx_quant_common.h`` and the FP8 tail-axis kernel; the
    vendor's MX goldens state "NPU will cast NaN (with or without sign) to positive ZERO (sign
    is dropped)" and clip to +-max before the cast (``np.clip(ret, -max_norm, max_norm)``).
    """
    top = FP8_MAX[dtype]
    clamped = values.clamp(-top, top)
    clamped = torch.where(torch.isnan(values), torch.zeros_like(values), clamped)
    return clamped.to(dtype)


def fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    """The uint8 bit pattern of a float8 tensor."""
    return t.view(torch.uint8)


def hif8_encode(values: torch.Tensor) -> torch.Tensor:
    """float32 -> HiFloat8 bytes uint8, round half away from zero (``CAST_ROUND``) with SAT.

    The rounding is en_dtypes' ``astype(hifloat8)``, which the vendor's dynamic_quant golden
    uses for dst_type 34 (ops-nn ``quant/dynamic_quant/tests/assets/golden.py``); its ties go
    away from zero. SAT (``castTraitF32toh8 = {.., SatMode::SAT, .., CAST_ROUND}`` in
    ``dynamic_quant_regbase_full_load_pertensor.h`` and ``quantize.h``) clamps finite overflow
    and +-inf to +-32768, which en_dtypes would turn into +-inf; NaN stays NaN (0x80), as in the
    golden.
    """
    v = values.detach().to(torch.float32).cpu()
    clamped = torch.where(torch.isnan(v), v, v.clamp(-HIF8_MAX, HIF8_MAX))
    coded = clamped.numpy().astype(en_dtypes.hifloat8).view(np.uint8)
    # a torch-owned (resizable) storage, as the real output's (op-plugin allocates it with
    # apply_tensor_without_format); numpy-backed storage cannot be resized, and FSDP2 frees
    # storage by resizing it to 0
    return torch.from_numpy(coded).reshape(values.shape).clone()


def hif8_decode(codes: torch.Tensor) -> torch.Tensor:
    """HiFloat8 bytes uint8 -> float32 (en_dtypes' hifloat8 value table)."""
    # .numpy() of the caller's tensor would mark its storage non-resizable (numpy shares it); a
    # kernel leaves its inputs untouched (FSDP2 later frees a gathered weight by resizing it)
    arr = codes.detach().cpu().clone().numpy().astype(np.uint8)
    return torch.from_numpy(arr.view(en_dtypes.hifloat8).astype(np.float32)).reshape(codes.shape)
