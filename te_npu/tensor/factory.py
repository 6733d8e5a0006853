"""``quantize_weight``: high-precision weight + recipe -> the recipe format's weight tensor."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch

from te_npu.formats import Format, QuantizationRole
from te_npu.tensor.hif8_tensor import HiF8Tensor
from te_npu.tensor.mxfp8_tensor import MXFP8Tensor
from te_npu.tensor.weight import QuantizedWeightTensor

__all__ = ["WEIGHT_TENSOR_BY_FORMAT", "quantize_weight"]

WEIGHT_TENSOR_BY_FORMAT = MappingProxyType({Format.MXFP8_E4M3: MXFP8Tensor, Format.HIF8: HiF8Tensor})
"""The persistent weight class of each 8-bit format."""


def quantize_weight(w: torch.Tensor, recipe: Any, *, requires_grad: bool = False) -> QuantizedWeightTensor:
    """Quantize ``w: [N, K]`` or ``[E, N, K]`` with ``recipe``'s weight quantizer.

    The class is looked up from ``recipe.format``; the quantizer is the recipe's
    ``WEIGHT_FWD`` quantizer (MXFP8: the shared block quantizer; HiF8: format max 15.0).
    """
    try:
        cls = WEIGHT_TENSOR_BY_FORMAT[Format(recipe.format)]
    except (KeyError, ValueError, AttributeError) as exc:
        raise ValueError(
            f"quantize_weight: no quantized weight tensor for recipe {recipe!r}; "
            f"formats with one: {[f.value for f in WEIGHT_TENSOR_BY_FORMAT]}"
        ) from exc
    return cls.from_high_precision(w, recipe.quantizer(QuantizationRole.WEIGHT_FWD), requires_grad=requires_grad)
