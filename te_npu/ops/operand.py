"""``QuantizedOperand``: one short-lived 8-bit input of one MM / GMM.

The GEMM input type, so it lives at the ops level: ``te_npu.ops`` consumes it, quantizers and
weight tensors produce it (layering: quantizers / tensor -> ops, never back).
``te_npu.tensor.QuantizedOperand`` is the same class, kept for existing imports.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from te_npu.formats import Format, FormatSpec, Orientation, ScaleLayout, spec

__all__ = ["QuantizedOperand"]


@dataclass(frozen=True)
class QuantizedOperand:
    """8-bit data plus the scales needed to read it, in one GEMM orientation.

    data: the logical shape of the source tensor (never transposed). MXFP8:
        ``torch.float8_e4m3fn``; HiF8: ``torch.uint8`` HiFloat8 codes.
    scale: in ``scale_layout``. Canonical MXFP8: ``torch.uint8`` E8M0 codes, the data's shape
        with the blocked axis divided by 32 (``row``: last dim; ``col``: second-to-last dim;
        ragged ``col``: ``[num_blocks, K]`` with blocks restarting at each group of
        ``group_sizes``). ``npu`` MXFP8: the kernels' block pairs (``te_npu.ops.layouts``).
        HiF8: FP32, ``[]`` per tensor or ``[E]`` per leading group of a 3D weight.
    logical_dtype: dtype of the high-precision tensor this stands for (e.g. bfloat16).
    format: the 8-bit format.
    orientation: ``row`` or ``col``, see ``te_npu.formats.Orientation``.
    group_sizes: MXFP8 ragged ``col`` operands only: int64 ``[G]`` row counts per group.
    scale_layout: ``canonical`` (te_npu's, the emulation's) or ``npu`` (straight from a
        torch_npu quantization kernel, fed to the GEMM kernels without conversion).
    """

    data: torch.Tensor
    scale: torch.Tensor
    logical_dtype: torch.dtype
    format: Format
    orientation: Orientation
    group_sizes: torch.Tensor | None = None
    scale_layout: ScaleLayout = "canonical"

    @property
    def spec(self) -> FormatSpec:
        """The format's rules (block size, dtypes, scale granularity, backend arguments)."""
        return spec(self.format)

    @property
    def shape(self) -> torch.Size:
        """Logical shape of the operand."""
        return self.data.shape

    @property
    def device(self) -> torch.device:
        """Device of the payload."""
        return self.data.device
