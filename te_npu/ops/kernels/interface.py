"""The one interface every quantization-kernel variant of the emulation backend provides.

A variant (``eager``, ``compiled``, ``native``) quantizes and decodes in te_npu's canonical
layouts, bit for bit as ``te_npu.numerics`` does (the reference): variants differ in speed only,
so a run may switch between them at any time. ``te_npu.ops.emulation`` calls the active variant
(``te_npu.ops.kernels.active_quant_kernels``) and nothing else.

Shapes: ``x: [..., N, K]``; MXFP8 scales uint8 E8M0 ``[..., N, K/bs]`` (row, axis -1) /
``[..., N/bs, K]`` (col, axis -2) / ``[B, K]`` (ragged col of a 2D ``[T, K]`` operand, blocks
restarting at each group of ``group_sizes`` int64 ``[G]``); HiF8 codes uint8 like ``x``, scales
FP32 ``[]`` or ``[E]`` (per expert of a 3D weight).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from te_npu.numerics.constants import MX_BLOCK_SIZE, MX_DEFAULT_SCALE_ALG

__all__ = ["QuantKernels", "QUANT_KERNEL_METHODS"]

QUANT_KERNEL_METHODS = (
    "mxfp8_quantize",
    "mxfp8_quantize_dual",
    "mxfp8_quantize_grouped",
    "hif8_quantize",
    "hif8_quantize_with_scale",
    "mxfp8_decode",
    "mxfp8_decode_grouped",
    "hif8_decode",
)
"""The computing methods of :class:`QuantKernels` (what a test spies on to count kernel calls)."""


@runtime_checkable
class QuantKernels(Protocol):
    """Quantization and decode kernels, bitwise equal to ``te_npu.numerics``."""

    name: str
    """The variant's name in ``te_npu.ops.kernels.KERNELS`` (and ``training.quant_kernel``)."""

    devices: frozenset[str] | None
    """Device types the variant's kernels run on (None: every device the emulation runs on)."""

    def availability(self) -> tuple[bool, str | None]:
        """``(True, None)`` when the kernels can run here, else ``(False, reason)``; may build them."""

    def mxfp8_quantize(self, x: torch.Tensor, axis: int = -1, block_size: int = MX_BLOCK_SIZE,
                       scale_alg: str = MX_DEFAULT_SCALE_ALG) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data float8_e4m3fn like x, scale uint8)`` blocked along ``axis`` (``mxfp8.quantize``)."""

    def mxfp8_quantize_dual(self, w: torch.Tensor, block_size: int = MX_BLOCK_SIZE, scale_alg: str = MX_DEFAULT_SCALE_ALG
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(row_data, row_scale, col_data, col_scale)`` of ``w [..., N, K]`` (``mxfp8.quantize_dual``)."""

    def mxfp8_quantize_grouped(self, x: torch.Tensor, group_sizes: torch.Tensor, block_size: int = MX_BLOCK_SIZE,
                               scale_alg: str = MX_DEFAULT_SCALE_ALG) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged col ``(data [T, K], scale [B, K])`` (``mxfp8.quantize_grouped``); ``group_sizes``
        carries its host mirror (``te_npu.ops.group_sizes``), so no host read."""

    def hif8_quantize(self, x: torch.Tensor, format_max: float, per_group: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Current scaling ``(codes, scale, amax)`` (``hif8.quantize_current``)."""

    def hif8_quantize_with_scale(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """HiF8 codes of ``x / scale`` (``hif8.quantize``)."""

    def mxfp8_decode(self, data: torch.Tensor, scale: torch.Tensor, axis: int = -1,
                     dtype: torch.dtype = torch.float32, scale_shift: int = 0) -> torch.Tensor:
        """Values times block scales raised by ``2**scale_shift``, in ``dtype`` (``mxfp8.dequantize``)."""

    def mxfp8_decode_grouped(self, data: torch.Tensor, scale: torch.Tensor, group_sizes: torch.Tensor,
                             dtype: torch.dtype = torch.float32, scale_shift: int = 0) -> torch.Tensor:
        """Ragged col decode (``mxfp8.dequantize_grouped``)."""

    def hif8_decode(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """HiF8 code values in ``dtype``, scale not applied (``hif8.decode``)."""
