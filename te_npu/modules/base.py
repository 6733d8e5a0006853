"""What every TE module shares: its quantizer metadata, weight caches, FQN and quantized weights.

A TE module holds parameters (``_weight_names`` lists the GEMM weights) and, once it first
runs inside ``te_npu.autocast``, the role -> quantizer map of that recipe. None of this is
module state in PyTorch's sense: quantizers, caches, stats and ``fqn`` are plain attributes,
so ``state_dict`` holds exactly the parameters (no ``_extra_state``; recipes are stateless).

- ``quant_stats``: role -> ``QuantStats`` of the latest quantizations (detached tensors, no
  host sync); grouped SwiGLU experts keep one such dict per GEMM.
- ``fqn``: the module's name in the model, set by :func:`assign_fqns`; error messages use it.
- weights created under ``te_npu.quantized_model_init(recipe=...)`` or converted with
  ``te_npu.quantize_weights_`` are ``MXFP8Tensor`` / ``HiF8Tensor`` parameters; a
  high-precision weight is quantized once per parameter version (``WeightCache``).
"""
from __future__ import annotations

import warnings
from typing import ClassVar, Mapping

import torch
from torch import nn

from te_npu.autocast import get_autocast_recipe, get_quantized_init_recipe
from te_npu.formats import QuantizationRole
from te_npu.functional.weight_cache import WeightCache
from te_npu.ops import require_low_precision
from te_npu.quantizers import Quantizer
from te_npu.recipe import Recipe
from te_npu.tensor import QuantizedWeightTensor, quantize_weight

__all__ = ["TEModule", "assign_fqns"]


class TEModule(nn.Module):
    """Base of ``TELinear`` / ``TEGroupedLinear`` / ``TEGroupedSwiGLUExperts``."""

    _weight_names: ClassVar[tuple[str, ...]] = ("weight",)

    def __init__(self) -> None:
        super().__init__()
        self.fqn: str | None = None
        self.quant_stats: dict = {}
        self._recipe: Recipe | None = None
        self._last_forward_recipe: Recipe | None = None
        self._quantizers: Mapping[QuantizationRole, Quantizer] | None = None
        self._weight_caches = {name: WeightCache() for name in self._weight_names}

    # ---- which recipe this forward runs in --------------------------------------------------
    def forward_recipe(self) -> Recipe | None:
        """The recipe of this forward: the autocast recipe, or None for the plain path.

        Activation recompute (``torch.utils.checkpoint(..., use_reentrant=False)``) reruns
        forward *during backward*, usually outside the ``te_npu.autocast`` block of the original
        forward. A forward that runs inside a backward pass therefore reuses the recipe (or
        plain path) this module's last ordinary forward used, so the recomputed activations,
        GEMM path and saved operands are bitwise those of the original forward.
        """
        if torch._C._current_graph_task_id() != -1:  # inside backward: a recompute
            return self._last_forward_recipe
        self._last_forward_recipe = get_autocast_recipe()
        return self._last_forward_recipe

    # ---- quantizer metadata ----------------------------------------------------------------
    def quantizers_for(self, recipe: Recipe) -> Mapping[QuantizationRole, Quantizer]:
        """This module's role -> quantizer map for ``recipe``: built on first low-precision use
        (after the device capability gate), rebuilt when the recipe changes, with a warning
        when it changes type (e.g. MXFP8 -> HiF8 between two forwards)."""
        if self._quantizers is None or recipe != self._recipe:
            if self._recipe is not None and type(recipe) is not type(self._recipe):
                warnings.warn(f"{self.te_name}: recipe changed from {type(self._recipe).__name__} to "
                              f"{type(recipe).__name__}; rebuilding its quantizers", stacklevel=3)
            require_low_precision(recipe.format, self._device())
            self._recipe, self._quantizers = recipe, recipe.quantizers()
            self.quant_stats.clear()
        return self._quantizers

    @property
    def te_name(self) -> str:
        """The FQN when known (see :func:`assign_fqns`), else the class and its shape."""
        return self.fqn if self.fqn else f"{type(self).__name__}({self.extra_repr()})"

    def _device(self) -> torch.device:
        return getattr(self, self._weight_names[0]).device

    def _gemm_kwargs(self, recipe: Recipe, weight_name: str = "weight") -> dict:
        """Keyword arguments of a ``te_npu.functional`` call for one of this module's weights."""
        return dict(recipe=recipe, quantizers=self.quantizers_for(recipe), name=self.te_name,
                    weight_cache=self._weight_caches[weight_name], stats=self.quant_stats)

    # ---- quantized weights -----------------------------------------------------------------
    def _quantize_weights_(self, recipe: Recipe) -> None:
        """Replace every high-precision GEMM weight by a quantized parameter of ``recipe``.

        The new parameter is a different object (build optimizers afterwards); a weight that
        is already quantized in ``recipe``'s format is kept, one in another format raises.
        """
        for name in self._weight_names:
            weight = getattr(self, name)
            if isinstance(weight, QuantizedWeightTensor):
                if weight.format != recipe.format:
                    raise ValueError(f"{self.te_name}.{name}: already quantized as {weight.format.value}, "
                                     f"cannot convert to {recipe.format.value} (load the high-precision weights)")
                continue
            if weight.is_meta:
                raise ValueError(f"{self.te_name}.{name}: cannot quantize a meta weight; materialize and "
                                 "initialise it first, then call te_npu.quantize_weights_(model, recipe)")
            quantized = quantize_weight(weight.detach(), recipe)
            setattr(self, name, nn.Parameter(quantized, requires_grad=weight.requires_grad))
            self._weight_caches[name].clear()

    def _finish_init(self) -> None:
        """Constructor tail: quantize the weights when built inside ``quantized_model_init``.

        A meta-device module has no values to quantize; rather than leave it silently high
        precision, this raises (build on meta outside ``quantized_model_init``, materialize,
        then call ``te_npu.quantize_weights_``)."""
        recipe = get_quantized_init_recipe()
        if recipe is None:
            return
        if self._device().type == "meta":
            raise ValueError(
                f"{type(self).__name__} built on the meta device inside te_npu.quantized_model_init: meta "
                "weights hold no values to quantize. Build the model on meta outside quantized_model_init, "
                "materialize and initialise it, then call te_npu.quantize_weights_(model, recipe)"
            )
        self._quantize_weights_(recipe)

    def _apply(self, fn, recurse: bool = True):
        for cache in self._weight_caches.values():
            cache.clear()
        return super()._apply(fn, recurse)


def assign_fqns(model: nn.Module) -> nn.Module:
    """Set ``fqn`` on every TE module of ``model`` to its name in ``model`` (for error messages)."""
    for name, module in model.named_modules():
        if isinstance(module, TEModule):
            module.fqn = name
    return model
