"""The only global state of te_npu: the autocast stack and the quantized-init stack.

``autocast`` decides whether TE modules compute in an 8-bit recipe; ``quantized_model_init``
decides whether TE modules created inside it hold quantized weight tensors. Both are
class-based context managers (as TE's ``autocast`` is): the recipe is checked when the object
is made, one object can be entered again after it exits, and nested re-entry of the same
object is safe (each entry pushes, each exit pops its own entry). Leaving a context (also by
an exception) restores the outer state. Backward does not read this state: the autograd
functions capture the recipe active in forward.

Each autocast entry records the autograd graph task it was entered in
(``te_npu.compat.current_graph_task_id()``, -1 outside backward). A TE forward that runs inside
backward (activation recompute) trusts only an entry made inside that same backward, i.e. by
the recompute itself (``te_npu.checkpoint`` replays the forward's state that way), never one
that merely surrounds ``loss.backward()``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from te_npu.compat import current_graph_task_id
from te_npu.errors import ConfigError
from te_npu.recipe import MXFP8BlockRecipe, Recipe, check_recipe

__all__ = [
    "AutocastState",
    "QuantizedInitState",
    "autocast",
    "fp8_autocast",
    "quantized_model_init",
    "fp8_model_init",
    "is_autocast_enabled",
    "get_autocast_recipe",
    "get_autocast_state",
    "get_quantized_init_recipe",
    "get_quantized_init_state",
]


@dataclass(frozen=True)
class AutocastState:
    """What TE modules see: whether 8-bit compute is on, the recipe, and the amax group.

    ``graph_task``: the autograd graph task the context was entered in (-1: not in backward).
    """

    enabled: bool = False
    recipe: Recipe | None = None
    amax_reduction_group: Any = None
    graph_task: int = -1


@dataclass(frozen=True)
class QuantizedInitState:
    """The recipe TE modules built now quantize their weights with (None: high precision), and
    whether they keep the high-precision initial values on the CPU (TE's
    ``preserve_high_precision_init_val``)."""

    recipe: Recipe | None = None
    preserve_high_precision_init_val: bool = False


_DISABLED = AutocastState()
_NO_QUANTIZED_INIT = QuantizedInitState()
_autocast_stack: list[AutocastState] = []
_quantized_init_stack: list[QuantizedInitState] = []


def _resolve(enabled: bool, recipe: Recipe | None) -> Recipe | None:
    if not enabled:
        return None
    return recipe if recipe is not None else MXFP8BlockRecipe()


class _StackContext:
    """Push one entry on ``stack`` per ``__enter__``, pop it on the matching ``__exit__``."""

    __slots__ = ("_entries",)
    _stack: list

    def __init__(self) -> None:
        self._entries: list = []  # this object's own pushes (nested re-entry pushes again)

    def _entry(self):
        raise NotImplementedError

    def __enter__(self):
        entry = self._entry()
        self._stack.append(entry)
        self._entries.append(entry)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._entries or not self._stack or self._stack[-1] is not self._entries[-1]:
            raise RuntimeError(f"te_npu.{type(self).__name__} exited out of order (contexts must nest)")
        self._entries.pop()
        self._stack.pop()


class autocast(_StackContext):  # noqa: N801 -- a context manager named like the function it replaces
    """Run TE modules in ``recipe`` (default ``MXFP8BlockRecipe()``) inside the block.

    Arguments in Transformer Engine's order, ``autocast(enabled, calibrating, recipe,
    amax_reduction_group, _graph)``. ``enabled=False`` makes TE modules compute in their
    parameter dtype (the BF16 baseline) and never imports torch_npu. ``amax_reduction_group``
    is kept for API compatibility with Transformer Engine; current scaling in te_npu reduces
    weight amax in the optimizer refresh. ``calibrating`` (TE's delayed-scaling statistics) has
    no meaning for te_npu's stateless recipes and ``_graph`` (TE's CUDA-graph capture flag) none
    without graph capture: only False is accepted for either. Checked here, at the ``with``
    line: a recipe that is not a te_npu recipe raises ``TypeError``, and so does a recipe given
    positionally in the place of ``enabled`` or ``calibrating`` (te_npu's former order).
    """

    __slots__ = ("_state",)
    _stack = _autocast_stack

    def __init__(self, enabled: bool = True, calibrating: bool = False, recipe: Recipe | None = None,
                 amax_reduction_group: Any = None, _graph: bool = False) -> None:
        super().__init__()
        for name, flag in (("enabled", enabled), ("calibrating", calibrating)):
            _check_flag("te_npu.autocast", name, flag, "enabled, calibrating, recipe, amax_reduction_group, _graph")
        if calibrating:
            raise ConfigError("autocast.calibrating: True is not supported: te_npu's recipes keep no scaling "
                              "statistics to calibrate (current / block scaling)")
        if _graph:
            raise ConfigError("autocast._graph: True is not supported: te_npu does not capture CUDA / NPU graphs")
        recipe = check_recipe(recipe, "te_npu.autocast")
        self._state = AutocastState(bool(enabled), _resolve(enabled, recipe), amax_reduction_group)

    def _entry(self) -> AutocastState:
        task = current_graph_task_id()
        if task == self._state.graph_task:
            return self._state
        return AutocastState(self._state.enabled, self._state.recipe, self._state.amax_reduction_group, task)

    @classmethod
    def replaying(cls, state: AutocastState) -> "autocast":
        """A context that re-enters ``state`` (e.g. captured at a checkpointed call)."""
        return cls(state.enabled, recipe=state.recipe, amax_reduction_group=state.amax_reduction_group)


def _check_flag(where: str, name: str, value: Any, order: str) -> None:
    """A bool (or 0 / 1) flag; a recipe or anything else there is a misplaced positional argument."""
    if isinstance(value, (bool, int)):
        return
    raise TypeError(f"{where}: {name} must be a bool, got {type(value).__name__}; the positional order is "
                    f"Transformer Engine's ({order}): pass the recipe as recipe=...")


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Recipe | None = None,
                 fp8_group: Any = None, _graph: bool = False) -> autocast:
    """Transformer Engine's older spelling of :class:`autocast`, with TE's argument names and order."""
    return autocast(enabled, calibrating, fp8_recipe, fp8_group, _graph)


class quantized_model_init(_StackContext):  # noqa: N801
    """TE modules created inside hold ``MXFP8Tensor`` / ``HiF8Tensor`` weights of ``recipe``.

    ``preserve_high_precision_init_val=True`` (TE's option) keeps each weight's
    high-precision initial value on the CPU: ``param.get_high_precision_init_val()`` returns
    it and ``param.clear_high_precision_init_val()`` frees it (e.g. once an FP32 master is
    built from it). A recipe that is not a te_npu recipe raises ``TypeError`` here.
    """

    __slots__ = ("_state",)
    _stack = _quantized_init_stack

    def __init__(self, enabled: bool = True, recipe: Recipe | None = None,
                 preserve_high_precision_init_val: bool = False) -> None:
        super().__init__()
        _check_flag("te_npu.quantized_model_init", "enabled", enabled,
                    "enabled, recipe, preserve_high_precision_init_val")
        recipe = check_recipe(recipe, "te_npu.quantized_model_init")
        self._state = QuantizedInitState(_resolve(enabled, recipe), bool(preserve_high_precision_init_val))

    def _entry(self) -> QuantizedInitState:
        return self._state


fp8_model_init = quantized_model_init
"""Transformer Engine's older name of :class:`quantized_model_init` (same arguments)."""


def get_autocast_state() -> AutocastState:
    """The innermost autocast state (disabled outside any context)."""
    return _autocast_stack[-1] if _autocast_stack else _DISABLED


def is_autocast_enabled() -> bool:
    """True inside an enabled :class:`autocast`."""
    return get_autocast_state().enabled


def get_autocast_recipe() -> Recipe | None:
    """The active recipe, or None when autocast is off."""
    return get_autocast_state().recipe


def get_quantized_init_state() -> QuantizedInitState:
    """The innermost :class:`quantized_model_init` state (no quantization outside any)."""
    return _quantized_init_stack[-1] if _quantized_init_stack else _NO_QUANTIZED_INIT


def get_quantized_init_recipe() -> Recipe | None:
    """The recipe of the innermost enabled :class:`quantized_model_init`, or None."""
    return get_quantized_init_state().recipe
