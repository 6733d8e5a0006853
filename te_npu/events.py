"""te_npu's event stream: the one place the library reports what it did.

    from te_npu import events

    gemms = []
    with events.subscribe(gemms.append, events.GemmEvent):
        with te_npu.autocast(recipe=MXFP8BlockRecipe()):
            layer(x).sum().backward()
    # gemms: one GemmEvent per 8-bit GEMM (fprop, dgrad, wgrad), in the order they ran

Every event is a frozen dataclass below; each has exactly one producer:

===========================  ===============================================  =================================================
event                        emitted by                                       when
===========================  ===============================================  =================================================
``QuantEvent``               ``te_npu.ops`` quantize entry points             every quantization call (kernel level)
``OperandEvent``             ``te_npu.functional`` (TE modules' GEMMs)        every 8-bit operand a GEMM asks for: module, role
``GemmEvent``                ``te_npu.ops`` GEMM entry points                 every 8-bit GEMM (fprop / dgrad / wgrad)
``FSDPGatherEvent``          ``te_npu.distributed`` FSDP2 extension           every all-gather of one quantized weight
``WeightRefreshEvent``       ``te_npu.distributed.MasterWeightOptimizer``     each 8-bit weight shard refreshed from its master
``OptimizerStepEvent``       ``te_npu.distributed.MasterWeightOptimizer``     every ``step()``: updated, or skipped
``StepBeginEvent``           ``te_npu.training.trainer.Trainer.train_step``   before each optimizer step's first micro-batch
``DequantizeFallbackEvent``  ``te_npu.tensor`` (quantized weights' dispatch)  an op without a handler ran on dequantized values
===========================  ===============================================  =================================================

Cost. With nobody subscribed a producer pays one truth test of a module-level tuple
(``has_subscribers``) and builds nothing; with subscribers, only events somebody asked for are
built. No event reads a device value on the host: the tensors an event carries (HiF8 amax and
scale, MXFP8 scale codes) are the library's own detached tensors, on their device; a subscriber
that calls ``.item()`` on one makes that host sync itself.

Delivery is synchronous, on the emitting thread (for backward on an accelerator, autograd's
device thread), to every matching subscription in the order they were made; an exception in a
callback propagates into the producer (a broken subscriber is loud, never skipped). The
subscription list is process state, like the autocast stack and ``te_npu.ops.force_backend``:
``subscribe`` / ``close`` are thread-safe, and ``emit`` iterates an immutable snapshot.

This module sits at the bottom of the dependency order: it imports only ``te_npu.formats``.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from te_npu.formats import QuantizationRole

__all__ = [
    "subscribe",
    "emit",
    "has_subscribers",
    "Subscription",
    "QuantEvent",
    "OperandEvent",
    "GemmEvent",
    "FSDPGatherContext",
    "FSDPGatherEvent",
    "WeightRefreshEvent",
    "OptimizerStepEvent",
    "StepBeginEvent",
    "SetupStepEvent",
    "DequantizeFallbackEvent",
]


# ---- low-precision work (te_npu.ops, te_npu.functional) ----------------------------------------


@dataclass(frozen=True)
class QuantEvent:
    """One quantization call (``te_npu.ops``), whoever made it: activations, gradients, weights.

    format: ``Format`` value string; orientation: "row", "col", "dual" (row + col of one call),
    or None when the caller did not say (HiF8 codes are the same for both); shape: source shape;
    backend: "emulation" or "npu"; grouped: blocks restart at group boundaries (ragged col);
    amax / scale: HiF8 only, FP32 ``[]`` or ``[E]`` on the tensor's device (amax None where the
    caller gave the scale without it); format_max: HiF8's target maximum (15.0 input / weight,
    224.0 gradient), None where the caller did not say.
    """

    format: str
    orientation: str | None
    shape: tuple[int, ...]
    backend: str
    grouped: bool = False
    amax: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    format_max: float | None = None


@dataclass(frozen=True)
class OperandEvent:
    """One 8-bit operand of a TE GEMM, as the GEMM that asked for it sees it.

    module: the GEMM's name (the TE module's FQN; ``<fqn>.gate_up_proj`` / ``.down_proj`` for
    SwiGLU experts; ``linear(weight [N, K])`` for a nameless functional call); role: which
    operand (``QuantizationRole``); orientation: "row" / "col", or "both" when one
    HiF8 copy serves both; shape: the source tensor's shape; format: ``Format`` value string;
    scale: the operand's scale, detached, in the backend's layout (HiF8: FP32 ``[]`` / ``[E]``;
    MXFP8: uint8 E8M0 codes); format_max: HiF8's target maximum, None for MXFP8.
    gemm: the GEMM that consumes this copy ("fprop", "dgrad" or "wgrad"; a HiF8 copy that serves
    two GEMMs is reported once per GEMM); operand: the ``te_npu.ops.QuantizedOperand`` itself (its
    codes and scales as the GEMM reads them, ``npu`` layout included); source: the detached
    high-precision tensor it was quantized from (what ``te_npu.observer`` measures it against).
    A weight read from a quantized parameter is not a quantization and emits nothing.
    """

    module: str
    role: QuantizationRole
    orientation: str
    shape: tuple[int, ...]
    format: str
    scale: torch.Tensor
    format_max: float | None = None
    gemm: str | None = None
    operand: object | None = None
    source: torch.Tensor | None = None

    @property
    def amax(self) -> torch.Tensor | None:
        """HiF8: ``scale * format_max``, the amax the current scale ``amax * (1 / format_max)`` came
        from to within two FP32 roundings (finite, non-zero tensors); computed on read (a device
        op, no host sync). None for MXFP8: each block has its own amax, the codes are the statistic."""
        return None if self.format_max is None else self.scale * self.format_max


@dataclass(frozen=True)
class GemmEvent:
    """One 8-bit GEMM call (``te_npu.ops``).

    kind: "dense" or "grouped"; layout: "NT" / "NN" / "TN"; gemm: "fprop" / "dgrad" / "wgrad";
    format: ``Format`` value string; left_shape / right_shape: logical operand shapes;
    left_scale_dtype / right_scale_dtype: uint8 (E8M0 codes) or float32 (HiF8); output_dtype;
    backend: "emulation" or "npu"; num_groups: G for grouped, None for dense.
    """

    kind: str
    layout: str
    gemm: str
    format: str
    left_shape: tuple[int, ...]
    right_shape: tuple[int, ...]
    left_scale_dtype: torch.dtype
    right_scale_dtype: torch.dtype
    output_dtype: torch.dtype
    backend: str
    num_groups: int | None = None


# ---- FSDP2 (te_npu.distributed) ----------------------------------------------------------------


@dataclass(frozen=True)
class FSDPGatherContext:
    """What a format needs to decide which physical tensors one all-gather carries.

    phase: "forward" (forward, forward prefetch) or "backward" (pre-backward unshard, backward
    prefetch, the recompute of full activation checkpointing); reshard_after_forward: the
    parameter's FSDP2 setting; param_fqn: the parameter's name in the model; shard_dim: the dim
    FSDP2 shards it on (0, or 1: ``Shard(1)`` over K).
    """

    phase: Literal["forward", "backward"]
    reshard_after_forward: bool
    param_fqn: str
    shard_dim: int = 0


@dataclass(frozen=True)
class FSDPGatherEvent:
    """One FSDP2 all-gather of one quantized weight (its ``fsdp_pre_all_gather``).

    fields: the inner tensors gathered, in order; local_bytes: bytes this rank sends;
    gathered_bytes: bytes of the unsharded result (local_bytes * world size);
    logical_numel: elements of the full logical weight.
    """

    context: FSDPGatherContext
    format: str
    fields: tuple[str, ...]
    local_bytes: int
    gathered_bytes: int
    logical_numel: int

    @property
    def bytes_per_element(self) -> float:
        """Gathered bytes per logical weight element (BF16 would be 2.0)."""
        return self.gathered_bytes / max(self.logical_numel, 1)


# ---- optimizer and trainer ---------------------------------------------------------------------


@dataclass(frozen=True)
class WeightRefreshEvent:
    """One 8-bit weight shard re-quantized from its FP32 master (after a successful step, or when
    a checkpoint load rebuilds the shards). fqn: the parameter's name."""

    fqn: str


