"""A stand-in for TensorBoard's ``SummaryWriter`` (the ``tensorboard`` package is optional and not
installed for the tests): it records every scalar a ``MetricsLogger`` writes."""
from __future__ import annotations


class RecordingWriter:
    """``scalars[(tag, step)] = value`` for every ``add_scalar``; nothing is buffered, so
    ``flush`` and ``close`` have nothing to do."""

    def __init__(self) -> None:
        self.scalars: dict[tuple[str, int], float] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars[(tag, step)] = value

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None
