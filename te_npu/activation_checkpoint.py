"""``te_npu.checkpoint``: activation recompute that replays the te_npu autocast state.

Transformer Engine's ``te.checkpoint`` (``transformer_engine.pytorch.distributed.checkpoint``)
captures the FP8 autocast state at the checkpointed call and re-enters it when backward
recomputes the forward. This is the same over ``torch.utils.checkpoint.checkpoint``, in both
of its modes, so the replayed forward computes in the recipe it used, whatever the module ran
since, and saves bitwise the same operands:

- ``use_reentrant=False`` (te_npu's default): the recompute context (``context_fn``) enters the
  autocast state of the call;
- ``use_reentrant=True`` (TE's default): the checkpointed function is wrapped so that its
  replay (every call after the first) runs inside that autocast state. TE's extras of its
  reentrant mode are kept: keyword arguments (not tensors that need gradients: the reentrant
  recompute would backpropagate through the outer graph into them) and ``context_fn``.

torch's own autocast and RNG state are replayed by ``torch.utils.checkpoint`` itself.

Also exported as ``te_npu.distributed.checkpoint`` (TE's name, which Megatron calls). Not the
DCP module ``te_npu.distributed.storage.dcp`` (model / optimizer checkpoints), and not
``te_npu.training.recompute`` (which applies this function to chosen layers).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed
import torch.utils.checkpoint
from torch import nn

from te_npu.autocast import autocast, get_autocast_state
from te_npu.compat import in_autograd_backward
from te_npu.errors import ConfigError

__all__ = ["checkpoint", "is_recomputing"]

# TE's te.checkpoint arguments with no counterpart here -> the only accepted value, why
_TE_ONLY_ARGUMENTS = {
    "distribute_saved_activations": (False, "there is no tensor parallelism to distribute saved activations over"),
    "tp_group": (None, "there is no tensor parallelism"),
    "get_rng_state_tracker": (None, "there is no tensor-parallel RNG tracker; torch.utils.checkpoint replays "
                                    "the RNG state"),
}


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` with its activations recomputed in backward (TE's name).

    The te_npu autocast state active now (enabled or not, recipe) is re-entered around the
    recompute, with ``use_reentrant`` False (default) or True (module docstring).
    ``context_fn``, ``preserve_rng_state``, ``determinism_check`` and ``debug`` go to
    ``torch.utils.checkpoint.checkpoint``; a user ``context_fn``'s contexts are entered too (the
    autocast replay innermost). TE's ``distribute_saved_activations`` / ``tp_group`` /
    ``get_rng_state_tracker`` (also in TE's deprecated positional form) accept only their no-op
    values; anything else raises ``ConfigError`` with the reason.
    """
    _refuse_te_positional_form(args)
    for name, (accepted, reason) in _TE_ONLY_ARGUMENTS.items():
        value = kwargs.pop(name, accepted)
        if value is not accepted and value != accepted:
            raise ConfigError(f"te_npu.checkpoint: {name}={value!r} is not supported: {reason}")
    use_reentrant = kwargs.pop("use_reentrant", False)
    user_context_fn = kwargs.pop("context_fn", torch.utils.checkpoint.noop_context_fn)
    options = {k: kwargs.pop(k) for k in ("preserve_rng_state", "determinism_check", "debug") if k in kwargs}
    state = get_autocast_state()
    if use_reentrant:
        return _reentrant(function, args, kwargs, user_context_fn, state, options)

    def context_fn():
        user_forward, user_recompute = user_context_fn()
        return user_forward, _both(user_recompute, autocast.replaying(state))

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=context_fn,
                                             **options, **kwargs)


def is_recomputing() -> bool:
    """True when a forward running now is an activation recompute's replay (it runs inside the
    backward pass, on the autograd engine's graph task), in either ``use_reentrant`` mode. Code
    that keeps per-forward state (an MoE router counting its tokens) checks it so that a
    recomputed layer is not counted twice."""
    return in_autograd_backward()


def _reentrant(function, args: tuple, kwargs: dict, user_context_fn, state, options: dict) -> Any:
    """``torch.utils.checkpoint`` with ``use_reentrant=True`` over a wrapper that enters the user's
    forward context on the first call and the recompute context + the autocast replay after."""
    grad_kwargs = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if grad_kwargs:
        raise ConfigError(f"te_npu.checkpoint(use_reentrant=True): keyword tensor argument(s) {grad_kwargs} need "
                          "gradients, which the reentrant recompute cannot give them; pass them positionally, or "
                          "use use_reentrant=False")
    if torch.is_grad_enabled() and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        owner = function if isinstance(function, nn.Module) else getattr(function, "__self__", None)
        if isinstance(owner, nn.Module) and any(p.requires_grad for p in owner.parameters()):
            raise ConfigError(
                f"te_npu.checkpoint(use_reentrant=True): no tensor argument of {type(owner).__name__} requires grad, "
                "so the reentrant checkpoint would drop its parameters' gradients (torch's reentrant limitation); "
                "use use_reentrant=False")
    user_forward, user_recompute = user_context_fn()
    calls = [0]

    def run(*inner_args):
        calls[0] += 1  # the first call is the forward; every later one a recompute
        context = _both(user_recompute, autocast.replaying(state)) if calls[0] > 1 else user_forward
        with context:
            return function(*inner_args, **kwargs)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=True, **options)


def _refuse_te_positional_form(args: tuple) -> None:
    """TE's deprecated ``checkpoint(fn, distribute_saved_activations, get_rng_state_tracker, tp_group,
    *args)``, recognised as TE recognises it (a bool, a callable, then None or a process group),
    is refused with the reason: te_npu has no tensor-parallel RNG tracker."""
    if len(args) > 3 and isinstance(args[0], bool) and callable(args[1]) and (
            args[2] is None or isinstance(args[2], torch.distributed.ProcessGroup)):
        raise ConfigError("te_npu.checkpoint: TE's deprecated positional form (fn, distribute_saved_activations, "
                          f"get_rng_state_tracker, tp_group, *args) with get_rng_state_tracker={args[1]!r} is not "
                          f"supported: {_TE_ONLY_ARGUMENTS['get_rng_state_tracker'][1]}")


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
