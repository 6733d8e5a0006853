"""``quantize_weights_``: turn the high-precision weights of TE modules into quantized weights."""
from __future__ import annotations

from torch import nn

from te_npu.modules.base import TEModule
from te_npu.recipe import Recipe

__all__ = ["quantize_weights_"]


def quantize_weights_(module: nn.Module, recipe: Recipe) -> nn.Module:
    """Replace the GEMM weights of every TE module in ``module`` (itself included) by
    ``MXFP8Tensor`` / ``HiF8Tensor`` parameters of ``recipe``, in place; returns ``module``.

    Equivalent to having built the modules under ``te_npu.quantized_model_init(recipe=...)``.
    The weights become new ``nn.Parameter`` objects (same names, shapes, logical dtype and
    ``requires_grad``): build optimizers / FSDP wrappers afterwards. Non-TE parameters (norms,
    embeddings, router) are untouched. Forward never re-quantizes these weights; they are
    refreshed from an FP32 master after each optimizer step (``te_npu.distributed.optim``).
    A meta-built module gets meta quantized weights without values (for sharding before
    allocation; ``MasterWeightOptimizer`` writes them from the masters). A weight already
    quantized by ``recipe`` is kept; one of the other MXFP8 scale rule is re-quantized from its
    preserved high-precision value while that still reproduces it. Raises ``ValueError`` for a
    weight quantized in another format, or of the other rule without such a value.
    """
    for submodule in module.modules():
        if isinstance(submodule, TEModule):
            submodule._quantize_weights_(recipe)
    return module
