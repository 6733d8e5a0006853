"""Quantization entry points: ``npu`` tensors -> torch_npu, others -> ``te_npu.numerics``.

The ``quantize_*`` functions return :class:`QuantizedOperand` s with the scale in the backend's
own layout (``npu``: the kernel's block pairs, fed to the GEMM kernels unchanged; emulation:
canonical). The tuple-returning ``mxfp8_quantize`` / ``hif8_quantize`` ... give canonical
layouts whatever the backend (MXFP8 scales uint8 ``[..., K/32]`` (row) / ``[..., M/32, N]`` (col) /
``[num_blocks, K]`` (ragged col); HiF8 codes uint8 with an FP32 scale ``[]`` or ``[E]``), for
inspection and tests. Each call emits one ``te_npu.events.QuantEvent`` and runs its kernel inside a
profiler range ``te_npu::quantize <format> <what>`` (``te_npu.ops.profiling``).
"""
from __future__ import annotations

import torch

from te_npu import events
from te_npu.formats import Format, Orientation
from te_npu.numerics.constants import MX_BLOCK_SIZE, MX_DEFAULT_SCALE_ALG
from te_npu.ops.group_sizes import with_mirror_of
from te_npu.ops import layouts
from te_npu.ops.operand import QuantizedOperand
from te_npu.ops.profiling import QUANT_RANGE, op_range
from te_npu.ops.registry import backend_for

__all__ = [
    "quantize_mxfp8",
    "quantize_mxfp8_dual",
    "quantize_hif8",
    "quantize_hif8_with_scale",
    "mxfp8_quantize",
    "mxfp8_quantize_dual",
    "mxfp8_quantize_grouped",
    "hif8_quantize",
    "hif8_quantize_with_scale",
]

_MX = Format.MXFP8_E4M3
_AXIS = {"row": -1, "col": -2}


def _event(fmt: Format, orientation, x, backend, **extra) -> None:
    if events.has_subscribers(events.QuantEvent):
        events.emit(events.QuantEvent(format=fmt.value, orientation=orientation, shape=tuple(x.shape),
                                      backend=backend.NAME, **extra))


def _check_orientation(orientation) -> None:
    if orientation not in _AXIS:
        raise ValueError(f"orientation must be 'row' or 'col', got {orientation!r}")


# ---------------------------------------------------------------- operands (backend layout)
def quantize_mxfp8(x: torch.Tensor, orientation: Orientation, *, group_sizes: torch.Tensor | None = None,
                   block_size: int = MX_BLOCK_SIZE, scale_alg: str = MX_DEFAULT_SCALE_ALG) -> QuantizedOperand:
    """MXFP8 operand of ``x [..., M, K]`` blocked along K (``row``) or M (``col``); with
    ``group_sizes`` (int64 ``[G]`` row counts of a 2D ``[T, K]`` col operand) the blocks restart
    at every group boundary (ragged)."""
    _check_orientation(orientation)
    backend = backend_for(x.device)
    if group_sizes is not None:
        if orientation != "col" or x.dim() != 2:
            raise ValueError(f"grouped MXFP8 quantization needs a 2D [T, K] col operand, got {orientation} "
                             f"{tuple(x.shape)}")
        sizes = with_mirror_of(group_sizes.to(device=x.device, dtype=torch.int64), group_sizes)
        _event(_MX, "col", x, backend, grouped=True)
        with op_range(f"{QUANT_RANGE} mxfp8 col grouped"):
            data, scale = backend.mxfp8_quantize_grouped(x, sizes, block_size, scale_alg)
        return QuantizedOperand(data, scale, x.dtype, _MX, "col", sizes, backend.SCALE_LAYOUT)
    _event(_MX, orientation, x, backend)
    with op_range(f"{QUANT_RANGE} mxfp8 {orientation}"):
        data, scale = backend.mxfp8_quantize(x, _AXIS[orientation], block_size, scale_alg)
    return QuantizedOperand(data, scale, x.dtype, _MX, orientation, None, backend.SCALE_LAYOUT)


def quantize_mxfp8_dual(w: torch.Tensor, *, block_size: int = MX_BLOCK_SIZE,
                        scale_alg: str = MX_DEFAULT_SCALE_ALG) -> tuple[QuantizedOperand, QuantizedOperand]:
    """Row and col MXFP8 operands of ``w [..., N, K]``, both from the high-precision values."""
    backend = backend_for(w.device)
    _event(_MX, "dual", w, backend)
    with op_range(f"{QUANT_RANGE} mxfp8 dual"):
        row_data, row_scale, col_data, col_scale = backend.mxfp8_quantize_dual(w, block_size, scale_alg)
    return (QuantizedOperand(row_data, row_scale, w.dtype, _MX, "row", None, backend.SCALE_LAYOUT),
            QuantizedOperand(col_data, col_scale, w.dtype, _MX, "col", None, backend.SCALE_LAYOUT))


