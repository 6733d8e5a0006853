"""Full activation recompute of chosen layers with ``te_npu.checkpoint`` (non-reentrant
``torch.utils.checkpoint`` that replays the te_npu autocast state of each call).

Applied after FSDP2 (``Trainer.setup``'s build order): only the layer's ``forward`` is wrapped, so module
FQNs, state-dict keys and FSDP hooks stay as they are. TE weights are not re-quantized by the
replayed forward (their quantized storage is reused) and the optimizer never sees recompute.
"""
from __future__ import annotations

import functools

from torch import nn

from te_npu.activation_checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing"]


def apply_activation_checkpointing(model: nn.Module, layer_types: tuple[type[nn.Module], ...]) -> list[str]:
    """Recompute every ``layer_types`` module's forward in backward; returns their FQNs."""
    wrapped = []
    for name, module in model.named_modules():
        if isinstance(module, layer_types) and not getattr(module, "_te_npu_recompute", False):
            module.forward = functools.partial(checkpoint, module.forward)
            module._te_npu_recompute = True
            wrapped.append(name)
    if not wrapped:
        raise ValueError(f"activation_checkpoint.mode: full found no {[t.__name__ for t in layer_types]} module to wrap")
    return wrapped
