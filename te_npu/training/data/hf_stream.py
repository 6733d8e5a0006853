"""``data.kind: hf`` with ``data.streaming: true``: a local Hugging Face dataset tokenized on the
fly, never written anywhere.

Each pass (epoch) over the dataset is one token stream: every document's ids (EOS appended, as
in the cached path) back to back, cut into windows of ``seq_len + 1`` tokens at stride
``seq_len`` (the windows the cached path gives, in file order); the tail of a pass shorter than a
window is dropped and the next pass starts afresh. Global window ``k`` of a micro batch goes to
rank ``k % W`` (``TokenBatcher``'s striding), so every rank reads and tokenizes the whole stream
and keeps its own windows. The data position is ``(epoch, windows consumed in it)``, the same on
every rank and independent of the layout: resume is exact on any world size and micro batch,
and costs re-tokenizing the pass up to that position (the stream has no index to seek in).

A stream is read in order (``data.shuffle`` must be false) and cannot be split by documents
without a document count, so validation is a separate dataset (``data.val_path``), streamed too.
Use the cached path (``streaming: false``) for shuffled samples, Megatron's ``split``, the
startup token scan, and one tokenization for all runs and ranks.

Legend: B = micro batch size, S = sequence length, W = world size.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from te_npu.training.data.token_dataset import describe_invalid_id, first_invalid_id, split_windows

__all__ = ["HFStream", "StreamBatcher", "stream_validation_batches"]


class HFStream:
    """The documents of a local HF dataset as token windows, tokenized as they are read.

    ``documents()``: a fresh iterator of the dataset's documents as token ids (EOS appended;
    ``hf_data`` makes it); ``vocab_size``: the tokenizer's; ``fingerprint``: what identifies the
    dataset in a data state (``fingerprint()``).
    """

    def __init__(self, source: str, key: str, documents: Callable[[], Iterator[np.ndarray]], vocab_size: int,
                 fingerprint: list):
        self.source, self.key, self._documents = source, key, documents
        self.vocab_size, self.fingerprint = vocab_size, fingerprint

    def describe(self) -> str:
        return f"{self.source} (streamed)"

    # --- the DataSplit protocol (te_npu.training.data.kind) ---

    def check_token_ids(self, vocab_size: int, key: str) -> str | None:
        """Nothing to read ahead (``load_tokenizer`` checked the vocabulary): a note saying so."""
        return (f"{key}: {self.describe()} is tokenized as it is read: its {self.vocab_size}-id tokenizer fits the "
                f"model's vocab_size {vocab_size}, and every batch is checked exactly")

    def batcher(self, micro_batch_size: int, seq_len: int, *, seed: int, rank: int = 0, world_size: int = 1,
                shuffle: bool = False, vocab_size: int | None = None, run_samples: int | None = None,
                start_sample: int | None = None, train_samples: int | None = None,
                barrier: Callable[[], None] | None = None) -> StreamBatcher:
        """``StreamBatcher`` over this stream (read in order: ``shuffle`` must be false). Megatron's ``run_samples`` / ``start_sample`` /
        ``train_samples`` do not apply; nothing is written, so no ``barrier`` is needed."""
        return StreamBatcher(self, micro_batch_size, seq_len, seed=seed, rank=rank, world_size=world_size,
                             shuffle=shuffle, vocab_size=vocab_size)

    def validation_batches(self, micro_batch_size: int, seq_len: int, *, num_batches: int, rank: int = 0,
                           world_size: int = 1, vocab_size: int | None = None,
                           seed: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The start of the stream (``stream_validation_batches``)."""
        return stream_validation_batches(self, micro_batch_size, seq_len, num_batches=num_batches, rank=rank,
                                         world_size=world_size, vocab_size=vocab_size)

    def windows(self, seq_len: int, skip: int = 0) -> Iterator[np.ndarray]:
        """One pass: its windows ``[S + 1]`` int64 in order, the first ``skip`` read and dropped."""
        buffer, served = np.zeros(0, dtype=np.int64), 0
        for ids in self._documents():
            buffer = np.concatenate([buffer, ids])
            at = 0
            while buffer.size - at >= seq_len + 1:
                if served >= skip:
                    yield buffer[at : at + seq_len + 1]
                served += 1
                at += seq_len
            buffer = buffer[at:]


