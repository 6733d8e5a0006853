"""What a quantized weight does with an aten op that has no handler: Transformer Engine's
``QuantizedTensor`` contract (``transformer_engine/pytorch/quantized_tensor.py``).

==================================  ===========================================================
the op                              what happens
==================================  ===========================================================
writes into a quantized argument    ``NotImplementedError`` naming the op and the argument: an
(in-place, ``out=``)                unlisted write would need a silent re-quantization (the
                                    handled updates are ``te_npu.tensor.weight_ops``' table)
returns a view (``t``,              ``NotImplementedError`` at the call, naming the op: 8-bit
``transpose``, ``unsqueeze``,       storage cannot alias a high-precision view (TE raises for
``select``, ``expand``, ...)        views as well); read ``w.dequantize()`` / ``w.float()`` first
anything else (``cat``, ``exp``,    runs on the dequantized values (each quantized argument
``matmul``, ``stack``, ...)         becomes ``dequantize()``) and returns a plain tensor; emits a
                                    ``te_npu.events.DequantizeFallbackEvent``
==================================  ===========================================================

The fallback is correct but makes a full-precision copy of the weight, so the training path of
TE modules never takes it (they read ``select(orientation)``): the Q3 system tests subscribe to
the event and assert that a whole training run sent none.

This file does not import the weight class (``te_npu.tensor.weight`` calls ``fallback`` with
it), so the import order stays one way.
"""
from __future__ import annotations

from typing import Any

from te_npu import events
from te_npu.compat import tree_map

__all__ = ["fallback", "written_arguments", "is_view_op"]


def _bound(func: Any, args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """``(schema argument, value)`` for every argument the call passed."""
    pairs = []
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            pairs.append((arg, args[i]))
        elif arg.name in kwargs:
            pairs.append((arg, kwargs[arg.name]))
    return pairs


def _holds(value: Any, base: type) -> bool:
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, base) for v in value)
    return isinstance(value, base)


def written_arguments(func: Any, args: tuple, kwargs: dict, base: type) -> list[str]:
    """Names of the arguments ``func`` writes (schema ``Tensor(a!)``) that hold a ``base`` tensor."""
    return [arg.name for arg, value in _bound(func, args, kwargs)
            if arg.alias_info is not None and arg.alias_info.is_write and _holds(value, base)]


def is_view_op(func: Any) -> bool:
    """Whether ``func`` returns an alias of an input (a view) without writing it."""
    schema = func._schema
    return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def fallback(base: type, cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func``, which ``cls`` (a subclass of ``base``, the quantized weight class) has no
    handler for, by the rules of this module's table."""
    written = written_arguments(func, args, kwargs, base)
    if written:
        raise NotImplementedError(
            f"{cls.__name__} does not support {func}: it writes into the quantized weight (argument "
            f"{', '.join(written)}), which would re-quantize it silently; compute on w.dequantize() "
            "and copy_ the result back"
        )
    if is_view_op(func):
        raise NotImplementedError(
            f"{cls.__name__} does not support {func}: a view of a quantized weight cannot share its "
            "8-bit storage; take the view of w.dequantize() (or w.float()) instead"
        )
    shapes: list[tuple[int, ...]] = []

    def dequantized(value: Any) -> Any:
        if isinstance(value, base):
            shapes.append(tuple(value.shape))
            return value._values()
        return value

    args, kwargs = tree_map(dequantized, args), tree_map(dequantized, kwargs)
    if events.has_subscribers(events.DequantizeFallbackEvent):
        events.emit(events.DequantizeFallbackEvent(str(func), cls.__name__, tuple(shapes)))
    return func(*args, **kwargs)
