"""What a data kind provides: a registry entry (``DataKind``) that builds a train and a validation
split, and the split itself (``DataSplit``), which owns everything the trainer reads from it.

The trainer never asks what type a split is. It calls ``build_splits`` (the registry) once, then
only the split's own methods: ``check_token_ids`` before the model is built, ``batcher`` for the
train batches, ``validation_batches`` for evaluation. A split's train ``Batcher`` carries the
checkpointable position (``state_dict`` / ``load_state_dict`` / ``position_for``).

One-time preparation that writes files happens on rank 0 first, then the other ranks open what it
wrote (a ``barrier`` between): a kind whose build writes a cache (the stdlib corpus, a tokenized HF
dataset) says ``writes_cache`` in its ``DataKind`` and ``build_splits`` orders the ranks; a split
whose batcher writes files (Megatron's sample indices) orders them itself inside ``batcher``,
given the ``barrier``. Without a barrier (one process) each builds directly.

Legend: B = micro batch size, S = sequence length.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from te_npu.training.data.splits import DataSplits

__all__ = ["Batch", "Batcher", "DataSplit", "DataKind", "OPTIONAL_KEYS"]

Batch = tuple[torch.Tensor, torch.Tensor]
"""``(input_ids [B, S], labels [B, S])`` int64; ``labels`` already shifted (Megatron's convention)."""


class Batcher(Protocol):
    """A train split's endless batches for one data-parallel rank, and its position.

    ``state_dict()`` is the same on every rank (plain values, checkpoint-safe);
    ``position_for(state)`` says where ``state`` resumes in this batcher's layout or raises
    ``ValueError`` naming the mismatch; ``load_state_dict`` resumes there. ``consumed_samples``:
    samples consumed by all ranks together. A batcher may also hold ``notes`` (lines to print).
    """

    consumed_samples: int

    def __iter__(self) -> Iterator[Batch]: ...

    def __next__(self) -> Batch: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def position_for(self, state: dict[str, Any]) -> Any: ...


class DataSplit(Protocol):
    """A train or validation split, as a ``DataKind`` builds it (``DataSplits.train`` / ``.val``)."""

    def check_token_ids(self, vocab_size: int, key: str) -> str | None:
        """``ConfigError`` naming ``key`` if the split cannot feed a model of ``vocab_size``
        (read before the model is built); a note (or None) on what was not read ahead."""

    def batcher(self, micro_batch_size: int, seq_len: int, *, seed: int, rank: int = 0, world_size: int = 1,
                shuffle: bool = True, vocab_size: int | None = None, run_samples: int | None = None,
                start_sample: int | None = None, train_samples: int | None = None,
                barrier: Callable[[], None] | None = None) -> Batcher:
        """The train ``Batcher`` of rank ``rank`` of ``world_size`` (every batch checked against
        ``vocab_size``). Megatron's samples only: ``run_samples`` (this run's ``train_steps x``
        global batch), ``start_sample`` (``data.start_sample``), ``train_samples``
        (``data.train_samples``). ``barrier``: when the batcher writes files, rank 0 writes them
        first. ``ValueError`` when the split cannot give one micro batch."""

    def validation_batches(self, micro_batch_size: int, seq_len: int, *, num_batches: int, rank: int = 0,
                           world_size: int = 1, vocab_size: int | None = None,
                           seed: int | None = None) -> Iterator[Batch]:
        """The first ``num_batches`` validation batches of this rank, always the same ones (fewer
        when the split is short, every rank the same count; ``ValueError`` when it has none)."""


@dataclass(frozen=True)
class DataKind:
    """One ``data.kind``: its registry entry (``te_npu.training.data.DATA_KINDS``).

    ``build(data_cfg, vocab_size, progress)`` -> ``DataSplits`` of two ``DataSplit`` objects
    (``vocab_size``: the model's, for checks a build must make first, e.g. a tokenizer's;
    ``progress``: this rank may show a progress bar). ``keys``: the optional ``data.*`` keys (of
    ``OPTIONAL_KEYS``) the kind reads; setting another is an error. ``check(data_cfg)``: its
    config-only rules (``ConfigError``). ``writes_cache``: the build writes files, so in a
    multi-rank run rank 0 builds first and the others then open them.
    """

    build: Callable[[Any, int | None, bool], DataSplits]
    keys: frozenset[str] = frozenset()
    check: Callable[[Any], None] | None = None
    writes_cache: bool = False


OPTIONAL_KEYS = ("path", "val_path", "blend", "val_blend", "split", "tokenizer", "streaming", "start_sample",
                 "train_samples")
"""``data.*`` keys that mean something for some kinds only (None when unset; false for ``streaming``)."""
