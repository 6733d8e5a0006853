"""Which tokens a run reads: the registry of data kinds (``DATA_KINDS``) and the package's public names.

A data kind is one module and one registry line. The module builds the ``data`` section into a
train and a validation split (``DataSplits``) and exports its entry, ``KIND = DataKind(build,
keys, check, writes_cache)`` (``kind``); each split it builds is a ``DataSplit`` (``kind``): it
checks its own token ids, makes its own train ``Batcher`` (which holds the checkpointable
position) and yields its own validation batches, and does its one-time preparation (a cache, an
index) rank 0 first. The trainer asks only those methods, so adding a kind touches nothing else.
Today:

- ``stdlib`` (``stdlib_data``): the interpreter's standard-library ``.py`` sources, byte-level
  tokenized (vocab 256), whole files held out for validation, cached in the te_npu token format;
- ``bin`` (``bin_data``): a prepared te_npu token split (``scripts/prepare_data.py``);
- ``megatron`` (``megatron_data``): Megatron-LM indexed datasets read in place, one prefix or a
  blend, served as Megatron's ``GPTDataset`` / ``BlendedDataset`` samples (the ``megatron``
  sub-package: its formats and indices); ``read_global_samples`` reads them without training;
- ``hf`` (``hf_data``): a local Hugging Face dataset tokenized once into a cached Megatron
  indexed dataset, or tokenized as it is read (``streaming: true``, ``hf_stream``).

The split types: ``TokenDataset`` (``token_dataset``, sampled by ``sampling.TokenBatcher``),
``TokenBlend`` (``blend``), ``MegatronSplit`` (``megatron.gpt_samples``), ``HFStream`` (``hf_stream``).
``make_batcher`` / ``validation_batches`` / ``check_token_ids`` are the split's own methods
called as functions. None of this package imports anything else of ``te_npu.training``.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from te_npu.errors import ConfigError
from te_npu.training.data import bin_data, hf_data, megatron_data, stdlib_data
from te_npu.training.data.kind import OPTIONAL_KEYS, Batcher, DataKind, DataSplit
from te_npu.training.data.megatron_data import read_global_samples
from te_npu.training.data.sampling import TokenBatcher, make_batcher, validation_batches
from te_npu.training.data.splits import DataSplits
from te_npu.training.data.stdlib_data import (
    BYTE_EOS_ID,
    BYTE_VOCAB_SIZE,
    build_stdlib_corpus,
    split_by_file,
    stdlib_sources,
    tokenize_files,
)
from te_npu.training.data.token_dataset import (
    SCAN_LIMIT_BYTES,
    TokenDataset,
    byte_tokenize,
    split_paths,
    write_token_file,
)

__all__ = [
    "DataKind",
    "DataSplit",
    "Batcher",
    "DataSplits",
    "DATA_KINDS",
    "OPTIONAL_KEYS",
    "check_data_config",
    "build_splits",
    "build_datasets",
    "check_token_ids",
    "TokenDataset",
    "TokenBatcher",
    "make_batcher",
    "validation_batches",
    "write_token_file",
    "split_paths",
    "tokenize_files",
    "byte_tokenize",
    "split_by_file",
    "stdlib_sources",
    "build_stdlib_corpus",
    "SCAN_LIMIT_BYTES",
    "BYTE_VOCAB_SIZE",
    "BYTE_EOS_ID",
    "read_global_samples",
]

DATA_KINDS: Mapping[str, DataKind] = MappingProxyType({
    "stdlib": stdlib_data.KIND,
    "bin": bin_data.KIND,
    "megatron": megatron_data.KIND,
    "hf": hf_data.KIND,
})
"""``data.kind`` -> its entry (``DataKind``): what it reads and how it builds its splits."""


def check_data_config(d: Any) -> None:
    """The ``data`` section's rules (``DataConfig.__post_init__`` runs them): a registered kind, no
    key another kind reads, the kind's own rules. ``ConfigError`` naming the key."""
    kind = DATA_KINDS.get(d.kind)
    if kind is None:
        raise ConfigError(f"data.kind: {d.kind!r} is not supported; allowed values are {list(DATA_KINDS)}")
    for key in OPTIONAL_KEYS:
        if getattr(d, key) not in (None, False) and key not in kind.keys:
            users = [name for name, k in DATA_KINDS.items() if key in k.keys]
            raise ConfigError(f"data.{key}: only used with data.kind {' / '.join(map(repr, users))} "
                              f"(data.kind is {d.kind!r})")
    if kind.check is not None:
        kind.check(d)


def build_splits(d: Any, vocab_size: int | None = None, *, progress: bool = False, rank: int = 0,
                 barrier: Callable[[], None] | None = None) -> DataSplits:
    """``DataConfig`` -> its ``DataSplits`` (caches built on first use). ``ConfigError`` for bad input.

    ``barrier`` (a multi-rank run; ``rank`` is this process's): a kind that ``writes_cache``
    builds on rank 0 first, with a progress bar, and the other ranks open the cache after the
    barrier. Without one every caller builds; concurrent builds are safe anyway (writes are
    atomic and deterministic), only duplicate work.
    """
    kind = DATA_KINDS[d.kind]
    if barrier is None or not kind.writes_cache:
        return kind.build(d, vocab_size, progress)
    splits = kind.build(d, vocab_size, True) if rank == 0 else None  # builds / verifies the cache
    barrier()
    return splits or kind.build(d, vocab_size, False)


def build_datasets(d: Any) -> tuple[DataSplit, DataSplit]:
    """``(train, val)`` of ``build_splits(d)``."""
    splits = build_splits(d)
    return splits.train, splits.val


def check_token_ids(data: DataSplit, vocab_size: int, key: str) -> str | None:
    """``data.check_token_ids(vocab_size, key)``: ``ConfigError`` (naming ``key``, or each part's
    key) if ``data`` cannot feed a model of ``vocab_size``; a note when only part was read."""
    return data.check_token_ids(vocab_size, key)

