"""Capability gate: can the NPU kernels of a format run here? (spec section 15)

``is_mxfp8_available`` / ``is_hif8_available`` report on the NPU path, checking, in order and
naming the first thing missing:

1. torch_npu importable and an NPU device visible (``torch.npu.device_count()``);
2. the chip: ``torch_npu.npu.get_soc_version()`` is Ascend 950 (the ``c10_npu::SocVersion``
   enum, ``Ascend950 = 260`` in torch_npu's ``NpuVariables.h``; the MX / HiF8 quant matmul and
   quant kernels are built for ascend950 only, ops-nn ``op_host/config/ascend950``). MXFP8 also
   needs an Ascend 950**DT** (``torch.npu.get_device_name()``, e.g. ``"Ascend950DT_9571"``):
   torch_npu's docs of ``npu_dynamic_mx_quant_with_dual_axis`` and
   ``npu_grouped_dynamic_mx_quant`` say "该接口仅在Ascend 950DT上支持";
3. the CANN release: MXFP8 refreshes FP32 master weights through ``npu_dynamic_mx_quant``,
   whose FP32 input came with CANN 9.1.0 (ops-nn ``dynamic_mx_quant_def.cpp`` DT_FLOAT on the
   9.1.0 branch) -- ``torch_npu.npu.utils.get_cann_version()``;
4. every torch_npu op and dtype attribute the format's wrappers call (``REQUIRED_NPU_ATTRS``);
5. every aclnn kernel those ops dispatch to for te_npu's arguments (``REQUIRED_ACLNN_KERNELS``):
   op-plugin picks the kernel at call time with ``check_aclnn_kernel_available`` (a dlsym of
   ``aclnn<Name>`` and ``aclnn<Name>GetWorkspaceSize`` in the CANN op libraries) and would fail
   mid-run without it; :func:`aclnn_kernel_available` makes the same lookup (torch_npu has no
   Python API for it).

They never raise and never import torch_npu at te_npu import time (only when called). Inside
``te_npu.ops.force_backend("npu")`` the gate checks the NPU path whatever the device.
"""
from __future__ import annotations

import ctypes
import importlib
import os
import re

import torch

from te_npu.errors import LowPrecisionUnavailableError
from te_npu.formats import Format
from te_npu.ops.registry import device_type, forced_backend

__all__ = [
    "is_mxfp8_available",
    "is_hif8_available",
    "require_low_precision",
    "aclnn_kernel_available",
    "REQUIRED_NPU_ATTRS",
    "REQUIRED_ACLNN_KERNELS",
    "REQUIRED_CHIP",
    "ASCEND950_SOC_VERSION",
    "MIN_CANN_VERSION",
]

ASCEND950_SOC_VERSION = 260  # torch_npu include/torch_npu/csrc/core/npu/NpuVariables.h SocVersion::Ascend950

REQUIRED_NPU_ATTRS: dict[Format, tuple[str, ...]] = {
    Format.MXFP8_E4M3: (
        "float8_e8m0fnu",
        "npu_dynamic_mx_quant",
        "npu_dynamic_mx_quant_with_dual_axis",
        "npu_grouped_dynamic_mx_quant",
        "npu_quant_matmul",
        "npu_grouped_matmul",
    ),
    Format.HIF8: ("hifloat8", "npu_dynamic_quant", "npu_quantize", "npu_quant_matmul", "npu_grouped_matmul"),
}

REQUIRED_ACLNN_KERNELS: dict[Format, tuple[str, ...]] = {
    # npu_dynamic_mx_quant -> V3 / V2 / V1 (op-plugin DynamicMxQuantKernelNpuOpApi.cpp; any does)
    # npu_grouped_dynamic_mx_quant: V2 (V1 refuses an explicit scale_alg, which te_npu sends)
    Format.MXFP8_E4M3: ("aclnnDynamicMxQuant", "aclnnDynamicMxQuantWithDualAxis", "aclnnGroupedDynamicMxQuantV2",
                        "aclnnQuantMatmulV5", "aclnnGroupedMatmulV4"),
    # npu_dynamic_quant with dst_type_max != 0 -> V4 (op-plugin DynamicQuantKernelNpuOpApi.cpp select_version)
    Format.HIF8: ("aclnnDynamicQuantV4", "aclnnQuantize", "aclnnQuantMatmulV5", "aclnnGroupedMatmulV4"),
}

MIN_CANN_VERSION: dict[Format, tuple[tuple[int, ...], str]] = {
    Format.MXFP8_E4M3: ((9, 1, 0), "FP32 input to npu_dynamic_mx_quant (the FP32-master weight refresh)"),
}

