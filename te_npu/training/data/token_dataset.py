"""The te_npu token format: one split is ``<prefix>.bin`` + ``<prefix>.json``; ``TokenDataset``
is a memory-mapped range of token ids of any such file (or of a Megatron ``.bin``, see
``TokenDataset.view``), cut into training windows.

- ``<prefix>.bin``: raw little-endian token ids, ``uint16`` when the vocabulary fits in
  65,536 ids, else ``uint32``; documents concatenated, each followed by ``eos_token_id``
  when the tokenizer has one.
- ``<prefix>.json``: ``{"format": "te_npu.tokens", "version": 1, "dtype", "num_tokens",
  "vocab_size", "eos_token_id", "tokenizer": {...}, "split", "sha256" (of the .bin),
  "sources": [{"path", "sha256", "num_tokens"}], "build": {...}}``.

``TokenDataset`` is a data split (``te_npu.training.data.kind.DataSplit``): its train batches
come from ``TokenBatcher`` (``sampling``), its validation batches are its first windows in file
order, and ``check_token_ids`` reads its ids before the model is built.

Samples: with sequence length S, sample ``i`` is the window ``tokens[i*S : i*S + S + 1]``;
``input_ids = window[:-1]`` and ``labels = window[1:]``. **Labels are already shifted**
(Megatron convention: ``labels[b, t]`` is the token after ``input_ids[b, t]``), so the loss
must not shift them again.

Legend: B = micro batch size, S = sequence length, N = number of tokens.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from te_npu.errors import ConfigError
from te_npu.training.data.sampling import TokenBatcher, window_validation_batches
from te_npu.training.data.token_checksum import check_sha256

__all__ = [
    "TokenDataset",
    "write_token_file",
    "split_paths",
    "token_dtype",
    "byte_tokenize",
    "first_invalid_id",
    "split_windows",
    "describe_invalid_id",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "SCAN_LIMIT_BYTES",
]

FORMAT_NAME, FORMAT_VERSION = "te_npu.tokens", 1

SCAN_LIMIT_BYTES = 4 << 30
"""``TokenDataset.check_token_ids`` reads every token of a split up to this size before training
(about 0.1 s per GiB from the page cache); of a larger one, ``SAMPLE_CHUNKS`` evenly spread chunks
of ``SAMPLE_CHUNK_TOKENS``. Every batch is checked exactly either way (``TokenDataset.windows``)."""
SAMPLE_CHUNKS, SAMPLE_CHUNK_TOKENS = 64, 1 << 20


def split_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """``<prefix>.bin`` and ``<prefix>.json`` (appended, so dots in the prefix are kept)."""
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".json")


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits in 16 bits, else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def first_invalid_id(ids: np.ndarray, vocab_size: int) -> tuple[int, Any] | None:
    """``(index, value)`` of the first entry of ``ids`` (any numeric dtype) that is not a token id
    of a ``vocab_size`` vocabulary: ``>= vocab_size``, negative, or (float files) not a whole
    number; None if all are. A min/max over the array when everything is fine."""
    if ids.size == 0:
        return None
    if ids.dtype.kind == "f":
        whole = np.isfinite(ids) & (ids == np.floor(ids))
        bad = ~whole | (ids < 0) | (ids >= vocab_size)
        if not bad.any():
            return None
        k = int(np.argmax(bad))
        return k, float(ids[k])
    if int(ids.max()) < vocab_size and (ids.dtype.kind == "u" or int(ids.min()) >= 0):
        return None
    k = int(np.argmax((ids >= vocab_size) | (ids < 0)))
    return k, int(ids[k])


def describe_invalid_id(value: Any, vocab_size: int) -> str:
    """Why ``value`` (found by ``first_invalid_id``) is no token id: "is negative", ...."""
    if isinstance(value, float) and not (math.isfinite(value) and value == math.floor(value)):
        return "is not a whole number (a float token file must hold integer ids)"
    if value < 0:
        return "is negative"
    return f"is >= the model's vocab_size {vocab_size}"


class TokenDataset:
    """A read-only, memory-mapped token split: ``tokens`` is ``np.memmap [N]``.

    ``TokenDataset(prefix)`` opens ``<prefix>.bin`` + ``<prefix>.json``; ``slice(a, b)``
    returns a view on tokens ``[a, b)`` (used to hold out the tail of a single file).
    """

    def __init__(
        self, prefix: str | os.PathLike, *, _tokens: np.ndarray | None = None, _meta: dict | None = None, _start: int = 0
    ):
        self.prefix = Path(prefix)
        self.start = _start  # offset of token 0 in <prefix>.bin (non-zero for a slice)
        if _tokens is not None and _meta is not None:
            self.meta, self.tokens = _meta, _tokens
            return
        bin_path, meta_path = split_paths(self.prefix)
        if not meta_path.is_file() or not bin_path.is_file():
            raise FileNotFoundError(f"token data {str(self.prefix)!r}: expected {bin_path.name} and {meta_path.name}")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != FORMAT_NAME or self.meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"{meta_path}: not a {FORMAT_NAME} v{FORMAT_VERSION} metadata file")
        dtype, num_tokens = np.dtype(self.meta["dtype"]), int(self.meta["num_tokens"])
        if bin_path.stat().st_size != num_tokens * dtype.itemsize:
            raise ValueError(
                f"{bin_path}: {bin_path.stat().st_size} bytes, expected num_tokens * itemsize = "
                f"{num_tokens} * {dtype.itemsize}"
            )
        check_sha256(bin_path, self.meta.get("sha256"))  # the header's digest (te_npu.training.data.token_checksum)
        if num_tokens == 0:  # np.memmap cannot map an empty file
            self.tokens = np.zeros(0, dtype)
        else:
            self.tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(num_tokens,))

    @classmethod
    def view(cls, prefix: str | os.PathLike, tokens: np.ndarray, meta: dict, start: int = 0) -> TokenDataset:
        """A token split over ``tokens`` (e.g. the memmap of a Megatron ``.bin``) described by
        ``meta`` (``num_tokens`` of the whole file, ``vocab_size`` if known); ``start`` is the
        offset of ``tokens[0]`` in ``<prefix>.bin``."""
        return cls(prefix, _tokens=tokens, _meta=meta, _start=start)

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary size from the header (None when the format has none)."""
        vocab = self.meta.get("vocab_size")
        return None if vocab is None else int(vocab)

    @property
    def eos_token_id(self) -> int | None:
        return self.meta.get("eos_token_id")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def slice(self, start: int, stop: int) -> TokenDataset:
        """A view on tokens ``[start, stop)`` sharing the memmap."""
        return TokenDataset(self.prefix, _tokens=self.tokens[start:stop], _meta=self.meta, _start=self.start + start)

    def num_samples(self, seq_len: int) -> int:
        """Number of full ``seq_len + 1`` windows at stride ``seq_len``."""
        return max(0, (len(self) - 1) // seq_len)

    def windows(
        self, indices: Iterable[int], seq_len: int, *, vocab_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``indices`` -> ``(input_ids [B, S], labels [B, S])`` int64 (labels shifted).

        ``vocab_size``: raise ``ValueError`` naming the file and token offset if a sampled id
        is ``>= vocab_size``, negative or fractional (a cheap max over the batch; the embedding
        would index out of range).
        """
        return split_windows(self.window_array(indices, seq_len, vocab_size=vocab_size))

    def window_array(self, indices: Iterable[int], seq_len: int, *, vocab_size: int | None = None) -> np.ndarray:
        """The raw windows of ``windows``: ``[B, S + 1]`` int64, checked the same way."""
        indices = list(indices)
        raw_BS1 = np.stack([self.tokens[i * seq_len : i * seq_len + seq_len + 1] for i in indices])
        if vocab_size is not None:
            bad = first_invalid_id(raw_BS1.reshape(-1), vocab_size)
            if bad is not None:
                b, s = divmod(bad[0], seq_len + 1)
                raise ValueError(
                    f"{self.describe()}: token id {bad[1]} at token offset {self.start + indices[b] * seq_len + s} "
                    f"(sample {indices[b]}) {describe_invalid_id(bad[1], vocab_size)}"
                )
        return raw_BS1.astype(np.int64)

    def describe(self) -> str:
        """``<prefix>.bin`` (plus the token range when this is a slice of it)."""
        bin_path = split_paths(self.prefix)[0]
        if self.start == 0 and len(self) == self.meta.get("num_tokens"):
            return str(bin_path)
        return f"{bin_path} [tokens {self.start}:{self.start + len(self)}]"

    def first_token_at_or_above(self, limit: int, chunks: Iterable[tuple[int, int]] | None = None) -> tuple[int, Any] | None:
        """``(offset in <prefix>.bin, id)`` of the first token that is not an id below ``limit``
        (``>= limit``, negative, or not a whole number), or None.

        ``chunks``: ``(begin, end)`` token ranges to read (default: everything, in 64 Mi-token
        chunks, about 0.1 s per GiB from the page cache)."""
        step = 64 << 20
        for begin, end in chunks if chunks is not None else ((b, b + step) for b in range(0, len(self), step)):
            bad = first_invalid_id(np.asarray(self.tokens[begin:end]), limit)
            if bad is not None:
                return self.start + begin + bad[0], bad[1]
        return None

    # --- the DataSplit protocol (te_npu.training.data.kind) ---

    def check_token_ids(self, vocab_size: int, key: str) -> str | None:
        """Raise ``ConfigError`` naming ``key`` if this split cannot feed a model of ``vocab_size``.

        The header's tokenizer ``vocab_size`` (te_npu files; Megatron's index has none) must not
        exceed the model's; then the ids themselves are read: all of them up to
        ``SCAN_LIMIT_BYTES`` (a header can be wrong, or the ``.bin`` edited), a sample of a larger
        split. An id >= ``vocab_size``, a negative one (signed Megatron dtypes) or a fraction
        (float dtypes) is refused. Returns a note when only a sample was read.
        """
        header_vocab = self.vocab_size
        if header_vocab is not None and header_vocab > vocab_size:
            raise ConfigError(
                f"{key}: {self.describe()} was tokenized with vocab_size {header_vocab} (its .json header), larger "
                f"than the model's vocab_size {vocab_size}; ids >= {vocab_size} would index past the embedding"
            )
        nbytes, note, chunks = len(self) * self.tokens.dtype.itemsize, None, None
        if nbytes > SCAN_LIMIT_BYTES:
            chunks = _spread_chunks(len(self), SAMPLE_CHUNKS, SAMPLE_CHUNK_TOKENS)
            read = sum(b - a for a, b in chunks)
            note = (f"{key}: {self.describe()} ({nbytes / 2**30:.1f} GiB) is too large to read before training: "
                    f"sampled {read} of its {len(self)} tokens; every batch is checked exactly")
        bad = self.first_token_at_or_above(vocab_size, chunks)
        if bad is not None:
            header = f" (the .json header says vocab_size {header_vocab})" if header_vocab is not None else ""
            raise ConfigError(f"{key}: {self.describe()} holds token id {bad[1]} at token offset {bad[0]}, which "
                              f"{describe_invalid_id(bad[1], vocab_size)}{header}")
        return note

    def batcher(self, micro_batch_size: int, seq_len: int, *, seed: int, rank: int = 0, world_size: int = 1,
                shuffle: bool = True, vocab_size: int | None = None, run_samples: int | None = None,
                start_sample: int | None = None, train_samples: int | None = None,
                barrier: Callable[[], None] | None = None) -> TokenBatcher:
        """``TokenBatcher`` over this split. Megatron's ``run_samples`` / ``start_sample`` /
        ``train_samples`` do not apply; nothing is written, so no ``barrier`` is needed."""
        return TokenBatcher(self, micro_batch_size, seq_len, seed=seed, rank=rank, world_size=world_size,
                            shuffle=shuffle, vocab_size=vocab_size)

    def validation_batches(self, micro_batch_size: int, seq_len: int, *, num_batches: int, rank: int = 0,
                           world_size: int = 1, vocab_size: int | None = None,
                           seed: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The first windows in file order, rank-strided like ``TokenBatcher`` (``window_validation_batches``)."""
        return window_validation_batches(self, micro_batch_size, seq_len, num_batches=num_batches, rank=rank,
                                         world_size=world_size, vocab_size=vocab_size)


def _spread_chunks(num_tokens: int, count: int, size: int) -> list[tuple[int, int]]:
    """``count`` ranges of ``size`` tokens spread evenly over ``[0, num_tokens)``, first and last included."""
    starts = np.linspace(0, max(num_tokens - size, 0), count).astype(np.int64)
    return [(int(a), int(min(a + size, num_tokens))) for a in np.unique(starts)]


def split_windows(window_BS1: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S + 1]`` windows -> ``(input_ids [B, S], labels [B, S])`` int64 tensors (labels shifted)."""
    window_BS1 = torch.from_numpy(np.ascontiguousarray(window_BS1, dtype=np.int64))
    return window_BS1[:, :-1].contiguous(), window_BS1[:, 1:].contiguous()


def byte_tokenize(data: bytes) -> np.ndarray:
    """Byte-level tokens of one document: ``[len(data)]`` uint16, ids 0..255."""
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def write_token_file(
    prefix: str | os.PathLike,
    documents: Iterable[tuple[str, bytes, np.ndarray]],
    *,
    vocab_size: int,
    tokenizer: dict[str, Any],
    eos_token_id: int | None,
    split: str,
    build: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``<prefix>.bin`` + ``<prefix>.json`` from ``(source_path, raw_bytes, token_ids)``.

    Each document's ids are followed by ``eos_token_id`` (if not None). Both files are
    written under temporary names and renamed, .json last, so a reader (or a concurrent
    writer of the same deterministic content) never sees a half-written split.
    Returns the metadata dict.
    """
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    tmp = f".tmp{os.getpid()}"
    bin_path, meta_path = split_paths(prefix)
    bin_tmp, meta_tmp = bin_path.with_name(bin_path.name + tmp), meta_path.with_name(meta_path.name + tmp)
    digest, sources, num_tokens = hashlib.sha256(), [], 0
    with open(bin_tmp, "wb") as out:
        for source, raw, ids in documents:
            ids = np.asarray(ids)
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                raise ValueError(f"{source}: token ids outside [0, {vocab_size})")
            if eos_token_id is not None:
                ids = np.append(ids, eos_token_id)
            chunk = ids.astype(dtype.newbyteorder("<")).tobytes()
            out.write(chunk)
            digest.update(chunk)
            sources.append({"path": source, "sha256": hashlib.sha256(raw).hexdigest(), "num_tokens": int(ids.size)})
            num_tokens += int(ids.size)
    meta = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "dtype": dtype.name,
        "num_tokens": num_tokens,
        "vocab_size": int(vocab_size),
        "eos_token_id": eos_token_id,
        "tokenizer": tokenizer,
        "split": split,
        "sha256": digest.hexdigest(),
        "sources": sources,
        "build": build or {},
    }
    meta_tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(bin_tmp, bin_path)
    os.replace(meta_tmp, meta_path)
    return meta