@dataclass(frozen=True)
class OptimizerStepEvent:
    """One ``MasterWeightOptimizer.step``. updated: False for a skipped step (non-finite gradients:
    no master update, no refresh); grad_norm: the global FP32 gradient norm (NaN / Inf when skipped)."""

    updated: bool
    grad_norm: float

    @property
    def skipped(self) -> bool:
        return not self.updated


@dataclass(frozen=True)
class StepBeginEvent:
    """An optimizer step is about to start (``Trainer.train_step``). step: its 0-based index, i.e.
    the number of steps done so far (the log line of this step prints iteration ``step + 1``)."""

    step: int


@dataclass(frozen=True)
class SetupStepEvent:
    """``Trainer.setup`` is starting one of its named steps (``name``, e.g. ``"shard on meta"``,
    ``"initial values"``): what a memory tracker files the bytes of setup under."""

    name: str


# ---- quantized weights (te_npu.tensor) ---------------------------------------------------------


@dataclass(frozen=True)
class DequantizeFallbackEvent:
    """An aten op with no handler of its own ran on a quantized weight's dequantized values
    (Transformer Engine's ``QuantizedTensor`` fallback): correct, but a full-precision copy of the
    weight was made. The training path of TE modules never sends one (the Q3 tests assert zero).

    op: the aten overload (``"aten.cat.default"``); tensor_type: ``"MXFP8Tensor"`` /
    ``"HiF8Tensor"``; shapes: the logical shapes of the quantized arguments dequantized.
    """

    op: str
    tensor_type: str
    shapes: tuple[tuple[int, ...], ...]