# The chip name each format needs (``torch.npu.get_device_name()`` prefix), with why.
REQUIRED_CHIP: dict[Format, tuple[str, str]] = {
    Format.MXFP8_E4M3: ("Ascend950DT", "torch_npu supports npu_dynamic_mx_quant_with_dual_axis and "
                                       "npu_grouped_dynamic_mx_quant on Ascend 950DT only"),
    Format.HIF8: ("Ascend950", "the HiFloat8 quant / quant-matmul kernels are built for ascend950 only"),
}

_OPAPI_LIBRARIES = ("libopapi.so", "libaclnn_ops_infer.so", "libaclnn_ops_train.so", "libaclnn_math.so")


def _load_library(library: str):
    home = os.environ.get("ASCEND_HOME_PATH")
    for path in (library, os.path.join(home, "lib64", library) if home else None):
        if path is None:
            continue
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def aclnn_kernel_available(name: str) -> bool:
    """Whether CANN's op libraries export ``name`` and ``name + "GetWorkspaceSize"`` -- the lookup
    op-plugin's ``check_aclnn_kernel_available`` makes (``op_plugin/utils/op_api_common.cpp``:
    dlsym in libopapi.so, then the other aclnn libraries), found through the loader path
    CANN's ``set_env.sh`` sets, or ``$ASCEND_HOME_PATH/lib64``."""
    for library in _OPAPI_LIBRARIES:
        handle = _load_library(library)
        if handle is not None and hasattr(handle, name) and hasattr(handle, name + "GetWorkspaceSize"):
            return True
    return False


def _cann_version(torch_npu) -> tuple[int, ...] | None:
    try:
        text = torch_npu.npu.utils.get_cann_version()
    except Exception:  # noqa: BLE001 - an old wheel without the query: unknown
        return None
    parts = []
    for piece in str(text).split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match.group()))
    return tuple(parts) or None


def _missing_reason(fmt: Format) -> str | None:
    """None when the NPU path for ``fmt`` is usable, else the first reason it is not."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, or a broken CANN install raising at import
        return f"torch_npu is not importable ({type(exc).__name__}: {exc})"
    npu = getattr(torch, "npu", None)
    try:
        count = npu.device_count() if npu is not None else 0
    except Exception as exc:
        return f"torch.npu.device_count() failed ({type(exc).__name__}: {exc})"
    if count < 1:
        return "no NPU device is visible"
    try:
        soc, name = torch_npu.npu.get_soc_version(), str(torch.npu.get_device_name())
    except Exception as exc:
        return f"the chip could not be queried ({type(exc).__name__}: {exc})"
    chip, why = REQUIRED_CHIP[fmt]
    if soc != ASCEND950_SOC_VERSION or not name.startswith(chip):
        return f"{fmt.value} needs an {chip} ({why}); this chip is {name} (SoC version {soc})"
    if fmt in MIN_CANN_VERSION:
        need, why = MIN_CANN_VERSION[fmt]
        have = _cann_version(torch_npu)
        if have is None or have < need:
            shown = "unknown" if have is None else ".".join(map(str, have))
            return f"{fmt.value} needs CANN >= {'.'.join(map(str, need))} for {why}; this CANN is {shown}"
    missing = [name for name in REQUIRED_NPU_ATTRS[fmt] if not hasattr(torch_npu, name)]
    if missing:
        return f"torch_npu {getattr(torch_npu, '__version__', '?')} lacks {', '.join(missing)}"
    kernels = [k for k in REQUIRED_ACLNN_KERNELS[fmt] if not aclnn_kernel_available(k)]
    if kernels:
        return f"the CANN op libraries lack the aclnn kernel(s) {', '.join(kernels)} that {fmt.value} needs"
    return None


def _available(fmt: Format, return_reason: bool):
    reason = _missing_reason(fmt)
    ok = reason is None
    if not return_reason:
        return ok
    return ok, f"{fmt.value} NPU kernels available" if ok else reason


def is_mxfp8_available(return_reason: bool = False):
    """Whether the MXFP8 NPU kernels can run here; ``(bool, reason)`` with ``return_reason``."""
    return _available(Format.MXFP8_E4M3, return_reason)


def is_hif8_available(return_reason: bool = False):
    """Whether the HiF8 NPU kernels can run here; ``(bool, reason)`` with ``return_reason``."""
    return _available(Format.HIF8, return_reason)


def require_low_precision(recipe_format: Format | str, device: torch.device | str) -> str:
    """Startup gate: the backend name ("npu" or "emulation") that will run ``recipe_format``
    on ``device`` (or the ``force_backend`` one); raises ``LowPrecisionUnavailableError``
    naming what is missing for the NPU."""
    fmt = Format(recipe_format)
    backend = forced_backend() or ("npu" if device_type(device) == "npu" else "emulation")
    if backend != "npu":
        return "emulation"
    reason = _missing_reason(fmt)
    if reason is not None:
        raise LowPrecisionUnavailableError(f"{fmt.value} on {device}: {reason}")
    return "npu"
