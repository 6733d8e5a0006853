"""STProbe: the system tests' read-only recorder of what a training run actually did (the
acceptance rules, docs/a5.md, acceptance matrix, read what it recorded).

A ``te_npu.events`` subscriber: pass it to the trainer (``Trainer(task, subscribers=[probe])``)
or subscribe it yourself (``with events.subscribe(probe): ...``). It files every event under
the optimizer step it happened in -- the trainer's ``StepBeginEvent`` starts a step, the
optimizer's ``OptimizerStepEvent`` says whether it updated -- and records module types when
told the model (``on_setup``). It never quantizes, gathers, refreshes or replaces anything.
Events before the first step (setup, a checkpoint load) are filed under step -1, or under
whatever ``begin_optimizer_step`` set.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from te_npu.events import (
    DequantizeFallbackEvent,
    FSDPGatherEvent,
    GemmEvent,
    OptimizerStepEvent,
    QuantEvent,
    StepBeginEvent,
    WeightRefreshEvent,
)

__all__ = ["STProbe"]


@dataclass
class STProbe:
    """Events of one rank, grouped by optimizer step."""

    module_types: dict[str, str] = field(default_factory=dict)
    low_precision_modules: dict[str, str] = field(default_factory=dict)
    gemm_events: list[tuple[int, GemmEvent]] = field(default_factory=list)
    quant_events: list[tuple[int, QuantEvent]] = field(default_factory=list)
    gather_records: list[tuple[int, FSDPGatherEvent]] = field(default_factory=list)
    refreshes: dict[int, Counter] = field(default_factory=lambda: defaultdict(Counter))
    step_updated: dict[int, bool] = field(default_factory=dict)
    dequantize_fallbacks: list[tuple[int, DequantizeFallbackEvent]] = field(default_factory=list)
    current_step: int = -1

    # ---- recording (only appends) ------------------------------------------------------------
    def __call__(self, event: object) -> None:
        """The ``te_npu.events`` callback."""
        if isinstance(event, GemmEvent):
            self.gemm_events.append((self.current_step, event))
        elif isinstance(event, QuantEvent):
            self.quant_events.append((self.current_step, event))
        elif isinstance(event, FSDPGatherEvent):
            self.gather_records.append((self.current_step, event))
        elif isinstance(event, WeightRefreshEvent):
            self.refreshes[self.current_step][event.fqn] += 1
        elif isinstance(event, StepBeginEvent):
            self.begin_optimizer_step(event.step)
        elif isinstance(event, OptimizerStepEvent):
            self.step_updated[self.current_step] = event.updated
        elif isinstance(event, DequantizeFallbackEvent):
            self.dequantize_fallbacks.append((self.current_step, event))

    def on_setup(self, model, low_precision_scope: list[str]) -> None:
        """Record every module's type and which FQNs are TE (8-bit) modules."""
        self.module_types = {name: type(m).__name__ for name, m in model.named_modules()}
        self.low_precision_modules = {name: self.module_types[name] for name in low_precision_scope}

    def begin_optimizer_step(self, step: int) -> None:
        """File the following events under ``step`` (the trainer's ``StepBeginEvent`` does this)."""
        self.current_step = step

    # ---- queries -----------------------------------------------------------------------------
    def gemms(self, step: int | None = None) -> list[GemmEvent]:
        """GEMM events (of one step, or all)."""
        return [e for s, e in self.gemm_events if step is None or s == step]

    def executed_kernel_roles(self) -> set[tuple[str, str]]:
        """``{(kind, gemm)}``, e.g. ``("grouped", "wgrad")``."""
        return {(e.kind, e.gemm) for _, e in self.gemm_events}

    def kernel_formats(self) -> set[str]:
        return {e.format for _, e in self.gemm_events}

    def gemm_counts(self, step: int) -> Counter:
        """``Counter[(kind, gemm)]`` of one step."""
        return Counter((e.kind, e.gemm) for e in self.gemms(step))

    def hif8_quant_events(self) -> list[QuantEvent]:
        return [e for _, e in self.quant_events if e.format == "hif8"]

    def refresh_counts(self, step: int) -> Counter:
        """``Counter[fqn]`` of weight refreshes during ``step``."""
        return self.refreshes.get(step, Counter())

    def gathers(self, step: int | None = None) -> list[FSDPGatherEvent]:
        return [r for s, r in self.gather_records if step is None or s == step]
