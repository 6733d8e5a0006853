"""Stop a dead run: the rules that end training when it has diverged.

``DivergenceGuard.check(step, loss, updated)`` is called once per optimizer step with the loss
averaged over ranks and the step's global skip decision, so every rank reaches the same
verdict at the same step without another collective. It raises ``TrainingDiverged`` when

- ``max_consecutive_skipped_steps`` steps in a row were skipped (non-finite gradients);
- ``stop_on_nonfinite_loss`` and the loss is NaN / Inf (the forward itself broke: the weights
  or the data are bad, and every later step would be skipped too);
- ``loss_spike_factor`` > 0 and the loss exceeds that factor times the median of the last
  ``SPIKE_WINDOW`` finite losses (once that many exist), Megatron's "spiky loss" rule.

The Trainer then saves nothing (no final checkpoint, no pruning of the good ones).
"""
from __future__ import annotations

import math
import statistics
from collections import deque

__all__ = ["DivergenceGuard", "TrainingDiverged", "SPIKE_WINDOW"]

SPIKE_WINDOW = 20
"""Finite losses the spike rule compares against (their median)."""


class TrainingDiverged(RuntimeError):
    """The run met a stop rule; the message names the rule, its config key and the step."""


class DivergenceGuard:
    """Per-run state of the stop rules (see the module doc); 0 / False / 0.0 disable a rule."""

    def __init__(self, *, max_consecutive_skipped_steps: int, stop_on_nonfinite_loss: bool, loss_spike_factor: float):
        self.max_skipped = max_consecutive_skipped_steps
        self.stop_on_nonfinite = stop_on_nonfinite_loss
        self.spike_factor = loss_spike_factor
        self.skipped_in_a_row = 0
        self._recent: deque[float] = deque(maxlen=SPIKE_WINDOW)

    def check(self, step: int, loss: float, updated: bool) -> None:
        """Record step ``step`` (1-based) and raise ``TrainingDiverged`` if a rule fires."""
        self.skipped_in_a_row = 0 if updated else self.skipped_in_a_row + 1
        if self.max_skipped and self.skipped_in_a_row >= self.max_skipped:
            raise TrainingDiverged(
                f"iteration {step}: {self.skipped_in_a_row} consecutive steps skipped for non-finite gradients "
                f"(training.max_consecutive_skipped_steps={self.max_skipped})"
            )
        if not math.isfinite(loss):
            if self.stop_on_nonfinite:
                raise TrainingDiverged(f"iteration {step}: training loss is {loss} (training.stop_on_nonfinite_loss)")
            return
        if self.spike_factor and len(self._recent) == SPIKE_WINDOW:
            reference = statistics.median(self._recent)
            if reference > 0 and loss > self.spike_factor * reference:
                raise TrainingDiverged(
                    f"iteration {step}: loss {loss:.4g} is {loss / reference:.1f}x the median {reference:.4g} of the "
                    f"previous {SPIKE_WINDOW} steps (training.loss_spike_factor={self.spike_factor})"
                )
        self._recent.append(loss)