def quantize_hif8(x: torch.Tensor, format_max: float, *, orientation: Orientation | None = None) -> QuantizedOperand:
    """HiF8 current scaling: scale = ``amax * (1 / format_max)`` (FP32, see
    ``te_npu.numerics.hif8.current_scale``), ``[]`` or ``[E]`` for a 3D weight; 1.0 (and zero
    codes) for an all-zero tensor. The codes do not depend on ``orientation`` (None: the
    caller does not say, reported so; the operand is labelled ``row``)."""
    if orientation is not None:
        _check_orientation(orientation)
    backend = backend_for(x.device)
    with op_range(f"{QUANT_RANGE} hif8 current"):
        codes, scale, amax = backend.hif8_quantize(x, format_max)
    _event(Format.HIF8, orientation, x, backend, amax=amax, scale=scale, format_max=float(format_max))
    return QuantizedOperand(codes, scale, x.dtype, Format.HIF8, orientation or "row")


def quantize_hif8_with_scale(x: torch.Tensor, scale: torch.Tensor, *, orientation: Orientation | None = None,
                             amax: torch.Tensor | None = None, format_max: float | None = None) -> QuantizedOperand:
    """HiF8 codes of ``x / scale`` for a given FP32 scale (``[]``, or ``[E]`` for a 3D tensor).

    ``amax`` / ``format_max``: what the caller derived ``scale`` from (e.g. the FSDP-group amax
    and 15.0), reported in the ``QuantEvent`` as given; None when the caller does not say."""
    if orientation is not None:
        _check_orientation(orientation)
    backend = backend_for(x.device)
    _event(Format.HIF8, orientation, x, backend, amax=amax, scale=scale,
           format_max=None if format_max is None else float(format_max))
    with op_range(f"{QUANT_RANGE} hif8 with_scale"):
        codes = backend.hif8_quantize_with_scale(x, scale)
    return QuantizedOperand(codes, scale, x.dtype, Format.HIF8, orientation or "row")


# ---------------------------------------------------------------- canonical tuples (inspection, tests)
def mxfp8_quantize(x: torch.Tensor, axis: int = -1, block_size: int = MX_BLOCK_SIZE, scale_alg: str = MX_DEFAULT_SCALE_ALG):
    """E4M3 data (same shape) and canonical E8M0 codes blocked along ``axis`` (-1 row, -2 col).
    Other axes run the emulation's numerics on any backend's device layout rules."""
    if axis not in (-1, -2, x.dim() - 1, x.dim() - 2):
        backend = backend_for(x.device)
        _event(_MX, "col", x, backend)
        with op_range(f"{QUANT_RANGE} mxfp8 axis{axis}"):
            return backend.mxfp8_quantize(x, axis, block_size, scale_alg)
    orientation = "row" if axis in (-1, x.dim() - 1) else "col"
    op = layouts.to_canonical(quantize_mxfp8(x, orientation, block_size=block_size, scale_alg=scale_alg))
    return op.data, op.scale


def mxfp8_quantize_dual(w: torch.Tensor, block_size: int = MX_BLOCK_SIZE, scale_alg: str = MX_DEFAULT_SCALE_ALG):
    """(row_data, row_scale [...,N,K/32], col_data, col_scale [...,N/32,K]) of a weight [..., N, K]."""
    row, col = (layouts.to_canonical(op) for op in quantize_mxfp8_dual(w, block_size=block_size, scale_alg=scale_alg))
    return row.data, row.scale, col.data, col.scale


def mxfp8_quantize_grouped(x: torch.Tensor, group_sizes: torch.Tensor, block_size: int = MX_BLOCK_SIZE,
                           scale_alg: str = MX_DEFAULT_SCALE_ALG):
    """Ragged col quantization of x [T, K]: blocks along T restart at each group (int64 [G] counts);
    returns (data [T, K], canonical scale [num_blocks, K])."""
    op = quantize_mxfp8(x, "col", group_sizes=group_sizes, block_size=block_size, scale_alg=scale_alg)
    op = layouts.to_canonical(op)
    return op.data, op.scale


def hif8_quantize(x: torch.Tensor, format_max: float, *, orientation: str | None = None):
    """Current scaling: ``(codes uint8, scale fp32 [] or [E])``, see :func:`quantize_hif8`."""
    op = quantize_hif8(x, format_max, orientation=orientation)
    return op.data, op.scale


def hif8_quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, *, orientation: str | None = None,
                             amax: torch.Tensor | None = None, format_max: float | None = None) -> torch.Tensor:
    """HiF8 codes of ``x / scale``, see :func:`quantize_hif8_with_scale`."""
    return quantize_hif8_with_scale(x, scale, orientation=orientation, amax=amax, format_max=format_max).data
