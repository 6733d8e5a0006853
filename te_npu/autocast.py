"""The only global state of te_npu: the autocast stack and the quantized-init stack.

``autocast`` decides whether TE modules compute in an 8-bit recipe; ``quantized_model_init``
decides whether TE modules created inside it hold quantized weight tensors. Both nest, and
leaving a context (also by an exception) restores the outer state. Backward does not read
this state: the autograd functions capture the recipe active in forward.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from te_npu.recipe import MXFP8BlockRecipe, Recipe

__all__ = [
    "AutocastState",
    "autocast",
    "fp8_autocast",
    "quantized_model_init",
    "is_autocast_enabled",
    "get_autocast_recipe",
    "get_autocast_state",
    "get_quantized_init_recipe",
]


@dataclass(frozen=True)
class AutocastState:
    """What TE modules see: whether 8-bit compute is on, the recipe, and the amax group."""

    enabled: bool = False
    recipe: Recipe | None = None
    amax_reduction_group: Any = None


_DISABLED = AutocastState()
_autocast_stack: list[AutocastState] = []
_quantized_init_stack: list[Recipe | None] = []


def _resolve(enabled: bool, recipe: Recipe | None) -> Recipe | None:
    if not enabled:
        return None
    return recipe if recipe is not None else MXFP8BlockRecipe()


@contextmanager
def autocast(enabled: bool = True, recipe: Recipe | None = None, amax_reduction_group: Any = None) -> Iterator[None]:
    """Run TE modules in ``recipe`` (default ``MXFP8BlockRecipe()``) inside the block.

    ``enabled=False`` makes TE modules compute in their parameter dtype (the BF16 baseline)
    and never imports torch_npu. ``amax_reduction_group`` is kept for API compatibility with
    Transformer Engine; current scaling in te_npu reduces weight amax in the optimizer refresh.
    """
    _autocast_stack.append(AutocastState(enabled, _resolve(enabled, recipe), amax_reduction_group))
    try:
        yield
    finally:
        _autocast_stack.pop()


@contextmanager
def fp8_autocast(enabled: bool = True, fp8_recipe: Recipe | None = None, fp8_group: Any = None) -> Iterator[None]:
    """Transformer Engine's spelling of :func:`autocast`."""
    with autocast(enabled=enabled, recipe=fp8_recipe, amax_reduction_group=fp8_group):
        yield


@contextmanager
def quantized_model_init(enabled: bool = True, recipe: Recipe | None = None) -> Iterator[None]:
    """TE modules created inside hold ``MXFP8Tensor`` / ``HiF8Tensor`` weights of ``recipe``."""
    _quantized_init_stack.append(_resolve(enabled, recipe))
    try:
        yield
    finally:
        _quantized_init_stack.pop()


def get_autocast_state() -> AutocastState:
    """The innermost autocast state (disabled outside any context)."""
    return _autocast_stack[-1] if _autocast_stack else _DISABLED


def is_autocast_enabled() -> bool:
    """True inside an enabled :func:`autocast`."""
    return get_autocast_state().enabled


def get_autocast_recipe() -> Recipe | None:
    """The active recipe, or None when autocast is off."""
    return get_autocast_state().recipe


def get_quantized_init_recipe() -> Recipe | None:
    """The recipe of the innermost enabled :func:`quantized_model_init`, or None."""
    return _quantized_init_stack[-1] if _quantized_init_stack else None
