"""Stop a dead run: the rules that end training when it has diverged.

``DivergenceGuard.check(step, loss, updated, grad_norm)`` is called once per optimizer step with
the loss averaged over ranks, the step's global skip decision and its global grad norm, so every
rank reaches the same verdict at the same step without another collective. It raises
``TrainingDiverged`` when

- ``max_consecutive_skipped_steps`` steps in a row were skipped (non-finite gradients);
- ``stop_on_nonfinite_loss`` and the loss is NaN / Inf (the forward itself broke: the weights
  or the data are bad, and every later step would be skipped too);
- ``max_loss_factor`` > 0 and the loss exceeds that factor times ``ln(vocab_size)`` -- the loss of
  a model that predicts uniformly -- from the first step on (a run whose step-2 loss is 2e6 is
  dead; the spike rule below would wait for 20 losses);
- ``collapse_steps`` > 0 and that many steps in a row look collapsed: a grad norm of (almost)
  zero, or a loss flat at ``ln(vocab_size)`` (uniform logits give exactly that loss on every
  batch, so two equal losses there are not noise);
- ``loss_spike_factor`` > 0 and the loss exceeds that factor times the median of the last
  ``SPIKE_WINDOW`` finite losses (once that many exist), Megatron's "spiky loss" rule.

When a divergence began: the loss of step ``s`` is computed with the weights after step
``s - 1``, so a bad loss at ``s`` condemns the weights saved at step ``s - 1`` and later.
``TrainingDiverged.began_at`` is the first bad step (the first of the streak for the streak
rules); ``suspect`` says a streak is open, during which the Trainer saves nothing and prunes
nothing, and a checkpoint of step ``began_at - 1`` or later is not kept as good. The Trainer
then saves nothing on the way out (no final checkpoint, no pruning of the good ones).
"""
from __future__ import annotations

import math
import statistics
from collections import deque

__all__ = ["DivergenceGuard", "TrainingDiverged", "SPIKE_WINDOW", "COLLAPSED_GRAD_NORM", "FLAT_LOSS_RTOL"]

SPIKE_WINDOW = 20
"""Finite losses the spike rule compares against (their median)."""
COLLAPSED_GRAD_NORM = 1e-6
"""A global grad norm at or below this is no learning signal (a healthy model's is ~0.1-10)."""
FLAT_LOSS_RTOL = 1e-5
"""Two losses within this relative distance of ``ln(vocab)`` and of each other are "flat there"."""


class TrainingDiverged(RuntimeError):
    """The run met a stop rule; the message names the rule, its config key and the step.
    ``began_at``: the first step whose loss was bad (None when unknown)."""

    def __init__(self, message: str, began_at: int | None = None) -> None:
        super().__init__(message)
        self.began_at = began_at


class DivergenceGuard:
    """Per-run state of the stop rules (see the module doc); 0 / False / 0.0 disable a rule.
    ``vocab_size``: needed by ``max_loss_factor`` and the flat-loss half of ``collapse_steps``."""

    def __init__(self, *, max_consecutive_skipped_steps: int, stop_on_nonfinite_loss: bool, loss_spike_factor: float,
                 max_loss_factor: float = 0.0, collapse_steps: int = 0, vocab_size: int | None = None):
        self.max_skipped = max_consecutive_skipped_steps
        self.stop_on_nonfinite = stop_on_nonfinite_loss
        self.spike_factor = loss_spike_factor
        self.max_loss_factor = max_loss_factor
        self.collapse_steps = collapse_steps
        self.uniform_loss = math.log(vocab_size) if vocab_size and vocab_size > 1 else None
        self.skipped_in_a_row = 0
        self.collapsed_in_a_row = 0
        self._recent: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self._previous_loss: float | None = None

    @property
    def suspect(self) -> bool:
        """A streak rule is counting: the current weights may already be dead."""
        return self.skipped_in_a_row > 0 or self.collapsed_in_a_row > 0

    def check(self, step: int, loss: float, updated: bool, grad_norm: float | None = None) -> None:
        """Record step ``step`` (1-based) and raise ``TrainingDiverged`` if a rule fires."""
        self.skipped_in_a_row = 0 if updated else self.skipped_in_a_row + 1
        collapsed = self._looks_collapsed(loss, grad_norm)
        self.collapsed_in_a_row = self.collapsed_in_a_row + 1 if collapsed else 0
        self._previous_loss = loss
        if self.max_skipped and self.skipped_in_a_row >= self.max_skipped:
            raise TrainingDiverged(
                f"iteration {step}: {self.skipped_in_a_row} consecutive steps skipped for non-finite gradients "
                f"(training.max_consecutive_skipped_steps={self.max_skipped})", step - self.skipped_in_a_row + 1)
        if self.collapse_steps and self.collapsed_in_a_row >= self.collapse_steps:
            raise TrainingDiverged(
                f"iteration {step}: the model has collapsed for {self.collapsed_in_a_row} steps in a row (grad norm "
                f"{_fmt(grad_norm)}, loss {loss:.6g}; ln(vocab) = {_fmt(self.uniform_loss)}: no learning signal) "
                f"(training.collapse_steps={self.collapse_steps})", step - self.collapsed_in_a_row + 1)
        if not math.isfinite(loss):
            if self.stop_on_nonfinite:
                raise TrainingDiverged(f"iteration {step}: training loss is {loss} (training.stop_on_nonfinite_loss)",
                                       step)
            return
        if self.max_loss_factor and self.uniform_loss is not None and loss > self.max_loss_factor * self.uniform_loss:
            raise TrainingDiverged(
                f"iteration {step}: loss {loss:.4g} is above {self.max_loss_factor:g} x ln(vocab) = "
                f"{self.max_loss_factor * self.uniform_loss:.4g} (a uniform prediction scores {self.uniform_loss:.4g}) "
                f"(training.max_loss_factor={self.max_loss_factor:g})", step)
        if self.spike_factor and len(self._recent) == SPIKE_WINDOW:
            reference = statistics.median(self._recent)
            if reference > 0 and loss > self.spike_factor * reference:
                raise TrainingDiverged(
                    f"iteration {step}: loss {loss:.4g} is {loss / reference:.1f}x the median {reference:.4g} of the "
                    f"previous {SPIKE_WINDOW} steps (training.loss_spike_factor={self.spike_factor})", step)
        self._recent.append(loss)

    def _looks_collapsed(self, loss: float, grad_norm: float | None) -> bool:
        if grad_norm is not None and math.isfinite(grad_norm) and grad_norm <= COLLAPSED_GRAD_NORM:
            return True
        u, previous = self.uniform_loss, self._previous_loss
        if u is None or previous is None or not math.isfinite(loss):
            return False
        return abs(loss - u) <= FLAT_LOSS_RTOL * u and abs(loss - previous) <= FLAT_LOSS_RTOL * u


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"
