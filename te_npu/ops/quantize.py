"""Quantization entry points: ``npu`` tensors -> torch_npu, others -> ``te_npu.numerics``.

Each call emits a ``QuantEvent``. Results are always in our layouts: MXFP8 scales uint8
``[..., K/32]`` (row) / ``[..., M/32, N]`` (col) / ``[num_blocks, K]`` (ragged col);
HiF8 codes uint8 with an FP32 scale ``[]`` (or ``[E]`` for a 3D weight).
"""
from __future__ import annotations

import torch

from te_npu.formats import Format
from te_npu.numerics.constants import MX_BLOCK_SIZE
from te_npu.ops.observe import QuantEvent, emit, has_observers
from te_npu.ops.registry import backend_for

__all__ = [
    "mxfp8_quantize",
    "mxfp8_quantize_dual",
    "mxfp8_quantize_grouped",
    "hif8_quantize",
    "hif8_quantize_with_scale",
]

_MX = Format.MXFP8_E4M3.value


def _event(fmt, orientation, x, backend, **extra) -> None:
    if has_observers():
        emit(QuantEvent(format=fmt, orientation=orientation, shape=tuple(x.shape), backend=backend.NAME, **extra))


def mxfp8_quantize(x: torch.Tensor, axis: int = -1, block_size: int = MX_BLOCK_SIZE, scale_alg: str = "floor"):
    """E4M3 data (same shape) and E8M0 codes blocked along ``axis`` (-1 row, -2 col)."""
    backend = backend_for(x.device)
    _event(_MX, "row" if axis in (-1, x.dim() - 1) else "col", x, backend)
    return backend.mxfp8_quantize(x, axis, block_size, scale_alg)


def mxfp8_quantize_dual(w: torch.Tensor, block_size: int = MX_BLOCK_SIZE, scale_alg: str = "floor"):
    """(row_data, row_scale [...,N,K/32], col_data, col_scale [...,N/32,K]) of a weight [..., N, K]."""
    backend = backend_for(w.device)
    _event(_MX, "dual", w, backend)
    return backend.mxfp8_quantize_dual(w, block_size, scale_alg)


def mxfp8_quantize_grouped(
    x: torch.Tensor, group_sizes: torch.Tensor, block_size: int = MX_BLOCK_SIZE, scale_alg: str = "floor"
):
    """Ragged col quantization of x [T, K]: blocks along T restart at each group (int64 [G] counts)."""
    backend = backend_for(x.device)
    _event(_MX, "col", x, backend, grouped=True)
    return backend.mxfp8_quantize_grouped(x, group_sizes, block_size, scale_alg)


def hif8_quantize(x: torch.Tensor, format_max: float, *, orientation: str | None = None):
    """Current scaling: ``(codes uint8, scale fp32 [] or [E])`` with scale = amax / format_max
    (1.0 when amax is zero or not finite)."""
    backend = backend_for(x.device)
    codes, scale, amax = backend.hif8_quantize(x, format_max)
    _event(Format.HIF8.value, orientation, x, backend, amax=amax, scale=scale, format_max=float(format_max))
    return codes, scale


def hif8_quantize_with_scale(
    x: torch.Tensor,
    scale: torch.Tensor,
    *,
    orientation: str | None = None,
    amax: torch.Tensor | None = None,
    format_max: float | None = None,
) -> torch.Tensor:
    """HiF8 codes of ``x / scale`` for a given FP32 scale (e.g. agreed across FSDP ranks).

    ``amax`` / ``format_max``: what the caller derived ``scale`` from (e.g. the FSDP-group amax
    and 15.0), reported to observers as given; None when the caller does not say."""
    backend = backend_for(x.device)
    _event(Format.HIF8.value, orientation, x, backend, amax=amax, scale=scale,
           format_max=None if format_max is None else float(format_max))
    return backend.hif8_quantize_with_scale(x, scale)
