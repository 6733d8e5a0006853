"""Weight operands of a low-precision GEMM: from a quantized weight, or quantized now.

A TE weight is either
- a ``QuantizedWeightTensor`` parameter (``quantized_model_init`` / ``quantize_weights_``):
  its stored row / col payloads are the operands, never re-quantized in forward (te_npu's
  training path: ``MasterWeightOptimizer`` refreshes them once after each optimizer step).
  It carries the quantizer it was made with, hence its MXFP8 scale rule (``scale_alg``):
  under a recipe with the other rule its operands are quantized afresh, for this call, from
  its high-precision value when it has a current one (TE's ``get_high_precision_init_val()``,
  checked to still quantize to the stored payload), else the call raises naming both rules; or
- a high-precision parameter, quantized following Transformer Engine's model
  (``is_first_microbatch``, as TE's ``Linear.forward`` takes it):

  ========================  ===============================================================
  ``is_first_microbatch``   weight operands
  ========================  ===============================================================
  ``None`` (default)        quantized from the weight's current values on every call: always
                            fresh, whatever wrote the weight (``param.data.copy_``, EMA swaps,
                            ``load_state_dict``, rebinding)
  ``True``                  quantized now and kept in the module's ``WeightCache``
  ``False``                 the kept operands: the caller vouches that the weight did not
                            change since the ``True`` call (micro-batches of one step)
  ========================  ===============================================================

  ``False`` still re-quantizes (and keeps the new operands) when the cache is empty or a
  change is visible from metadata: another tensor object, another version (an in-place op
  through autograd's view of the weight, e.g. an optimizer step), another storage, shape,
  dtype or device, or another recipe. Writes through ``param.data`` are invisible to these
  checks by PyTorch's design (``.data`` has its own version counter): that is what the
  caller promises not to do between ``True`` and ``False``.

  An activation recompute (a forward inside backward) is the same logical call as its
  forward: there ``True`` reuses the operands it kept (when still valid) instead of
  quantizing the unchanged weight again; ``None`` quantizes again (one extra weight
  quantization per recomputed call, the price of never trusting a cache).

The cache holds one entry: the previous operands are dropped *before* new ones are made, so
at most one cached quantized copy per weight is alive (plus whatever an autograd graph still
references). It is a plain attribute, never a buffer, so it is not part of ``state_dict``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from te_npu.compat import in_autograd_backward
from te_npu.errors import LowPrecisionUnavailableError
from te_npu.formats import QuantizationRole
from te_npu.functional.operands import GemmContext, GemmNumerics, quantize_pair
from te_npu.tensor import QuantizedWeightTensor
from te_npu.ops.layouts import to_canonical
from te_npu.ops.operand import QuantizedOperand

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


def _cache_key(weight: torch.Tensor, numerics: GemmNumerics) -> tuple:
    return (weight._version, weight.data_ptr(), tuple(weight.shape), weight.dtype, weight.device,
            numerics.recipe, dict(numerics.quantizers))


class WeightCache:
    """The operands of one high-precision weight kept between ``is_first_microbatch`` calls.

    It holds the weight it was filled from (a plain reference, not a weakref: a weakref on a
    parameter makes ``torch.utils.swap_tensors``, hence ``module.to`` and ``load_state_dict``
    with swapping, refuse it; a Python reference does not count as a use of its storage), so
    "another tensor object" is an identity test that cannot be fooled by a recycled ``id``.
    """

    __slots__ = ("_weight", "_key", "_operands", "fills")

    def __init__(self) -> None:
        self._weight: torch.Tensor | None = None
        self._key: tuple | None = None
        self._operands: WeightOperands | None = None
        self.fills = 0  # how many times operands were quantized into the cache (observability)

    def get(self, weight: torch.Tensor, numerics: GemmNumerics, context: GemmContext | None = None, *,
            is_first_microbatch: bool | None = None) -> WeightOperands:
        """The operands for ``weight`` under TE's ``is_first_microbatch`` rule (module docstring)."""
        context = context or GemmContext()
        if is_first_microbatch is None or weight.is_inference():  # inference tensors have no version
            return _quantize(weight, numerics, context)
        recompute = in_autograd_backward()  # a forward replayed inside backward
        reuse = is_first_microbatch is False or recompute
        if reuse and self._valid_for(weight, numerics):
            return self._operands
        self.clear()  # drop the old copy first: never two alive because of the cache
        self._operands = _quantize(weight, numerics, context)
        self._weight, self._key = weight, _cache_key(weight, numerics)
        self.fills += 1
        return self._operands

    def _valid_for(self, weight: torch.Tensor, numerics: GemmNumerics) -> bool:
        return (self._operands is not None and self._weight is weight
                and self._key == _cache_key(weight, numerics))

    def clear(self) -> None:
        """Forget the cached operands (they are freed once no autograd graph holds them)."""
        self._weight, self._key, self._operands = None, None, None


