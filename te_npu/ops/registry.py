"""Backend per device: ``npu`` tensors -> ``te_npu.ops.npu``; anything else -> ``te_npu.ops.emulation``.

A backend is a module exposing ``NAME``, ``matmul``, ``grouped_matmul``, ``mxfp8_quantize``,
``mxfp8_quantize_dual``, ``mxfp8_quantize_grouped``, ``hif8_quantize`` and
``hif8_quantize_with_scale``. Importing ``te_npu.ops.npu`` does not import torch_npu.
"""
from __future__ import annotations

from types import ModuleType

import torch

from te_npu.ops import emulation, npu

__all__ = ["backend_for", "device_type", "BACKENDS"]

BACKENDS: dict[str, ModuleType] = {"emulation": emulation, "npu": npu}
_BY_DEVICE_TYPE = {"npu": npu}


def device_type(device: torch.device | str) -> str:
    """"npu" for ``torch.device("npu:0")`` or the string "npu:0" (parsed by hand: without
    torch_npu loaded, ``torch.device("npu")`` is not a valid device string)."""
    return device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0]


def backend_for(device: torch.device | str, override: str | None = None) -> ModuleType:
    """The backend for tensors on ``device``; ``override`` ("emulation"/"npu") forces one (tests)."""
    if override is not None:
        if override not in BACKENDS:
            raise ValueError(f"unknown backend {override!r}; known: {sorted(BACKENDS)}")
        return BACKENDS[override]
    return _BY_DEVICE_TYPE.get(device_type(device), emulation)
