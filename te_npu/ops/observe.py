"""Observers of low-precision work: every GEMM emits a ``GemmEvent``, every quantization a ``QuantEvent``.

``observe(callback)`` is nestable; the observer stack below is the only global state in
``te_npu.ops``. With no observer installed, emitting costs one empty-list check.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

__all__ = ["GemmEvent", "QuantEvent", "observe", "emit", "has_observers", "GEMM_OF_LAYOUT"]

GEMM_OF_LAYOUT = {"NT": "fprop", "NN": "dgrad", "TN": "wgrad"}
"""Which training GEMM each layout is (see the GEMM contract in ``te_npu.ops.gemm``)."""


@dataclass(frozen=True)
class GemmEvent:
    """One low-precision GEMM call.

    kind: "dense" or "grouped"; layout: "NT"/"NN"/"TN"; gemm: "fprop"/"dgrad"/"wgrad";
    format: ``Format`` value string; left_shape/right_shape: logical operand shapes;
    left_scale_dtype/right_scale_dtype: scale dtypes (uint8 E8M0 codes or float32);
    output_dtype; backend: "emulation" or "npu"; num_groups: G for grouped, None for dense.
    """

    kind: str
    layout: str
    gemm: str
    format: str
    left_shape: tuple[int, ...]
    right_shape: tuple[int, ...]
    left_scale_dtype: torch.dtype
    right_scale_dtype: torch.dtype
    output_dtype: torch.dtype
    backend: str
    num_groups: int | None = None


@dataclass(frozen=True)
class QuantEvent:
    """One quantization call.

    format: ``Format`` value string; orientation: "row", "col", "dual" (row + col of a weight),
    or None when the caller did not say (HiF8 data is the same for both); shape: source shape;
    format_max: HiF8 current scaling's target maximum (15.0 input/weight, 224.0 gradient);
    grouped: whether blocks restart at group boundaries; amax/scale: HiF8 only (FP32, ``[]``
    or ``[E]``; amax is None where the backend does not report it); backend name.
    """

    format: str
    orientation: str | None
    shape: tuple[int, ...]
    backend: str
    grouped: bool = False
    amax: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    format_max: float | None = None


_OBSERVERS: list[Callable[[object], None]] = []


@contextlib.contextmanager
def observe(callback: Callable[[object], None]) -> Iterator[None]:
    """Call ``callback(event)`` for every ``GemmEvent`` / ``QuantEvent`` inside the block.

    Nested blocks stack: an event reaches every active callback, outermost first.
    """
    _OBSERVERS.append(callback)
    try:
        yield
    finally:
        # Remove this exact registration even if an inner block leaked (LIFO in the normal case).
        for index in range(len(_OBSERVERS) - 1, -1, -1):
            if _OBSERVERS[index] is callback:
                del _OBSERVERS[index]
                break


def has_observers() -> bool:
    """Whether any observer is active (lets callers skip building an event)."""
    return bool(_OBSERVERS)


def emit(event: object) -> None:
    """Send ``event`` to every active observer."""
    for callback in tuple(_OBSERVERS):
        callback(event)
