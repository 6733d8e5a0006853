"""What every TE module shares: its quantizer metadata, weight caches, FQN and quantized weights.

A TE module holds parameters (``_weight_names`` lists the GEMM weights) and, once it first
runs inside ``te_npu.autocast``, the role -> quantizer map of that recipe. None of this is
module state in PyTorch's sense: quantizers, caches and ``fqn`` are plain attributes, so
``state_dict`` holds exactly the parameters (no ``_extra_state``; recipes are stateless).

- ``fqn``: the module's name in the model, set by :func:`assign_fqns`; error messages use it,
  and so do the ``te_npu.events.OperandEvent`` s of its GEMMs (what each role was quantized
  to, for whoever subscribes: the module keeps no statistics itself).
- weights created under ``te_npu.quantized_model_init(recipe=...)`` or converted with
  ``te_npu.quantize_weights_`` are ``MXFP8Tensor`` / ``HiF8Tensor`` parameters, read as
  stored; a high-precision weight is quantized on every forward unless the caller passes
  TE's ``is_first_microbatch`` (``te_npu.functional.weight_cache``).
- which recipe a forward runs in, also when activation recompute replays it inside backward:
  ``te_npu.modules.forward_recipe``.
- compute dtype: TE's activation dtype (``te_npu.functional.dtypes``).
- construction follows TE's ``reset_parameters``: ``params_dtype`` defaults to
  ``torch.get_default_dtype()``, ``init_method`` (default ``normal_(0, 0.023)``) runs on each
  weight TE holds as a parameter, inside the RNG tracker's fork when one is given; biases are
  zero. TE's ``_extra_state`` state-dict entry is accepted and dropped on load.
- ``fuse_wgrad_accumulation``: the wgrad goes into ``weight.main_grad`` (``te_npu.functional.main_grad``).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from torch import nn

from te_npu.autocast import get_quantized_init_state
from te_npu.formats import QuantizationRole
from te_npu.functional.main_grad import MainGradWrite
from te_npu.functional.weight_cache import WeightCache, high_precision_weight, preserved_value_for_rule_change
from te_npu.modules.forward_recipe import ForwardRecipes
from te_npu.ops import require_low_precision
from te_npu.quantizers import Quantizer
from te_npu.recipe import Recipe
from te_npu.tensor import QuantizedWeightTensor, attach_high_precision_init_val, empty_quantized_weight, quantize_weight

__all__ = ["TEModule", "assign_fqns", "TE_DEFAULT_INIT_STD"]

TE_DEFAULT_INIT_STD = 0.023
"""TE's default weight init is ``normal_(0, 0.023)`` (``transformer_engine/pytorch/utils.py``,
``get_default_init_method``)."""


class TEModule(nn.Module):
    """Base of ``TELinear`` / ``TEGroupedLinear`` / ``TEGroupedSwiGLUExperts``."""

    _weight_names: ClassVar[tuple[str, ...]] = ("weight",)

    def __init__(self) -> None:
        super().__init__()
        self.fqn: str | None = None
        self._recipe: Recipe | None = None
        self._forward_recipes = ForwardRecipes()
        self._quantizers: Mapping[QuantizationRole, Quantizer] | None = None
        self._weight_caches = {name: WeightCache() for name in self._weight_names}
        self.fuse_wgrad_accumulation = False  # TE's option; TELinear / TEGroupedLinear take it

    # ---- which recipe this forward runs in --------------------------------------------------
    def forward_recipe(self) -> Recipe | None:
        """The recipe of this forward: the autocast recipe, or None for the plain path.

        A forward replayed by activation recompute (inside backward) gets the recipe of the
        checkpointed call (``te_npu.modules.forward_recipe``). Every forward hands its output to
        :meth:`_forward_done`, so that a plain ``torch.utils.checkpoint`` recompute can tell.
        """
        return self._forward_recipes.current(self.te_name)

    def _forward_done(self, output: torch.Tensor, recipe: Recipe | None) -> None:
        self._forward_recipes.record(output, recipe)

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
        return self._quantizers

    @property
    def te_name(self) -> str:
        """The FQN when known (see :func:`assign_fqns`), else the class and its shape."""
        return self.fqn if self.fqn else f"{type(self).__name__}({self.extra_repr()})"

    def _device(self) -> torch.device:
        return getattr(self, self._weight_names[0]).device

    def _gemm_kwargs(self, recipe: Recipe, weight_name: str = "weight",
                     is_first_microbatch: bool | None = None) -> dict:
        """Keyword arguments of a ``te_npu.functional`` call for one of this module's weights."""
        return dict(recipe=recipe, quantizers=self.quantizers_for(recipe), name=self.te_name,
                    weight_cache=self._weight_caches[weight_name], is_first_microbatch=is_first_microbatch)

    def _main_grad_write(self, name: str, is_first_microbatch: bool | None) -> MainGradWrite | None:
        """How this forward's wgrad reaches ``<name>.main_grad`` under TE's ``fuse_wgrad_accumulation``
        (None: an ordinary gradient, or no wgrad at all)."""
        if not (self.fuse_wgrad_accumulation and torch.is_grad_enabled() and getattr(self, name).requires_grad):
            return None
        return MainGradWrite.for_call(is_first_microbatch)

    def _plain_weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A weight for the plain path in the activation ``dtype`` (a quantized weight dequantized;
        autograd-tracked, so the gradient reaches the parameter in its own dtype)."""
        weight = high_precision_weight(getattr(self, name), dtype)
        return weight if weight.dtype == dtype else weight.to(dtype)

    # ---- quantized weights -----------------------------------------------------------------
    def _quantize_weights_(self, recipe: Recipe, preserve_high_precision_init_val: bool = False) -> None:
        """Replace every high-precision GEMM weight by a quantized parameter of ``recipe``.

        The new parameter is a different object (build optimizers afterwards); a weight that
        is already quantized in ``recipe``'s format and MXFP8 scale rule is kept, one in another
        format raises; one of the other scale rule is re-quantized from its preserved
        high-precision value while that still reproduces it, else raises naming both rules. A
        meta weight becomes a meta quantized weight with no values (shard it, ``to_empty`` it,
        then write it with ``refresh_from_master``: ``MasterWeightOptimizer``'s initialisation).
        ``preserve_high_precision_init_val``: keep the high-precision value on the CPU behind
        ``param.get_high_precision_init_val()`` / ``clear_high_precision_init_val()`` (TE's API).
        """
        for name in self._weight_names:
            weight = getattr(self, name)
            requires_grad, preserve = weight.requires_grad, preserve_high_precision_init_val
            if isinstance(weight, QuantizedWeightTensor):
                if weight.format != recipe.format:
                    raise ValueError(f"{self.te_name}.{name}: already quantized as {weight.format.value}, "
                                     f"cannot convert to {recipe.format.value} (load the high-precision weights)")
                have, want = getattr(weight.quantizer, "scale_alg", None), getattr(recipe, "scale_alg", None)
                if have == want:
                    continue
                value, why = preserved_value_for_rule_change(weight)
                if value is None:
                    raise ValueError(f"{self.te_name}.{name}: quantized with MXFP8 scale_alg={have!r}, the recipe "
                                     f"computes scale_alg={want!r}, and {why}")
                weight, preserve = value, True  # the preserved value stays behind the new weight too
            if weight.is_meta and preserve:
                raise ValueError(f"{self.te_name}.{name}: a meta weight has no high-precision value to preserve")
            make = empty_quantized_weight if weight.is_meta else quantize_weight
            quantized = nn.Parameter(make(weight.detach(), recipe), requires_grad=requires_grad)
            if preserve:
                attach_high_precision_init_val(quantized, weight.detach().cpu())
            setattr(self, name, quantized)
            self._weight_caches[name].clear()

    # ---- construction ------------------------------------------------------------------------
    def _init_parameters(
        self,
        shapes: Mapping[str, tuple[int, ...] | None],
        *,
        params_dtype: torch.dtype | None,
        device: torch.device | str | None,
        init_method: Callable[[torch.Tensor], None] | None,
        get_rng_state_tracker: Callable[[], Any] | None = None,
        rng_tracker_name: str | None = None,
    ) -> None:
        """The constructor body every TE module shares: register ``shapes`` (name -> shape, in
        this order; None leaves that attribute None, e.g. an absent bias) as ``params_dtype``
        parameters (TE's default: ``torch.get_default_dtype()``) on ``device``, initialise them
        (:meth:`reset_parameters`), then quantize them when built inside ``quantized_model_init``."""
        self.init_method = init_method
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        for name, shape in shapes.items():
            value = None if shape is None else nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
            setattr(self, name, value)
        self.reset_parameters()
        self._finish_init()

    def reset_parameters(self) -> None:
        """Initialise each GEMM weight (``_weight_names``, in order) with ``init_method``, else the
        module's default (:meth:`_default_init`), and a bias to zero; a meta module is left alone.

        As TE: ``init_method`` gets each weight TE holds as its own parameter (``TEGroupedLinear``:
        every ``weight[g]`` ``[out, in]``, TE's ``weight{g}``, in order), under ``torch.no_grad``
        and inside ``get_rng_state_tracker().fork(rng_tracker_name)`` when a tracker is given.
        A quantized weight is initialised in high precision and re-quantized."""
        if self._device().type == "meta":
            return
        init = self.init_method or self._default_init
        for name in self._weight_names:
            weight = getattr(self, name)
            values = weight.dequantize() if isinstance(weight, QuantizedWeightTensor) else weight
            with torch.no_grad():
                for unit in self._init_units(values):
                    with self._rng_fork():
                        init(unit)
                if values is not weight:
                    weight.copy_(values)
        with torch.no_grad():
            for bias in self._bias_parameters():
                nn.init.zeros_(bias)

    def _init_units(self, weight: torch.Tensor) -> Sequence[torch.Tensor]:
        """The tensors ``init_method`` is called on for one GEMM weight (default: the weight)."""
        return (weight,)

    def _bias_parameters(self) -> list[torch.Tensor]:
        bias = getattr(self, "bias", None)
        return [] if bias is None else [bias]

    def _rng_fork(self):
        """TE's ``get_rng_state_tracker().fork(rng_tracker_name)`` around each weight init, if given."""
        if self.get_rng_state_tracker is None:
            return contextlib.nullcontext()
        tracker = self.get_rng_state_tracker()
        return tracker.fork(self.rng_tracker_name) if self.rng_tracker_name else tracker.fork()

    def _default_init(self, weight: torch.Tensor) -> None:
        """TE's default weight init, ``init.normal_(mean=0.0, std=0.023)``
        (``transformer_engine.pytorch.utils.get_default_init_method``)."""
        nn.init.normal_(weight, mean=0.0, std=TE_DEFAULT_INIT_STD)

    def _finish_init(self) -> None:
        """Constructor tail: quantize the weights when built inside ``quantized_model_init``.

        A meta-device module has no values to quantize; rather than leave it silently high
        precision, this raises (build on meta outside ``quantized_model_init``, materialize,
        then call ``te_npu.quantize_weights_``)."""
        state = get_quantized_init_state()
        recipe = state.recipe
        if recipe is None:
            return
        if self._device().type == "meta":
            raise ValueError(
                f"{type(self).__name__} built on the meta device inside te_npu.quantized_model_init: meta "
                "weights hold no values to quantize. Build the model on meta outside quantized_model_init, "
                "materialize and initialise it, then call te_npu.quantize_weights_(model, recipe)"
            )
        self._quantize_weights_(recipe, state.preserve_high_precision_init_val)

    # ---- TE's state dicts ----------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """Also load a Transformer Engine module's state dict (:meth:`_accept_te_keys`)."""
        self._accept_te_keys(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _accept_te_keys(self, state_dict: dict, prefix: str) -> None:
        """Rewrite TE's keys under ``prefix`` into this module's, in place. TE modules save an
        ``_extra_state`` entry (their FP8 scaling metadata; an empty tensor for stateless
        recipes): te_npu's recipes keep no state, so it is dropped."""
        state_dict.pop(prefix + "_extra_state", None)

    def __getstate__(self) -> dict:
        """``copy.deepcopy`` / pickle: parameters and configuration only; the derived metadata
        (quantizers, kept weight operands, live-forward records) starts empty."""
        state = self.__dict__.copy()
        state.update(_recipe=None, _quantizers=None, _forward_recipes=ForwardRecipes(),
                     _weight_caches={name: WeightCache() for name in self._weight_names})
        return state

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
