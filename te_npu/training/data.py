"""Token data: memory-mapped token files, the stdlib corpus, and deterministic samplers.

File format: one split is two files sharing a prefix.

- ``<prefix>.bin``: raw little-endian token ids, ``uint16`` when the vocabulary fits in
  65,536 ids, else ``uint32``; documents concatenated, each followed by ``eos_token_id``
  when the tokenizer has one.
- ``<prefix>.json``: ``{"format": "te_npu.tokens", "version": 1, "dtype", "num_tokens",
  "vocab_size", "eos_token_id", "tokenizer": {...}, "split", "sha256" (of the .bin),
  "sources": [{"path", "sha256", "num_tokens"}], "build": {...}}``.

Byte-level tokenization: token = byte value (vocab 256), byte 0 (NUL, absent from source
text) ends each document.

Samples: with sequence length S, sample ``i`` is the window ``tokens[i*S : i*S + S + 1]``;
``input_ids = window[:-1]`` and ``labels = window[1:]``. **Labels are already shifted**
(Megatron convention: ``labels[b, t]`` is the token after ``input_ids[b, t]``), so the loss
must not shift them again.

Legend: B = micro batch size, S = sequence length, N = number of tokens, W = world size.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from te_npu.errors import ConfigError
from te_npu.training.token_checksum import check_sha256

__all__ = [
    "TokenDataset",
    "TokenBatcher",
    "write_token_file",
    "split_paths",
    "tokenize_files",
    "byte_tokenize",
    "split_by_file",
    "stdlib_sources",
    "build_stdlib_corpus",
    "validation_batches",
    "build_datasets",
    "check_token_ids",
    "SCAN_LIMIT_BYTES",
    "BYTE_VOCAB_SIZE",
    "BYTE_EOS_ID",
]

FORMAT_NAME, FORMAT_VERSION = "te_npu.tokens", 1
BYTE_VOCAB_SIZE = 256  # byte-level: token id = byte value
BYTE_EOS_ID = 0  # NUL never occurs in text sources, so it marks a document end
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def split_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """``<prefix>.bin`` and ``<prefix>.json`` (appended, so dots in the prefix are kept)."""
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".json")


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits in 16 bits, else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------


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
        check_sha256(bin_path, self.meta.get("sha256"))  # the header's digest (te_npu.training.token_checksum)
        if num_tokens == 0:  # np.memmap cannot map an empty file
            self.tokens = np.zeros(0, dtype)
        else:
            self.tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(num_tokens,))

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

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
        is ``>= vocab_size`` (a cheap max over the batch; the embedding would index out of range).
        """
        indices = list(indices)
        rows = [np.asarray(self.tokens[i * seq_len : i * seq_len + seq_len + 1], dtype=np.int64) for i in indices]
        window_BS1 = np.stack(rows)
        if vocab_size is not None and window_BS1.size and int(window_BS1.max()) >= vocab_size:
            b, s = np.unravel_index(int(np.argmax(window_BS1 >= vocab_size)), window_BS1.shape)
            raise ValueError(
                f"{self.describe()}: token id {int(window_BS1[b, s])} at token offset "
                f"{self.start + indices[b] * seq_len + s} "
                f"(sample {indices[b]}) is >= the model's vocab_size {vocab_size}"
            )
        window_BS1 = torch.from_numpy(window_BS1)
        return window_BS1[:, :-1].contiguous(), window_BS1[:, 1:].contiguous()

    def describe(self) -> str:
        """``<prefix>.bin`` (plus the token range when this is a slice of it)."""
        bin_path = split_paths(self.prefix)[0]
        if self.start == 0 and len(self) == self.meta.get("num_tokens"):
            return str(bin_path)
        return f"{bin_path} [tokens {self.start}:{self.start + len(self)}]"

    def first_token_at_or_above(self, limit: int) -> tuple[int, int] | None:
        """``(offset in <prefix>.bin, id)`` of the first token id ``>= limit``, or None; scans in
        64 Mi-token chunks (about 0.1 s per GiB from the page cache)."""
        chunk = 64 << 20
        for begin in range(0, len(self), chunk):
            part = np.asarray(self.tokens[begin : begin + chunk])
            if part.size and int(part.max()) >= limit:
                offset = int(np.argmax(part >= limit))
                return self.start + begin + offset, int(part[offset])
        return None


