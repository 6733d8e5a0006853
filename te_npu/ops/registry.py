"""Backend per device: ``npu`` tensors -> ``te_npu.ops.npu``; anything else -> ``te_npu.ops.emulation``.

A backend is a module exposing ``NAME``, ``SCALE_LAYOUT`` (the layout its quantizations return),
``matmul``, ``grouped_matmul``, ``mxfp8_quantize``, ``mxfp8_quantize_dual``,
``mxfp8_quantize_grouped``, ``hif8_quantize`` and ``hif8_quantize_with_scale``. Importing
``te_npu.ops.npu`` does not import torch_npu.

``force_backend("npu")`` routes every call inside the block to one backend whatever the
tensors' device: with a fake ``torch_npu`` installed (tests), the whole stack runs through the
NPU wrappers on CPU tensors. It also takes a backend object (anything exposing the names
above), e.g. the capacity estimator's emulation that marks each kernel call for its memory
tracker (``te_npu.training.capacity``). Its stack (like ``te_npu.events``' subscriptions) is
process state, meant for tests and diagnostics; nothing in te_npu enters it by itself.
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
def force_backend(name: str | ModuleType) -> Iterator[None]:
    """Run every te_npu quantization and GEMM inside the block on backend ``name`` ("npu" or
    "emulation", or a backend object with a ``NAME``), whatever the tensors' device; nestable
    (the innermost wins).

        with te_npu.ops.force_backend("npu"):    # CPU tensors through te_npu/ops/npu.py
            loss = model(tokens).loss            # (needs a torch_npu: the real one or a fake)
    """
    if isinstance(name, str):
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}")
        backend = BACKENDS[name]
    else:
        backend = name
    _FORCED.append(backend)
    try:
        yield
    finally:
        _FORCED.pop()


def forced_backend() -> str | None:
    """The name (``NAME``) of the backend a ``force_backend`` block imposes now, or None."""
    return _FORCED[-1].NAME if _FORCED else None


def backend_for(device: torch.device | str, override: str | None = None) -> ModuleType:
    """The backend for tensors on ``device``: ``override`` ("emulation"/"npu") if given, else
    the innermost ``force_backend`` block's, else by device type."""
    if override is not None:
        if override not in BACKENDS:
            raise ValueError(f"unknown backend {override!r}; known: {sorted(BACKENDS)}")
        return BACKENDS[override]
    if _FORCED:
        return _FORCED[-1]
    return _BY_DEVICE_TYPE.get(device_type(device), emulation)
