"""STProbe (spec section 16.6): a read-only recorder of what a training run actually did.

It subscribes to events the production code already emits -- low-precision GEMMs and
quantizations (``te_npu.ops.observe``), FSDP all-gathers of quantized weights
(``te_npu.distributed.record_gathers``) and weight refreshes (the optimizer's refresh hook) --
and records module types. It never quantizes, gathers, refreshes or replaces anything.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from te_npu.ops.observe import GemmEvent, QuantEvent

__all__ = ["STProbe"]


@dataclass
class STProbe:
    """Events of one rank, grouped by optimizer step (``begin_optimizer_step`` sets the step)."""

    module_types: dict[str, str] = field(default_factory=dict)
    low_precision_modules: dict[str, str] = field(default_factory=dict)
    gemm_events: list[tuple[int, GemmEvent]] = field(default_factory=list)
    quant_events: list[tuple[int, QuantEvent]] = field(default_factory=list)
    gather_records: list[tuple[int, Any]] = field(default_factory=list)
    refreshes: dict[int, Counter] = field(default_factory=lambda: defaultdict(Counter))
    step_updated: dict[int, bool] = field(default_factory=dict)
    current_step: int = -1

    # ---- callbacks (the trainer wires these; they only append) -------------------------------
    def on_setup(self, model, low_precision_scope: list[str]) -> None:
        """Record every module's type and which FQNs are TE (8-bit) modules."""
        self.module_types = {name: type(m).__name__ for name, m in model.named_modules()}
        self.low_precision_modules = {name: self.module_types[name] for name in low_precision_scope}

    def on_ops_event(self, event: object) -> None:
        if isinstance(event, GemmEvent):
            self.gemm_events.append((self.current_step, event))
        elif isinstance(event, QuantEvent):
            self.quant_events.append((self.current_step, event))

    def on_gather(self, record: Any) -> None:
        self.gather_records.append((self.current_step, record))

    def on_refresh(self, fqn: str) -> None:
        self.refreshes[self.current_step][fqn] += 1

    def begin_optimizer_step(self, step: int) -> None:
        self.current_step = step

    def end_optimizer_step(self, *, updated: bool) -> None:
        self.step_updated[self.current_step] = updated

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

    def gathers(self, step: int | None = None) -> list[Any]:
        return [r for s, r in self.gather_records if step is None or s == step]