# ---- the stream --------------------------------------------------------------------------------


class Subscription:
    """One active ``subscribe``: a context manager, or ``close()`` it (idempotent)."""

    __slots__ = ("callback", "event_types")

    def __init__(self, callback: Callable[[object], None], event_types: tuple[type, ...]) -> None:
        self.callback = callback
        self.event_types = event_types

    def wants(self, event_type: type) -> bool:
        """Whether events of ``event_type`` reach this subscription."""
        return not self.event_types or issubclass(event_type, self.event_types)

    def close(self) -> None:
        """Stop delivering events to the callback."""
        global _SUBSCRIPTIONS
        with _LOCK:
            _SUBSCRIPTIONS = tuple(s for s in _SUBSCRIPTIONS if s is not self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        types = ", ".join(t.__name__ for t in self.event_types) or "all events"
        return f"Subscription({self.callback!r}, {types})"


_LOCK = threading.Lock()
_SUBSCRIPTIONS: tuple[Subscription, ...] = ()


def subscribe(callback: Callable[[object], None], *event_types: type) -> Subscription:
    """Call ``callback(event)`` for every event emitted from now on (only those of ``event_types``
    when given) until the returned subscription is closed; use it as ``with subscribe(...):``.

    Subscriptions nest: an event reaches every matching one, in subscription order.
    """
    if not callable(callback):
        raise TypeError(f"events.subscribe: callback must be callable, got {type(callback).__name__}")
    for event_type in event_types:
        if not isinstance(event_type, type):
            raise TypeError(f"events.subscribe: event types must be classes, got {event_type!r}")
    subscription = Subscription(callback, tuple(event_types))
    global _SUBSCRIPTIONS
    with _LOCK:
        _SUBSCRIPTIONS = (*_SUBSCRIPTIONS, subscription)
    return subscription


def has_subscribers(event_type: type | None = None) -> bool:
    """Whether an event (of ``event_type``, when given) would reach anybody: producers check this
    before building an event, so an unobserved run builds none."""
    subscriptions = _SUBSCRIPTIONS
    if event_type is None or not subscriptions:
        return bool(subscriptions)
    return any(s.wants(event_type) for s in subscriptions)


def emit(event: object) -> None:
    """Deliver ``event`` to every subscription that wants its type (see the module docstring)."""
    for subscription in _SUBSCRIPTIONS:
        if not subscription.event_types or isinstance(event, subscription.event_types):
            subscription.callback(event)
