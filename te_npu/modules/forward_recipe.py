"""Which recipe a TE module's forward runs in, including a forward replayed by activation recompute.

An ordinary forward (not inside backward) runs in the innermost ``te_npu.autocast`` state.

A forward inside backward is an activation recompute (``torch.utils.checkpoint``). Its
recipe must be the one of the *checkpointed call*, whatever the module ran since:

1. ``te_npu.checkpoint`` (TE's ``te.checkpoint``) re-enters the autocast state of the call
   around the recompute, and so does any ``context_fn`` that enters ``te_npu.autocast``: an
   autocast entered inside the running backward is the answer.
2. A plain ``torch.utils.checkpoint`` recompute carries no te_npu state. Each ordinary
   forward that builds an autograd graph therefore leaves a record on its output's graph node
   (a pre-hook, alive exactly as long as that graph). If every live graph of this module ran
   one recipe, the recompute uses it; if they ran different ones (a checkpointed MXFP8
   forward, then an HiF8 or plain forward of the same module, then backward), or none is
   alive, the call cannot be identified and it raises, naming ``te_npu.checkpoint``.

An autocast around ``loss.backward()`` is never read here: it says nothing about the
recipe of the forward being recomputed.
"""
from __future__ import annotations

import weakref

import torch

from te_npu.autocast import get_autocast_state
from te_npu.compat import current_graph_task_id, in_autograd_backward
from te_npu.recipe import Recipe

__all__ = ["ForwardRecipes", "in_backward"]


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return in_autograd_backward()


class _GraphRecord:
    """The recipe of one forward, registered as a no-op pre-hook on its output's graph node."""

    __slots__ = ("recipe", "__weakref__")

    def __init__(self, recipe: Recipe | None) -> None:
        self.recipe = recipe

    def __call__(self, grad_outputs):
        return None


class ForwardRecipes:
    """One module's recipe resolution (see the module docstring)."""

    __slots__ = ("_live",)

    def __init__(self) -> None:
        self._live: weakref.WeakSet[_GraphRecord] = weakref.WeakSet()

    def current(self, name: str) -> Recipe | None:
        """The recipe the forward starting now must run in; ``name`` is used in errors."""
        state = get_autocast_state()
        task = current_graph_task_id()
        if task == -1 or state.graph_task == task:
            return state.recipe
        recipes = {record.recipe for record in list(self._live)}
        if len(recipes) == 1:
            return recipes.pop()
        found = (f"its live autograd graphs ran {len(recipes)} different recipes "
                 f"({', '.join(sorted(type(r).__name__ if r else 'no recipe' for r in recipes))})"
                 if recipes else "no autograd graph of its forward is alive")
        raise RuntimeError(
            f"{name}: forward runs inside backward (activation recompute?) and the recipe of the checkpointed "
            f"call cannot be told: {found}. Checkpoint with te_npu.checkpoint(fn, *args) (TE's te.checkpoint), "
            "which replays the autocast state of each call, or enter te_npu.autocast in the recompute "
            "(torch.utils.checkpoint context_fn)"
        )

    def record(self, output: torch.Tensor, recipe: Recipe | None) -> None:
        """Remember ``recipe`` for as long as ``output``'s autograd graph lives (ordinary forwards only)."""
        node = output.grad_fn
        if node is None or in_backward():
            return
        graph_record = _GraphRecord(recipe)
        node.register_prehook(graph_record)
        self._live.add(graph_record)
