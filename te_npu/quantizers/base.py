"""The quantizer protocol: high-precision tensor -> ``QuantizedOperand``."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from te_npu.formats import Format, Orientation
from te_npu.ops.operand import QuantizedOperand

__all__ = ["Quantizer"]


@runtime_checkable
class Quantizer(Protocol):
    """Turns one tensor into one operand; stateless, never collective, never walks a model."""

    format: Format

    def quantize(
        self,
        tensor: torch.Tensor,
        *,
        orientation: Orientation,
        group_list: torch.Tensor | None = None,
    ) -> QuantizedOperand:
        """Quantize ``tensor`` for the GEMM orientation ``orientation``.

        group_list: int64 ``[G]`` row counts of a 2D ``[T, K]`` operand whose rows are
        sorted by group (MoE tokens); MXFP8 ``col`` blocks never cross a group boundary.
        """
        ...