def weight_operands(weight: torch.Tensor, numerics: GemmNumerics, cache: WeightCache | None,
                    context: GemmContext, is_first_microbatch: bool | None = None) -> WeightOperands:
    """Row and col operands of ``weight`` in ``numerics``' format (``cache`` and
    ``is_first_microbatch`` as in the module docstring; no cache: quantized now).

    Raises ``LowPrecisionUnavailableError`` when ``weight`` is a quantized weight of another
    format than the recipe (a quantized weight is never converted on the fly).
    """
    if isinstance(weight, QuantizedWeightTensor):
        if weight.format != numerics.format:
            raise _mismatch(weight, numerics, context)
        if _scale_rule(weight.quantizer) != _scale_rule(numerics.quantizers[QuantizationRole.WEIGHT_FWD]):
            return _quantize(_high_precision_for_rule_change(weight, numerics, context), numerics, context)
        # col: selected in backward (``col_operand``); an FSDP2 forward gather may bring row only.
        return WeightOperands(weight.select("row"), None)
    if cache is None:
        return _quantize(weight, numerics, context)
    return cache.get(weight, numerics, context, is_first_microbatch=is_first_microbatch)


def _scale_rule(quantizer) -> str | None:
    """The MXFP8 E8M0 scale rule of a quantizer (None for formats without one)."""
    return getattr(quantizer, "scale_alg", None)


def preserved_value_for_rule_change(weight: QuantizedWeightTensor) -> tuple[torch.Tensor | None, str]:
    """The value to re-quantize ``weight`` under another MXFP8 scale rule from, or ``(None, why)``.

    That is its preserved high-precision value (TE's ``get_high_precision_init_val``), on the
    weight's device in its logical dtype, but only while it still quantizes (under the weight's
    own rule) to the stored row payload, i.e. the weight has not changed since it was quantized."""
    getter = getattr(weight, "get_high_precision_init_val", None)
    value = getter() if callable(getter) else None
    if value is None:
        return None, ("it has no high-precision value to re-quantize from (build it under this recipe, or keep "
                      "one with quantized_model_init(preserve_high_precision_init_val=True))")
    value = value.to(device=weight.device, dtype=weight.dtype)
    stored, again = weight.select("row"), to_canonical(weight.quantizer.quantize(value, orientation="row"))
    if torch.equal(again.scale, stored.scale) and torch.equal(again.data.view(torch.uint8), stored.data.view(torch.uint8)):
        return value, ""
    return None, "its preserved high-precision value no longer quantizes to it (the weight changed since)"


def _high_precision_for_rule_change(weight: QuantizedWeightTensor, numerics: GemmNumerics,
                                    context: GemmContext) -> torch.Tensor:
    """:func:`preserved_value_for_rule_change`, else ``LowPrecisionUnavailableError`` naming both rules."""
    have, want = _scale_rule(weight.quantizer), _scale_rule(numerics.quantizers[QuantizationRole.WEIGHT_FWD])
    value, why = preserved_value_for_rule_change(weight)
    if value is not None:
        return value
    raise LowPrecisionUnavailableError(
        f"{context.name}: weight {list(weight.shape)} was quantized with MXFP8 scale_alg={have!r} but the recipe "
        f"({type(numerics.recipe).__name__}) computes scale_alg={want!r}, and {why}; quantize the weights and "
        "run autocast with the same scale rule")


def _mismatch(weight: QuantizedWeightTensor, numerics: GemmNumerics, context: GemmContext) -> Exception:
    return LowPrecisionUnavailableError(
        f"{context.name}: weight is stored as {weight.format.value} ({type(weight).__name__}) but autocast "
        f"requests {numerics.format.value} ({type(numerics.recipe).__name__}); quantized weights are never "
        "converted on the fly: use the same recipe in quantized_model_init/quantize_weights_ and autocast"
    )


class _DequantizedWeight(torch.autograd.Function):
    """``weight.dequantize(dtype)`` whose gradient flows to the quantized parameter (autograd
    casts it to the parameter's logical dtype)."""

    @staticmethod
    def forward(ctx, weight: QuantizedWeightTensor, dtype: torch.dtype | None) -> torch.Tensor:
        return weight.dequantize(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def high_precision_weight(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight for a plain (BF16 baseline) GEMM: a quantized weight is dequantized (into
    ``dtype``, default its logical dtype, exactly; the gradient still reaches the parameter),
    anything else is itself."""
    if isinstance(weight, QuantizedWeightTensor):
        return _DequantizedWeight.apply(weight, dtype)
    return weight
