"""Backend per device: ``npu`` tensors -> ``te_npu.ops.npu``; anything else -> ``te_npu.ops.emulation``.

A backend is a module exposing ``NAME``, ``SCALE_LAYOUT`` (the layout its quantizations return),
``matmul``, ``grouped_matmul``, ``mxfp8_quantize``, ``mxfp8_quantize_dual``,
``mxfp8_quantize_grouped``, ``hif8_quantize`` and ``hif8_quantize_with_scale``. Importing
``te_npu.ops.npu`` does not import torch_npu.

``force_backend("npu")`` routes every call inside the block to one backend whatever the
tensors' device: with a fake ``torch_npu`` installed (tests), the whole stack runs through the
NPU wrappers on CPU tensors. Its stack (like ``te_npu.events``' subscriptions) is process state, meant for
tests and diagnostics; nothing in te_npu enters it by itself.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType

import torch

from te_npu.ops import emulation, npu

__all__ = ["backend_for", "device_type", "force_backend", "forced_backend", "BACKENDS"]

BACKENDS: dict[str, ModuleType] = {"emulation": emulation, "npu": npu}
_BY_DEVICE_TYPE = {"npu": npu}
_FORCED: list[str] = []


def device_type(device: torch.device | str) -> str:
    """"npu" for ``torch.device("npu:0")`` or the string "npu:0" (parsed by hand: without
    torch_npu loaded, ``torch.device("npu")`` is not a valid device string)."""
    return device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0]


@contextlib.contextmanager
def force_backend(name: str) -> Iterator[None]:
    """Run every te_npu quantization and GEMM inside the block on backend ``name`` ("npu" or
    "emulation"), whatever the tensors' device; nestable (the innermost wins).

        with te_npu.ops.force_backend("npu"):    # CPU tensors through te_npu/ops/npu.py
            loss = model(tokens).loss            # (needs a torch_npu: the real one or a fake)
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}")
    _FORCED.append(name)
    try:
        yield
    finally:
        _FORCED.pop()


def forced_backend() -> str | None:
    """The backend name a ``force_backend`` block imposes now, or None."""
    return _FORCED[-1] if _FORCED else None


def backend_for(device: torch.device | str, override: str | None = None) -> ModuleType:
    """The backend for tensors on ``device``: ``override`` ("emulation"/"npu") if given, else
    the innermost ``force_backend`` block's, else by device type."""
    name = override if override is not None else forced_backend()
    if name is not None:
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}")
        return BACKENDS[name]
    return _BY_DEVICE_TYPE.get(device_type(device), emulation)
