"""Which recipe a TE module's forward runs in, including a forward replayed by activation recompute.

An ordinary forward (not inside backward) runs in the innermost ``te_npu.autocast`` state.

A forward inside backward is an activation recompute (``torch.utils.checkpoint``). Its
recipe must be the one of the *checkpointed call*, whatever the module ran since:

1. ``te_npu.checkpoint`` (TE's ``te.checkpoint``) re-enters the autocast state of the call
   around the recompute, and so does any ``context_fn`` that enters ``te_npu.autocast``: an
   autocast entered inside the running backward is the answer.
2. A plain ``torch.utils.checkpoint`` recompute carries no te_npu state. Each ordinary
   forward that builds an autograd graph therefore leaves a record on its output's graph node
   (a pre-hook, alive exactly as long as that graph). A reentrant checkpoint
   (``use_reentrant=True``, torch's default, and Megatron's own checkpointing) runs the
   checkpointed forward under ``torch.no_grad``: it builds no graph, so every forward of the
   module under ``no_grad`` adds its recipe to a set that never expires (it cannot know when
   the reentrant graph dies). The recompute being served is one of those forwards, so if the
   live graphs and the no-grad forwards together ran one recipe, the recompute uses it; if
   they ran different ones (a checkpointed MXFP8 forward, then an HiF8 or plain forward of the
   same module, then backward; or an evaluation under ``no_grad`` in another recipe), or
   there is none, the call cannot be identified and it raises, naming ``te_npu.checkpoint``.
   Forwards under ``torch.inference_mode`` are not recorded (they can never be recomputed).

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

    __slots__ = ("_live", "_without_graph")

    def __init__(self) -> None:
        self._live: weakref.WeakSet[_GraphRecord] = weakref.WeakSet()
        self._without_graph: set[Recipe | None] = set()  # recipes of forwards run under no_grad

    def __reduce__(self):
        """Pickled (``torch.save(module)``, ``copy.deepcopy``) as a fresh, empty record."""
        return (ForwardRecipes, ())

    def current(self, name: str) -> Recipe | None:
        """The recipe the forward starting now must run in; ``name`` is used in errors."""
        state = get_autocast_state()
        task = current_graph_task_id()
        if task == -1 or state.graph_task == task:
            return state.recipe
        recipes = {record.recipe for record in list(self._live)} | self._without_graph
        if len(recipes) == 1:
            return next(iter(recipes))
        found = (f"its live autograd graphs and its forwards under torch.no_grad (a reentrant checkpoint runs "
                 f"those) ran {len(recipes)} different recipes "
                 f"({', '.join(sorted(type(r).__name__ if r else 'no recipe' for r in recipes))})"
                 if recipes else "no autograd graph of its forward is alive")
        raise RuntimeError(
            f"{name}: forward runs inside backward (activation recompute?) and the recipe of the checkpointed "
            f"call cannot be told: {found}. Checkpoint with te_npu.checkpoint(fn, *args) (TE's te.checkpoint), "
            "which replays the autocast state of each call, or enter te_npu.autocast in the recompute "
            "(torch.utils.checkpoint context_fn)"
        )

    def record(self, output: torch.Tensor, recipe: Recipe | None) -> None:
        """Remember ``recipe`` for as long as ``output``'s autograd graph lives (ordinary forwards
        only); a forward under ``torch.no_grad`` for good."""
        if in_backward():
            return
        if not torch.is_grad_enabled():
            if not torch.is_inference_mode_enabled():
                self._without_graph.add(recipe)
            return
        node = output.grad_fn
        if node is None:
            return
        graph_record = _GraphRecord(recipe)
        node.register_prehook(graph_record)
        self._live.add(graph_record)