# ---------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------


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


def tokenize_files(
    paths: Iterable[tuple[str, Path]], tokenize: Callable[[bytes, str], np.ndarray]
) -> Iterator[tuple[str, bytes, np.ndarray]]:
    """``(name, path)`` pairs -> ``(name, raw_bytes, ids)`` documents for ``write_token_file``."""
    for name, path in paths:
        raw = Path(path).read_bytes()
        yield name, raw, tokenize(raw, name)


def split_by_file(names: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Deterministic by-file split: a file is held out when ``sha256(name)`` falls below
    ``val_fraction`` of the hash range. Independent of file order; both sides non-empty
    whenever there are two or more files (the lowest-hash file is held out if none was)."""
    def unit(name: str) -> float:
        return int(hashlib.sha256(name.encode()).hexdigest()[:12], 16) / 16**12

    val = [n for n in names if unit(n) < val_fraction]
    if not val and len(names) > 1 and val_fraction > 0:
        val = [min(names, key=unit)]
    if len(val) == len(names) and len(names) > 1:
        val = val[:-1]
    held = set(val)
    return [n for n in names if n not in held], val


# ---------------------------------------------------------------------------------------
# The stdlib corpus
# ---------------------------------------------------------------------------------------


def stdlib_sources(max_bytes: int, include_tests: bool = False) -> list[tuple[str, Path]]:
    """The interpreter's standard-library ``.py`` files as ``(relative posix path, path)``.

    Sorted by relative path; ``site-packages`` excluded, test directories excluded unless
    ``include_tests``; the longest sorted prefix whose total size is <= ``max_bytes``.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS and (include_tests or d not in _TEST_DIRS)]
        found += [((rel_dir / f).as_posix(), Path(dirpath) / f) for f in filenames if f.endswith(".py")]
    found.sort()
    chosen, total = [], 0
    for rel, path in found:
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        chosen.append((rel, path))
        total += size
    return chosen


def build_stdlib_corpus(
    out_prefix: str | os.PathLike,
    val_fraction: float = 0.05,
    *,
    max_bytes: int = 12 * 2**20,
    include_tests: bool = False,
) -> tuple[Path, Path]:
    """Byte-level corpus of the stdlib sources -> ``(<out_prefix>_train, <out_prefix>_val)`` prefixes.

    Validation = whole files chosen by ``split_by_file``. Cached: when both .json files
    exist with the same build record (python version, stdlib path, parameters) nothing is
    read or written, so reruns are instant.
    """
    out_prefix = Path(out_prefix)
    train, val = out_prefix.with_name(out_prefix.name + "_train"), out_prefix.with_name(out_prefix.name + "_val")
    build = {
        "kind": "stdlib",
        "python": sys.version,
        "stdlib": sysconfig.get_paths()["stdlib"],
        "max_bytes": int(max_bytes),
        "include_tests": bool(include_tests),
        "val_fraction": float(val_fraction),
        "split": "sha256(relative path) < val_fraction",
    }
    if all(_cached_build(p) == build for p in (train, val)):
        return train, val
    sources = stdlib_sources(max_bytes, include_tests)
    train_names, val_names = split_by_file([rel for rel, _ in sources], val_fraction)
    by_name = dict(sources)
    tokenizer = {"kind": "byte", "vocab_size": BYTE_VOCAB_SIZE, "eos": "byte 0 (NUL) after each file"}
    for prefix, names, split in ((train, train_names, "train"), (val, val_names, "val")):
        docs = tokenize_files(((n, by_name[n]) for n in names), lambda raw, _: byte_tokenize(raw))
        write_token_file(
            prefix,
            docs,
            vocab_size=BYTE_VOCAB_SIZE,
            tokenizer=tokenizer,
            eos_token_id=BYTE_EOS_ID,
            split=split,
            build=build,
        )
    return train, val


