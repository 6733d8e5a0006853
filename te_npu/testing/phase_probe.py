"""``PhaseProbe``: an ``STProbe`` that also knows the trainer phase of every GEMM and quantization.

``attach(trainer)`` wraps the trainer's ``setup`` / ``forward_backward`` / ``optimizer_step``
*instance attributes* (read-only spies) to tag each event with the phase it happened in, so "no
weight quantization during forward/backward" is checkable while ``train_step`` drives the step
(setup's initial weight quantization is tagged ``setup``), and counts micro-steps per optimizer
step. Used by the acceptance system tests and the acceptance run (``te_npu.testing.acceptance``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from te_npu.events import GemmEvent, QuantEvent
from te_npu.testing.probe import STProbe

__all__ = ["PhaseProbe"]


@dataclass
class PhaseProbe(STProbe):
    """``STProbe`` plus the phase (``setup`` / ``forward_backward`` / ``optimizer_step`` / ``other``)
    of every GEMM and quantization event, and the number of micro-steps per optimizer step."""

    phase: str = "other"
    gemm_phases: list[str] = field(default_factory=list)
    quant_phases: list[str] = field(default_factory=list)
    micro_steps: Counter = field(default_factory=Counter)

    def __call__(self, event: object) -> None:
        super().__call__(event)
        if isinstance(event, GemmEvent):
            self.gemm_phases.append(self.phase)
        elif isinstance(event, QuantEvent):
            self.quant_phases.append(self.phase)

    def attach(self, trainer) -> None:
        """Tag ``trainer``'s setup and two step pieces; once set up, record its model's module types
        (the trainer has this probe among its subscribers)."""
        if self not in trainer.subscribers:
            raise ValueError("PhaseProbe.attach: pass the probe to Trainer(..., subscribers=[probe]) first")
        setup, forward_backward, optimizer_step = trainer.setup, trainer.forward_backward, trainer.optimizer_step

        def tagged(phase, fn, count=False):
            def call(*args, **kwargs):
                if count:
                    self.micro_steps[self.current_step] += 1
                self.phase = phase
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.phase = "other"

            return call

        def setup_and_record(cfg):
            result = tagged("setup", setup)(cfg)
            self.on_setup(trainer.model, trainer.task.low_precision_scope(trainer.model))
            return result

        trainer.setup = setup_and_record
        trainer.forward_backward = tagged("forward_backward", forward_backward, count=True)
        trainer.optimizer_step = tagged("optimizer_step", optimizer_step)

    def quant_events_in(self, phase: str, step: int | None = None) -> list[QuantEvent]:
        return [e for (s, e), p in zip(self.quant_events, self.quant_phases) if p == phase and (step is None or s == step)]

    def gemm_events_in(self, phase: str) -> list[GemmEvent]:
        return [e for (_, e), p in zip(self.gemm_events, self.gemm_phases) if p == phase]
