"""The sampler of one token split, ``TokenBatcher`` (epochs of shuffled windows), its fixed
validation batches (``window_validation_batches``), and the two entry points that ask any split
(``te_npu.training.data.kind.DataSplit``) for its own: ``make_batcher`` and ``validation_batches``.
The other splits' samplers live with them: ``BlendBatcher`` (``blend``), ``MegatronBatcher``
(``gpt_samples``), ``StreamBatcher`` (``hf_stream``).

A sample is a window of ``seq_len + 1`` tokens (``TokenDataset.windows``): ``input_ids =
window[:-1]``, ``labels = window[1:]`` (already shifted, Megatron's convention).

Legend: B = micro batch size, S = sequence length, N = number of tokens, W = world size.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["TokenBatcher", "window_validation_batches", "make_batcher", "validation_batches"]


@dataclass
class _Position:
    epoch: int = 0
    batch: int = 0  # batches already served in this epoch


class TokenBatcher:
    """Endless ``(input_ids [B, S], labels [B, S])`` int64 batches for one data-parallel rank.

    Epoch ``e`` orders the ``num_samples`` windows by ``np.random.default_rng([seed, e])``
    (identity when ``shuffle=False``); rank ``r`` takes positions ``r, r + W, r + 2W, ...``
    of that order, so ranks are disjoint and together cover ``W * (num_samples // W)``
    samples per epoch. Batches are consecutive runs of ``B`` in the rank's shard; the
    remainder of an epoch is dropped. ``state_dict()`` is the same on every rank (it holds
    no rank), and ``load_state_dict`` resumes exactly where a continuous run would be.

    Resharding: after ``b`` batches of an epoch, the ranks together have consumed exactly
    the first ``b * B * W`` positions of the epoch's order (rank r holds positions
    ``r + W k``). A state saved with ``(W, B)`` therefore maps exactly onto ``(W', B')``
    when ``b * B * W`` is a multiple of ``B' * W'``: the new ranks continue at that position
    (the next epoch if the new layout's epoch ends before it). Otherwise the position falls
    inside a new micro batch and loading refuses (``ValueError``) instead of repeating or
    skipping samples. ``vocab_size``: every batch is checked against it (``TokenDataset.windows``).
    """

    kind = "windows"

    def __init__(
        self,
        dataset: Any,
        micro_batch_size: int,
        seq_len: int,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        vocab_size: int | None = None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
        self.vocab_size = vocab_size
        self.dataset, self.micro_batch_size, self.seq_len = dataset, micro_batch_size, seq_len
        self.seed, self.rank, self.world_size, self.shuffle = seed, rank, world_size, shuffle
        self.num_samples = dataset.num_samples(seq_len)
        self.batches_per_epoch = self.num_samples // world_size // micro_batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{len(dataset)} tokens give {self.num_samples} samples of seq_len {seq_len}: fewer than one "
                f"micro batch ({micro_batch_size}) per rank for world_size {world_size}"
            )
        self._pos = _Position()
        self._consumed_before = 0  # samples consumed under an earlier (W, B) layout (resharded resume)
        self._shard: tuple[int, np.ndarray] | None = None  # (epoch, this rank's sample ids)

    @property
    def consumed_samples(self) -> int:
        """Samples consumed by all ranks together so far."""
        return self._consumed_before + self._served(self._pos)

    def _served(self, pos: _Position) -> int:
        return (pos.epoch * self.batches_per_epoch + pos.batch) * self.micro_batch_size * self.world_size

    def _rank_shard(self, epoch: int) -> np.ndarray:
        if self._shard is None or self._shard[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            self._shard = (epoch, order[self.rank :: self.world_size][: self.batches_per_epoch * self.micro_batch_size])
        return self._shard[1]

    def __iter__(self) -> TokenBatcher:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        pos, b = self._pos, self.micro_batch_size
        indices = self._rank_shard(pos.epoch)[pos.batch * b : (pos.batch + 1) * b]
        pos.batch += 1
        if pos.batch == self.batches_per_epoch:
            pos.epoch, pos.batch = pos.epoch + 1, 0
        return self.dataset.windows(indices.tolist(), self.seq_len, vocab_size=self.vocab_size)

    def state_dict(self) -> dict[str, Any]:
        """Position plus the fingerprint it is valid for (plain ints/bools: checkpoint-safe)."""
        return {
            "kind": self.kind,
            "epoch": self._pos.epoch,
            "batch_in_epoch": self._pos.batch,
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
            "seq_len": self.seq_len,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position (resharded if its world size / micro batch differ, see the
        class doc); raises ``ValueError`` if the sample order differs or the position does not map."""
        pos = self.position_for(state)
        self._consumed_before = int(state.get("consumed_samples", self._served(pos))) - self._served(pos)
        self._pos = pos

    def position_for(self, state: dict[str, Any]) -> _Position:
        """Where ``state`` resumes in this batcher's layout; ``ValueError`` naming the mismatch."""
        if state.get("kind", self.kind) != self.kind:  # states saved before blends existed have no kind
            raise ValueError("data state mismatch: the checkpoint was saved reading a blend, this run reads one "
                             "dataset (data.path / data.blend changed)")
        for key in ("seed", "seq_len", "num_samples", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"data state mismatch on {key!r}: checkpoint has {state[key]!r}, this run {getattr(self, key)!r} "
                    "(the sample order would differ)"
                )
        saved_bpe = state["num_samples"] // state["world_size"] // state["micro_batch_size"]
        if not 0 <= state["batch_in_epoch"] < saved_bpe:
            raise ValueError(f"data state batch_in_epoch {state['batch_in_epoch']} outside [0, {saved_bpe})")
        consumed = state["batch_in_epoch"] * state["micro_batch_size"] * state["world_size"]  # epoch positions
        per_batch = self.micro_batch_size * self.world_size
        if consumed % per_batch:
            raise ValueError(
                f"data state: the checkpoint consumed {consumed} samples of epoch {state['epoch']} "
                f"({state['batch_in_epoch']} batches x micro batch {state['micro_batch_size']} x world size "
                f"{state['world_size']}), not a multiple of this run's micro batch {self.micro_batch_size} x world "
                f"size {self.world_size} = {per_batch}: the position does not map onto whole batches"
            )
        batch = consumed // per_batch
        if batch >= self.batches_per_epoch:  # this layout's epoch ended before that position
            return _Position(int(state["epoch"]) + 1, 0)
        return _Position(int(state["epoch"]), batch)


def window_validation_batches(
    dataset: Any, micro_batch_size: int, seq_len: int, *, num_batches: int, rank: int = 0, world_size: int = 1,
    vocab_size: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``num_batches`` validation batches of this rank, always the same ones.

    Samples in file order, rank-strided like ``TokenBatcher``; yields fewer batches when the
    split is short (every rank the same count) and raises ``ValueError`` if it has none.
    """
    per_rank = dataset.num_samples(seq_len) // world_size // micro_batch_size
    if per_rank == 0:
        raise ValueError(
            f"validation split ({len(dataset)} tokens) has no full batch of {micro_batch_size}x{seq_len} per rank"
        )
    mine = np.arange(rank, per_rank * micro_batch_size * world_size, world_size)
    for k in range(min(num_batches, per_rank)):
        yield dataset.windows(mine[k * micro_batch_size : (k + 1) * micro_batch_size].tolist(), seq_len,
                              vocab_size=vocab_size)


def make_batcher(data: Any, micro_batch_size: int, seq_len: int, **kwargs: Any) -> Any:
    """The train sampler of a split: ``data.batcher(micro_batch_size, seq_len, **kwargs)``
    (``kwargs``: ``seed``, ``rank``, ``world_size``, ``shuffle``, ``vocab_size``; Megatron's samples
    also ``run_samples``, ``start_sample``, ``train_samples``; see ``DataSplit.batcher``)."""
    return data.batcher(micro_batch_size, seq_len, **kwargs)


def validation_batches(
    data: Any, micro_batch_size: int, seq_len: int, *, num_batches: int, rank: int = 0, world_size: int = 1,
    vocab_size: int | None = None, seed: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``num_batches`` validation batches of this rank, always the same ones: the split's
    own (``DataSplit.validation_batches``)."""
    return data.validation_batches(micro_batch_size, seq_len, num_batches=num_batches, rank=rank,
                                   world_size=world_size, vocab_size=vocab_size, seed=seed)