def _cached_build(prefix: Path) -> dict | None:
    bin_path, meta_path = split_paths(prefix)
    try:
        meta = json.loads(meta_path.read_text())
        if bin_path.stat().st_size != meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize:
            return None
        return meta.get("build")
    except (OSError, ValueError, KeyError):
        return None


def build_datasets(data_cfg: Any) -> tuple[TokenDataset, TokenDataset]:
    """``DataConfig`` -> ``(train, val)`` datasets (stdlib corpus built/cached on first use).

    Call it on one rank first (then barrier) to avoid duplicate work; concurrent builds are
    safe anyway because writes are atomic and deterministic.
    """
    if data_cfg.kind == "stdlib":
        prefix = Path(data_cfg.cache_dir) / f"stdlib_py{sys.version_info.major}{sys.version_info.minor}"
        try:
            train, val = build_stdlib_corpus(
                prefix, data_cfg.val_fraction, max_bytes=data_cfg.max_bytes, include_tests=data_cfg.include_tests
            )
        except OSError as exc:
            raise ConfigError(f"data.cache_dir: cannot build the stdlib corpus in {data_cfg.cache_dir!r}: {exc}") from None
        return TokenDataset(train), TokenDataset(val)
    dataset = _open_split(data_cfg.path, "data.path")
    if data_cfg.val_path is not None:
        return dataset, _open_split(data_cfg.val_path, "data.val_path")
    cut = len(dataset) - int(round(len(dataset) * data_cfg.val_fraction))
    return dataset.slice(0, cut), dataset.slice(cut, len(dataset))


def _open_split(prefix: str, key: str) -> TokenDataset:
    try:
        return TokenDataset(prefix)
    except FileNotFoundError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    except (ValueError, KeyError, OSError) as exc:
        raise ConfigError(f"{key}: {prefix!r} is not a readable {FORMAT_NAME} split: {exc}") from None


SCAN_LIMIT_BYTES = 4 << 30
"""``check_token_ids`` scans files up to this size before training (about 0.1 s per GiB from the
page cache); larger ones rely on the per-batch check of ``TokenDataset.windows``."""


def check_token_ids(dataset: TokenDataset, vocab_size: int, key: str) -> str | None:
    """Raise ``ConfigError`` (naming ``key``) if ``dataset`` cannot feed a model of ``vocab_size``.

    The header's tokenizer ``vocab_size`` must not exceed the model's; then the ids themselves
    are scanned when the split is at most ``SCAN_LIMIT_BYTES`` (a header can be wrong, or the
    ``.bin`` edited). Returns a note when the split was too large to scan.
    """
    header_vocab = int(dataset.meta.get("vocab_size", 0))
    if header_vocab > vocab_size:
        raise ConfigError(
            f"{key}: {dataset.describe()} was tokenized with vocab_size {header_vocab} (its .json header), larger "
            f"than the model's vocab_size {vocab_size}; ids >= {vocab_size} would index past the embedding"
        )
    nbytes = len(dataset) * dataset.tokens.dtype.itemsize
    if nbytes > SCAN_LIMIT_BYTES:
        return (f"{key}: {dataset.describe()} ({nbytes / 2**30:.1f} GiB) is too large to scan before training; "
                "token ids are checked per batch")
    bad = dataset.first_token_at_or_above(vocab_size)
    if bad is not None:
        raise ConfigError(
            f"{key}: {dataset.describe()} holds token id {bad[1]} at token offset {bad[0]}, >= the model's "
            f"vocab_size {vocab_size} (the .json header says vocab_size {header_vocab})"
        )
    return None


# ---------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------


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

    def __init__(
        self,
        dataset: TokenDataset,
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


def validation_batches(
    dataset: TokenDataset, micro_batch_size: int, seq_len: int, *, num_batches: int, rank: int = 0, world_size: int = 1,
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
