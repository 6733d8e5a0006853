"""``te_npu.checkpoint``: activation recompute that replays the te_npu autocast state.

Transformer Engine's ``te.checkpoint`` (``transformer_engine.pytorch.distributed.checkpoint``)
captures the FP8 autocast state at the checkpointed call and re-enters it when backward
recomputes the forward. This is the same over ``torch.utils.checkpoint.checkpoint`` with
``use_reentrant=False``: the recompute context (``context_fn``) enters the autocast state
of the call, so the replayed forward computes in the recipe it used, whatever the module ran
since, and saves bitwise the same operands. torch's own autocast and RNG state are replayed
by ``torch.utils.checkpoint`` itself.

Not the DCP module ``te_npu.distributed.checkpoint`` (model / optimizer checkpoints), and not
``te_npu.training.recompute`` (which applies this function to chosen layers).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch.utils.checkpoint

from te_npu.autocast import autocast, get_autocast_state
from te_npu.errors import ConfigError

__all__ = ["checkpoint"]

# TE's te.checkpoint arguments with no counterpart here -> the only accepted value, why
_TE_ONLY_ARGUMENTS = {
    "use_reentrant": (False, "te_npu.checkpoint always recomputes non-reentrantly "
                             "(torch.utils.checkpoint use_reentrant=False)"),
    "distribute_saved_activations": (False, "there is no tensor parallelism to distribute saved activations over"),
    "tp_group": (None, "there is no tensor parallelism"),
    "get_rng_state_tracker": (None, "there is no tensor-parallel RNG tracker; torch.utils.checkpoint replays "
                                    "the RNG state"),
}


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` with its activations recomputed in backward (TE's name).

    The te_npu autocast state active now (enabled or not, recipe) is re-entered around the
    recompute. ``context_fn``, ``preserve_rng_state``, ``determinism_check`` and ``debug``
    go to ``torch.utils.checkpoint.checkpoint``; a user ``context_fn``'s contexts are entered
    too (the autocast replay innermost). TE's ``use_reentrant`` / ``distribute_saved_activations``
    / ``tp_group`` / ``get_rng_state_tracker`` accept only their no-op values; anything else
    raises ``ConfigError`` with the reason.
    """
    for name, (accepted, reason) in _TE_ONLY_ARGUMENTS.items():
        value = kwargs.pop(name, accepted)
        if value is not accepted and value != accepted:
            raise ConfigError(f"te_npu.checkpoint: {name}={value!r} is not supported: {reason}")
    user_context_fn = kwargs.pop("context_fn", torch.utils.checkpoint.noop_context_fn)
    options = {k: kwargs.pop(k) for k in ("preserve_rng_state", "determinism_check", "debug") if k in kwargs}
    state = get_autocast_state()

    def context_fn():
        user_forward, user_recompute = user_context_fn()
        return user_forward, _both(user_recompute, autocast.replaying(state))

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=context_fn,
                                             **options, **kwargs)


class _both:  # noqa: N801
    """Enter ``outer`` then ``inner``; reusable (torch enters the recompute context once per
    recompute, and a retained graph can be recomputed more than once)."""

    def __init__(self, outer, inner) -> None:
        self._outer, self._inner, self._stacks = outer, inner, []

    def __enter__(self):
        stack = contextlib.ExitStack()
        stack.enter_context(self._outer)
        stack.enter_context(self._inner)
        self._stacks.append(stack)
        return self

    def __exit__(self, *exc) -> bool:
        return self._stacks.pop().__exit__(*exc)