class _Cursor:
    """Where a stream is: ``(epoch, window within it)``, and the open pass that continues there."""

    def __init__(self, stream: HFStream, seq_len: int):
        self.stream, self.seq_len = stream, seq_len
        self.epoch, self.window = 0, 0
        self._pass: Iterator[np.ndarray] | None = None

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` windows ``[count, S + 1]``, into the next epoch when a pass ends."""
        rows, empty_passes = [], 0
        while len(rows) < count:
            if self._pass is None:
                self._pass = self.stream.windows(self.seq_len, skip=self.window)
            window = next(self._pass, None)
            if window is None:
                if self.window == 0:
                    empty_passes += 1
                    if empty_passes > 1:
                        raise ValueError(f"{self.stream.key}: {self.stream.describe()} holds no window of seq_len "
                                         f"+ 1 = {self.seq_len + 1} tokens")
                self.epoch, self.window, self._pass = self.epoch + 1, 0, None
                continue
            rows.append(window)
            self.window += 1
        return np.stack(rows)


class StreamBatcher:
    """Endless ``(input_ids [B, S], labels [B, S])`` int64 batches of a stream for one rank.

    Each micro batch takes the next ``B * W`` windows; rank ``r`` keeps ``r, r + W, ...``.
    ``state_dict()`` is the same on every rank; any layout resumes exactly there (module doc).
    ``vocab_size``: every batch is checked against it.
    """

    kind = "stream"

    def __init__(self, stream: HFStream, micro_batch_size: int, seq_len: int, *, seed: int, rank: int = 0,
                 world_size: int = 1, shuffle: bool = False, vocab_size: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
        if shuffle:
            raise ValueError("a streamed dataset is read in order (shuffle must be false)")
        self.stream, self.micro_batch_size, self.seq_len = stream, micro_batch_size, seq_len
        self.seed, self.rank, self.world_size, self.vocab_size = seed, rank, world_size, vocab_size
        self._cursor = _Cursor(stream, seq_len)
        self._consumed = 0

    @property
    def consumed_samples(self) -> int:
        """Windows consumed by all ranks together so far."""
        return self._consumed

    def __iter__(self) -> StreamBatcher:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        window_BS1 = self._cursor.take(self.micro_batch_size * self.world_size)[self.rank :: self.world_size]
        self._consumed += self.micro_batch_size * self.world_size
        return split_windows(_checked(window_BS1, self.vocab_size, self.stream, self._cursor))

    def state_dict(self) -> dict[str, Any]:
        """The position and what it is valid for (plain values: checkpoint-safe)."""
        return {"kind": self.kind, "epoch": self._cursor.epoch, "window": self._cursor.window,
                "consumed_samples": self._consumed, "seq_len": self.seq_len, "source": self.stream.fingerprint,
                "world_size": self.world_size, "micro_batch_size": self.micro_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, window = self.position_for(state)
        self._cursor = _Cursor(self.stream, self.seq_len)
        self._cursor.epoch, self._cursor.window = epoch, window
        self._consumed = int(state["consumed_samples"])

    def position_for(self, state: dict[str, Any]) -> tuple[int, int]:
        """``(epoch, window)`` that ``state`` resumes at; ``ValueError`` naming the mismatch."""
        if state.get("kind") != self.kind:
            raise ValueError("data state mismatch: the checkpoint was not saved reading a stream (data.streaming "
                             "or the data changed)")
        for key, mine in (("seq_len", self.seq_len), ("source", self.stream.fingerprint)):
            if _plain(state[key]) != _plain(mine):
                raise ValueError(f"data state mismatch on {key!r}: checkpoint has {state[key]!r}, this run {mine!r}")
        return int(state["epoch"]), int(state["window"])


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _checked(window_BS1: np.ndarray, vocab_size: int | None, stream: HFStream, cursor: _Cursor) -> np.ndarray:
    if vocab_size is not None:
        bad = first_invalid_id(window_BS1.reshape(-1), vocab_size)
        if bad is not None:
            raise ValueError(f"{stream.describe()}: token id {bad[1]} near window {cursor.window} of epoch "
                             f"{cursor.epoch} {describe_invalid_id(bad[1], vocab_size)}")
    return window_BS1


def stream_validation_batches(
    stream: HFStream, micro_batch_size: int, seq_len: int, *, num_batches: int, rank: int = 0, world_size: int = 1,
    vocab_size: int | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``num_batches`` batches of this rank from the start of ``stream`` (fewer when one
    pass holds fewer, every rank the same count; ``ValueError`` when it holds none)."""
    windows = stream.windows(seq_len)
    per_batch = micro_batch_size * world_size
    for n in range(num_batches):
        rows = [w for _, w in zip(range(per_batch), windows)]
        if len(rows) < per_batch:
            if n == 0:
                raise ValueError(f"validation stream {stream.describe()} has no full batch of "
                                 f"{micro_batch_size}x{seq_len} per rank")
            return
        window_BS1 = np.stack(rows)[rank::world_size]
        if vocab_size is not None and first_invalid_id(window_BS1.reshape(-1), vocab_size) is not None:
            bad = first_invalid_id(window_BS1.reshape(-1), vocab_size)
            raise ValueError(f"{stream.describe()}: token id {bad[1]} in validation batch {n} "
                             f"{describe_invalid_id(bad[1], vocab_size)}")
        yield split_windows(window_BS1)


def fingerprint(files: list[Path], tokenizer_size: int, text_key: str) -> list:
    """Names and sizes of a stream's files, the tokenizer's vocabulary and the column: cheap, and
    enough to refuse resuming on other data."""
    return [[f.name, f.stat().st_size] for f in files] + [["vocab", tokenizer_size], ["text_key", text_key]]
