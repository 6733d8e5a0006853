"""HiF8 current-scaling quantizer: FP32 scale = amax * (1 / format_max) of the tensor being quantized
(the FP32 reciprocal, as Ascend's kernels compute it: ``te_npu.numerics.hif8.current_scale``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from te_npu.formats import Format, Orientation, spec
from te_npu import ops
from te_npu.ops.operand import QuantizedOperand

__all__ = ["HiF8Quantizer", "hif8_amax"]


hif8_amax = spec(Format.HIF8).amax
"""The HiF8 current-scaling amax (``te_npu.formats.FormatSpec.amax``, its one definition):
FP32 ``[]`` for a 1D/2D tensor, ``[E]`` per expert of a 3D weight ``[E, N, K]``."""


@dataclass(frozen=True)
class HiF8Quantizer:
    """Per-tensor (3D: per leading group) current scaling into HiFloat8 codes.

    ``format_max``: 15.0 for inputs and weights, 224.0 for gradients. The data does not
    depend on ``orientation``; the operand records it for the GEMM layout only.
    """

    format_max: float
    format: ClassVar[Format] = Format.HIF8

    def quantize(
        self,
        tensor: torch.Tensor,
        *,
        orientation: Orientation,
        group_list: torch.Tensor | None = None,
    ) -> QuantizedOperand:
        """Quantize ``tensor``; ``group_list`` is accepted and ignored (one scale per 2D operand).

        An empty tensor (a micro-batch with 0 tokens) has amax 0, hence scale 1.0 (the format's
        rule for a zero amax) and no codes; it takes the given-scale route, since an amax
        reduction over no element is undefined for the kernels and for torch."""
        if orientation not in ("row", "col"):
            raise ValueError(f"orientation must be 'row' or 'col', got {orientation!r}")
        if tensor.numel() == 0:
            groups = [tensor.shape[0]] if spec(self.format).scale_groups(tensor.dim()) else []
            scale = torch.ones(groups, dtype=torch.float32, device=tensor.device)
            return ops.quantize_hif8_with_scale(tensor, scale, orientation=orientation, amax=torch.zeros_like(scale),
                                                format_max=self.format_max)
        return ops.quantize_hif8(tensor, self.format_max, orientation=orientation)

    def quantize_with_scale(self, tensor: torch.Tensor, scale: torch.Tensor,
                            amax: torch.Tensor | None = None) -> QuantizedOperand:
        """Quantize with a given FP32 scale (e.g. one agreed on across FSDP ranks); ``amax``, the
        value the scale was derived from (``scale = amax * (1 / format_max)``), is reported in its ``QuantEvent``."""
        return ops.quantize_hif8_with_scale(tensor, scale, orientation="row", amax=amax,
                                            format_max=None if amax is None else self.format_max)
