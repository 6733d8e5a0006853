"""Capability gate: do the NPU kernels for a format exist here? (spec section 15)

``is_mxfp8_available`` / ``is_hif8_available`` report on the NPU path only: torch_npu importable,
an NPU device present, and every op / dtype the format needs. They never raise and never import
torch_npu at te_npu import time (only when called). CPU/CUDA tensors always run the emulation,
which ``require_low_precision`` returns as "emulation".
"""
from __future__ import annotations

import importlib

import torch

from te_npu.errors import LowPrecisionUnavailableError
from te_npu.formats import Format
from te_npu.ops.registry import device_type

__all__ = ["is_mxfp8_available", "is_hif8_available", "require_low_precision", "REQUIRED_NPU_ATTRS"]

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
    missing = [name for name in REQUIRED_NPU_ATTRS[fmt] if not hasattr(torch_npu, name)]
    if missing:
        return f"torch_npu {getattr(torch_npu, '__version__', '?')} lacks {', '.join(missing)}"
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
    on ``device``; raises ``LowPrecisionUnavailableError`` naming what is missing on an NPU."""
    fmt = Format(recipe_format)
    if device_type(device) != "npu":
        return "emulation"
    reason = _missing_reason(fmt)
    if reason is not None:
        raise LowPrecisionUnavailableError(f"{fmt.value} on {device}: {reason}")
    return "npu"
