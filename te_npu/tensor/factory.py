"""``quantize_weight``: high-precision weight + recipe -> the recipe format's weight tensor."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch

from te_npu.formats import Format, QuantizationRole
from te_npu.tensor.hif8_tensor import HiF8Tensor
from te_npu.tensor.mxfp8_tensor import MXFP8Tensor
from te_npu.tensor.weight import QuantizedWeightTensor

__all__ = ["WEIGHT_TENSOR_BY_FORMAT", "weight_class", "quantize_weight", "empty_quantized_weight"]

WEIGHT_TENSOR_BY_FORMAT = MappingProxyType({Format.MXFP8_E4M3: MXFP8Tensor, Format.HIF8: HiF8Tensor})
"""The persistent weight class of each 8-bit format."""


def weight_class(recipe: Any) -> type[QuantizedWeightTensor]:
    """The persistent weight class of ``recipe``'s format (``ValueError`` when it has none)."""
    try:
        return WEIGHT_TENSOR_BY_FORMAT[Format(recipe.format)]
    except (KeyError, ValueError, AttributeError) as exc:
        raise ValueError(
            f"quantize_weight: no quantized weight tensor for recipe {recipe!r}; "
            f"formats with one: {[f.value for f in WEIGHT_TENSOR_BY_FORMAT]}"
        ) from exc


def quantize_weight(w: torch.Tensor, recipe: Any, *, requires_grad: bool = False) -> QuantizedWeightTensor:
    """Quantize ``w: [N, K]`` or ``[E, N, K]`` with ``recipe``'s weight quantizer.

    The class is looked up from ``recipe.format``; the quantizer is the recipe's
    ``WEIGHT_FWD`` quantizer (MXFP8: the shared block quantizer; HiF8: format max 15.0).
    """
    cls = weight_class(recipe)
    return cls.from_high_precision(w, recipe.quantizer(QuantizationRole.WEIGHT_FWD), requires_grad=requires_grad)


def empty_quantized_weight(w: torch.Tensor, recipe: Any, *, requires_grad: bool = False) -> QuantizedWeightTensor:
    """``recipe``'s weight tensor shaped like ``w`` (same logical dtype and device), values not
    written: for a meta-built ``w`` nothing is allocated. The values come from the weight's first
    ``refresh_from_master`` (the trainer's initialisation of each shard)."""
    return weight_class(recipe).empty(w.shape, logical_dtype=w.dtype, quantizer=recipe.quantizer(QuantizationRole.WEIGHT_FWD),
                                      device=w.device, requires_grad=requires_grad)
