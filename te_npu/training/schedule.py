"""Learning-rate schedule: linear warmup, then cosine / linear decay to ``min_lr`` (or constant)."""
from __future__ import annotations

import math

__all__ = ["lr_at"]


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    Warmup: ``lr * (step + 1) / warmup_steps`` for the first ``warmup_steps`` steps. Then
    ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * t)) / 2`` with ``t`` going 0 -> 1
    over the remaining steps; ``linear``: straight from ``lr`` to ``min_lr``; ``constant``: ``lr``.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    decay_steps = max(total_steps - warmup_steps - 1, 1)
    t = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
    if schedule == "linear":
        return lr + (min_lr - lr) * t
    raise ValueError(f"training.lr_schedule: unknown schedule {schedule!r}")
