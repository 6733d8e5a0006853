"""MXFP8 quantizer: E4M3 data with one E8M0 scale per 32 elements along the blocked axis."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from te_npu.formats import Format, Orientation
from te_npu import ops
from te_npu.numerics.groups import with_mirror_of
from te_npu.tensor.operand import QuantizedOperand

__all__ = ["MXFP8Quantizer"]

_AXIS = {"row": -1, "col": -2}


@dataclass(frozen=True)
class MXFP8Quantizer:
    """Stateless MX block quantizer shared by every role of ``MXFP8BlockRecipe``.

    ``row`` blocks along the last dim, ``col`` along the second-to-last; a 2D ``col``
    operand with ``group_list`` gets blocks that restart at every group boundary.
    """

    block_size: int = 32
    scale_alg: str = "floor"
    format: ClassVar[Format] = Format.MXFP8_E4M3

    def quantize(
        self,
        tensor: torch.Tensor,
        *,
        orientation: Orientation,
        group_list: torch.Tensor | None = None,
    ) -> QuantizedOperand:
        """Quantize ``tensor`` ``[..., M, K]`` along K (``row``) or M (``col``)."""
        if orientation not in _AXIS:
            raise ValueError(f"orientation must be 'row' or 'col', got {orientation!r}")
        if orientation == "col" and group_list is not None:
            if tensor.dim() != 2:
                raise ValueError(f"grouped col quantization needs a 2D [T, K] tensor, got shape {tuple(tensor.shape)}")
            group_sizes = with_mirror_of(group_list.to(device=tensor.device, dtype=torch.int64), group_list)
            data, scale = ops.mxfp8_quantize_grouped(tensor, group_sizes, self.block_size, self.scale_alg)
            return QuantizedOperand(data, scale, tensor.dtype, self.format, "col", group_sizes)
        data, scale = ops.mxfp8_quantize(tensor, axis=_AXIS[orientation], block_size=self.block_size, scale_alg=self.scale_alg)
        return QuantizedOperand(data, scale, tensor.dtype, self.format, orientation)

    def quantize_dual(self, tensor: torch.Tensor) -> tuple[QuantizedOperand, QuantizedOperand]:
        """Row and col operands of a weight ``[..., N, K]``, both from the high-precision values."""
        row_data, row_scale, col_data, col_scale = ops.mxfp8_quantize_dual(tensor, self.block_size, self.scale_alg)
        return (
            QuantizedOperand(row_data, row_scale, tensor.dtype, self.format, "row"),
            QuantizedOperand(col_data, col_scale, tensor.dtype, self.format, "col"),
        )
