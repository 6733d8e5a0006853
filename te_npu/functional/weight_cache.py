"""Weight operands of a low-precision GEMM: from a quantized weight, or cached per version.

A TE weight is either
- a ``QuantizedWeightTensor`` parameter (``quantized_model_init`` / ``quantize_weights_``):
  its stored row / col payloads are the operands, never re-quantized in forward; or
- a high-precision parameter: quantized once per *parameter version* and reused across
  micro-batches and activation recompute. The cache key is ``(weight._version,
  weight.data_ptr(), shape, dtype, recipe)``; every in-place update (optimizer step,
  ``copy_``, ``load_state_dict``) bumps ``_version``, so a hit can never be stale.
  (Rebinding ``param.data = other`` keeps the version counter; the data pointer changes
  unless the allocator hands back the same address, so call ``cache.clear()`` after such a
  rebinding, as ``TE`` modules do in ``_apply``.)

The cache holds one entry: the previous operands are dropped *before* the new ones are made,
so at most one quantized copy per weight is alive (plus whatever an autograd graph still
references). It is a plain attribute, never a buffer, so it is not part of ``state_dict``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from te_npu.errors import LowPrecisionUnavailableError
from te_npu.formats import QuantizationRole
from te_npu.functional.operands import GemmContext, GemmNumerics, quantize_pair
from te_npu.tensor import QuantizedWeightTensor
from te_npu.tensor.operand import QuantizedOperand

__all__ = ["WeightOperands", "WeightCache", "weight_operands", "col_operand", "high_precision_weight"]


class WeightOperands(NamedTuple):
    """``row``: fprop operand (blocked along K); ``col``: dgrad operand (blocked along N),
    None for a quantized weight (read in backward with :func:`col_operand`)."""

    row: QuantizedOperand
    col: QuantizedOperand | None


def col_operand(saved_col: QuantizedOperand | None, weight: torch.Tensor | None) -> QuantizedOperand | None:
    """The dgrad operand in backward: the saved one, else the quantized weight's col copy now
    (under FSDP2 with reshard_after_forward=True it arrives with the backward all-gather)."""
    return saved_col if saved_col is not None or weight is None else weight.select("col")


def _quantize(weight: torch.Tensor, numerics: GemmNumerics, context: GemmContext) -> WeightOperands:
    """w: ``[N, K]`` or ``[G, N, K]`` -> row (WEIGHT_FWD) and col (WEIGHT_BWD) operands."""
    row, col = quantize_pair(numerics, context, weight.detach(),
                             QuantizationRole.WEIGHT_FWD, QuantizationRole.WEIGHT_BWD)
    return WeightOperands(row, col)


class WeightCache:
    """Quantized operands of one high-precision weight, valid for one parameter version."""

    __slots__ = ("_key", "_operands", "misses")

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._operands: WeightOperands | None = None
        self.misses = 0  # how many times the weight was quantized (observability, tests)

    def get(self, weight: torch.Tensor, numerics: GemmNumerics, context: GemmContext | None = None) -> WeightOperands:
        """The operands for ``weight`` now; quantizes only when the version/storage/recipe changed."""
        context = context or GemmContext()
        if weight.is_inference():  # inference tensors carry no version counter: never cache them
            return _quantize(weight, numerics, context)
        key = (weight._version, weight.data_ptr(), tuple(weight.shape), weight.dtype, numerics.recipe)
        if key != self._key or self._operands is None:
            self.clear()  # drop the old copy first: never two alive because of the cache
            self._operands = _quantize(weight, numerics, context)
            self._key = key
            self.misses += 1
        return self._operands

    def clear(self) -> None:
        """Forget the cached operands (they are freed once no autograd graph holds them)."""
        self._key, self._operands = None, None


def weight_operands(weight: torch.Tensor, numerics: GemmNumerics, cache: WeightCache | None,
                    context: GemmContext) -> WeightOperands:
    """Row and col operands of ``weight`` in ``numerics``' format.

    Raises ``LowPrecisionUnavailableError`` when ``weight`` is a quantized weight of another
    format than the recipe (a quantized weight is never converted on the fly).
    """
    if isinstance(weight, QuantizedWeightTensor):
        if weight.format != numerics.format:
            raise _mismatch(weight, numerics, context)
        # col: selected in backward (``col_operand``); an FSDP2 forward gather may bring row only.
        return WeightOperands(weight.select("row"), None)
    if cache is None:
        return _quantize(weight, numerics, context)
    return cache.get(weight, numerics, context)


def _mismatch(weight: QuantizedWeightTensor, numerics: GemmNumerics, context: GemmContext) -> Exception:
    return LowPrecisionUnavailableError(
        f"{context.name}: weight is stored as {weight.format.value} ({type(weight).__name__}) but autocast "
        f"requests {numerics.format.value} ({type(numerics.recipe).__name__}); quantized weights are never "
        "converted on the fly: use the same recipe in quantized_model_init/quantize_weights_ and autocast"
    )


class _DequantizedWeight(torch.autograd.Function):
    """``weight.dequantize()`` whose gradient flows to the quantized parameter unchanged."""

    @staticmethod
    def forward(ctx, weight: QuantizedWeightTensor) -> torch.Tensor:
        return weight.dequantize()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def high_precision_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight for a plain (BF16 baseline) GEMM: a quantized weight is dequantized
    (its logical dtype; the gradient still reaches the parameter), anything else is itself."""
    if isinstance(weight, QuantizedWeightTensor):
        return _DequantizedWeight.apply(weight)
    return weight
