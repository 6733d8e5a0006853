"""``data.kind: bin``: a prepared te_npu token split (``scripts/prepare_data.py``), read in place.

    data: {kind: bin, path: /data/corpus_train}                               # validation: its tail
    data: {kind: bin, path: /data/corpus_train, val_path: /data/corpus_val}   # or a split of its own

``path`` is the prefix of ``<path>.bin`` + ``<path>.json`` (``token_dataset``); validation is
``val_path`` if given, else the last ``val_fraction`` of the tokens. The splits are
``TokenDataset`` objects; nothing is written.
"""
from __future__ import annotations

from typing import Any

from te_npu.errors import ConfigError
from te_npu.training.data.kind import DataKind
from te_npu.training.data.splits import DataSplits
from te_npu.training.data.token_dataset import FORMAT_NAME, TokenDataset

__all__ = ["KIND", "KEYS", "check_config", "build_bin"]

KEYS = frozenset({"path", "val_path"})
"""The optional ``data.*`` keys this kind reads."""


def build_bin(d: Any, vocab_size: int | None, progress: bool) -> DataSplits:
    """The ``data`` section -> train / validation ``TokenDataset`` (``ConfigError`` for an unreadable split)."""
    dataset = _open_token_file(d.path, "data.path")
    if d.val_path is not None:
        return DataSplits(dataset, _open_token_file(d.val_path, "data.val_path"), "data.path", "data.val_path")
    cut = len(dataset) - int(round(len(dataset) * d.val_fraction))
    return DataSplits(dataset.slice(0, cut), dataset.slice(cut, len(dataset)), "data.path", "data.path")


def check_config(d: Any) -> None:
    """Config-only rule: ``path`` given."""
    if d.path is None:
        raise ConfigError("data.path: required when data.kind is 'bin' (prefix of a prepared .bin/.json pair)")


def _open_token_file(prefix: str, key: str) -> TokenDataset:
    try:
        return TokenDataset(prefix)
    except FileNotFoundError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    except (ValueError, KeyError, OSError) as exc:
        raise ConfigError(f"{key}: {prefix!r} is not a readable {FORMAT_NAME} split: {exc}") from None


KIND = DataKind(build_bin, KEYS, check_config)
"""The registry entry (``te_npu.training.data.DATA_KINDS["bin"]``)."""
