"""What a ``TrainTask`` and the Trainer hand each other inside one optimizer step.

Three seams, all optional for a task (a task whose ``loss`` returns a plain scalar and that
defines no ``step_end`` trains exactly as before):

- ``LossParts``: what ``TrainTask.loss`` may return for one micro-batch instead of a scalar:
  ``total`` (what is backpropagated), ``lm_loss`` (the language-model loss: the step line's
  ``lm loss``, ``metrics.jsonl``'s ``lm_loss``, validation and the divergence rules read it
  alone, so it stays comparable with runs of other methods) and named ``extras`` (scalars
  reported beside it, e.g. a balance loss or a multi-token-prediction loss). The Trainer
  averages every part over the step's micro-batches and over ranks in the step's one loss
  all-reduce.
- ``StepEnd`` / ``StepReport``: ``TrainTask.step_end(model, StepEnd) -> StepReport | None`` is
  called once per optimizer step, after every micro-batch and after the optimizer step
  (whether it updated the weights or skipped them: ``StepEnd.updated`` says, so the task
  decides what a skipped step means for its own state). ``StepEnd.all_reduce_sum`` sums a
  tensor over every data-parallel rank (the whole world: FSDP and HSDP) on the collective
  backend's device; one call per step is the intended use. The report's ``metrics`` (name ->
  float) go to ``metrics.jsonl`` and TensorBoard, its ``summary`` to the end of the step line,
  its ``warnings`` to lines of their own (rank 0).
- ``TrainTask.step_begin(model, step)``: called before each optimizer step's micro-batches with
  the step's 1-based number (a resumed run's first step included), for a schedule the task's loss
  follows (e.g. DeepSeek-V3's MTP loss weight).

Units: losses are FP32 scalars (nats per token); metrics are plain floats.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

__all__ = ["LossParts", "StepEnd", "StepReport", "as_loss_parts"]


@dataclass(frozen=True)
class LossParts:
    """One micro-batch's losses: ``total`` (backpropagated), ``lm_loss`` (reported as ``lm loss``)
    and named ``extras`` (reported beside it). Scalars; ``total`` carries the graph."""

    total: torch.Tensor
    lm_loss: torch.Tensor
    extras: Mapping[str, torch.Tensor] = field(default_factory=lambda: MappingProxyType({}))

    def detached(self) -> LossParts:
        """The same values without the autograd graph (FP32)."""
        return LossParts(self.total.detach().float(), self.lm_loss.detach().float(),
                         MappingProxyType({k: v.detach().float() for k, v in self.extras.items()}))


def as_loss_parts(loss: torch.Tensor | LossParts) -> LossParts:
    """A task's ``loss`` result as ``LossParts`` (a plain scalar is its own ``lm_loss``)."""
    return loss if isinstance(loss, LossParts) else LossParts(loss, loss)


@dataclass(frozen=True)
class StepEnd:
    """The once-per-step hook's context.

    ``step``: the 1-based number of the step that just ended; ``updated``: False when the
    optimizer skipped it (non-finite gradients); ``all_reduce_sum(t)``: ``t`` summed over every
    data-parallel rank (a new tensor on ``t``'s device; ``t`` itself on one rank).
    """

    step: int
    updated: bool
    world_size: int
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StepReport:
    """What ``step_end`` reports: ``metrics`` (name -> float; ``metrics.jsonl`` and TensorBoard on
    logged steps), ``summary`` (a short text for the step line), ``warnings`` (one line each)."""

    metrics: dict[str, float] = field(default_factory=dict)
    summary: str | None = None
    warnings: tuple[str, ...] = ()
