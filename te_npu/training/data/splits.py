"""A run's train / validation data, and Megatron's ``--split`` of one dataset into train, valid, test.

``DataSplits`` is what every ``data.kind`` builds (``te_npu.training.data.DATA_KINDS``).
``data.split`` is Megatron's string (``"969,30,1"``: weights of train, valid, test, normalised;
``blended_megatron_dataset_config.parse_and_normalize_split``), applied to a dataset's documents
as Megatron's builder applies it (``split_range``: ``int(round(cumulative_fraction * count))``
bookends). The test share is held out and never read: the trainer evaluates on ``valid``.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from te_npu.errors import ConfigError
from te_npu.training.data.blend import normalize_weights

__all__ = ["DataSplits", "DEFAULT_SPLIT", "TRAIN", "VALID", "TEST", "parse_split", "split_range"]

DEFAULT_SPLIT = "969,30,1"
"""Megatron's long-standing ``--split`` default, used when no validation data is named."""
TRAIN, VALID, TEST = 0, 1, 2


@dataclass(frozen=True)
class DataSplits:
    """A run's data: ``train`` / ``val`` (each a ``DataSplit``, ``te_npu.training.data.kind``: a
    ``TokenDataset``, ``TokenBlend``, ``MegatronSplit`` or ``HFStream`` today) and the config keys
    that name them in errors (``data.path``, ``data.split``, ...)."""

    train: Any
    val: Any
    train_key: str
    val_key: str


def parse_split(text: str, key: str) -> tuple[float, float, float]:
    """Megatron's ``--split`` (``"969,30,1"``, ``"99,1"``, ``"98/2"``, ``"90;5;5"``, ``"9:1"``:
    Megatron reads the numbers, so ``,`` ``/`` ``;`` ``:`` and spaces all separate; missing parts
    are 0) -> normalised (train, valid, test) fractions. ``ConfigError`` if a part is negative or
    not a number, all are 0, or there are more than three."""
    parts = [p for p in re.split(r"[,/;:\s]+", str(text).strip()) if p]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(f"{key}: {text!r} is not comma-separated train,valid,test weights (e.g. '969,30,1')") \
            from None
    if len(values) > 3 or any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise ConfigError(f"{key}: {text!r} must be up to three weights >= 0 (train, valid, test), not all 0")
    values += [0.0] * (3 - len(values))
    return tuple(normalize_weights(values))  # type: ignore[return-value]


def split_range(fractions: Sequence[float], count: int, which: int) -> tuple[int, int]:
    """Items ``[begin, end)`` of split ``which`` (0 train, 1 valid, 2 test) out of ``count``:
    Megatron's bookends ``int(round(cumulative_fraction * count))``."""
    edges = np.concatenate(([0.0], np.cumsum(fractions, dtype=np.float64)))
    return int(round(edges[which] * float(count))), int(round(edges[which + 1] * float(count)))
