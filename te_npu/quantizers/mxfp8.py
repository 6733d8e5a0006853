"""MXFP8 quantizer: E4M3 data with one E8M0 scale per 32 elements along the blocked axis."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from te_npu.formats import Format, Orientation
from te_npu.numerics.constants import MX_BLOCK_SIZE, MX_DEFAULT_SCALE_ALG
from te_npu import ops
from te_npu.ops.operand import QuantizedOperand

__all__ = ["MXFP8Quantizer"]


@dataclass(frozen=True)
class MXFP8Quantizer:
    """Stateless MX block quantizer shared by every role of ``MXFP8BlockRecipe``.

    ``row`` blocks along the last dim, ``col`` along the second-to-last; a 2D ``col``
    operand with ``group_list`` gets blocks that restart at every group boundary.
    ``scale_alg``: the E8M0 scale rule, ``"ceil"`` (default, round-up) or ``"floor"`` (OCP);
    a quantized weight keeps the quantizer it was made with, hence its rule.
    """

    block_size: int = MX_BLOCK_SIZE
    scale_alg: str = MX_DEFAULT_SCALE_ALG
    format: ClassVar[Format] = Format.MXFP8_E4M3

    def quantize(
        self,
        tensor: torch.Tensor,
        *,
        orientation: Orientation,
        group_list: torch.Tensor | None = None,
    ) -> QuantizedOperand:
        """Quantize ``tensor`` ``[..., M, K]`` along K (``row``) or M (``col``); the scale is in the
        backend's layout (``QuantizedOperand.scale_layout``)."""
        if orientation == "col" and group_list is not None and tensor.dim() != 2:
            raise ValueError(f"grouped col quantization needs a 2D [T, K] tensor, got shape {tuple(tensor.shape)}")
        group_sizes = group_list if orientation == "col" else None
        return ops.quantize_mxfp8(tensor, orientation, group_sizes=group_sizes, block_size=self.block_size,
                                  scale_alg=self.scale_alg)

    def quantize_dual(self, tensor: torch.Tensor) -> tuple[QuantizedOperand, QuantizedOperand]:
        """Row and col operands of a weight ``[..., N, K]``, both from the high-precision values."""
        return ops.quantize_mxfp8_dual(tensor, block_size=self.block_size, scale_alg=self.scale_alg)
