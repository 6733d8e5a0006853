"""Which tokens a run reads: one registered entry per ``data.kind``, the stdlib corpus, and the
token-id check that runs before the model is built.

``DATA_KINDS`` maps each ``data.kind`` to a ``DataKind``: the ``data.*`` keys it reads, its
config rules, and the function that turns the ``data`` section into a train and a validation
split (``DataSplits``). A new kind joins with one entry. Today:

- ``stdlib``: the interpreter's standard-library ``.py`` sources, byte-level tokenized (token =
  byte value, vocab 256; byte 0, NUL, absent from source text, ends each document), whole files
  held out for validation, cached in the te_npu token format (``token_dataset``);
- ``bin``: a prepared te_npu token split (``scripts/prepare_data.py``);
- ``megatron``: Megatron-LM indexed datasets read in place, one prefix or a blend, served as
  Megatron's ``GPTDataset`` / ``BlendedDataset`` samples (``megatron_data``, ``gpt_samples``,
  ``gpt_index``, ``indexed_dataset``); ``read_global_samples`` reads them without training;
- ``hf``: a local Hugging Face dataset tokenized once into a cached Megatron indexed dataset
  (``hf_data``), or tokenized as it is read (``streaming: true``, ``hf_stream``).

The samplers live in ``sampling`` (re-exported here).

This package is the data room of ``te_npu.training``: every data kind's reader (the modules
above), blends (``blend``), Megatron's splits (``splits``), the samplers and the checksums
(``token_checksum``), none of which imports anything else of ``te_npu.training``. Its entry is
this module: ``check_data_config`` (the config's rules), ``build_splits`` (a ``data`` section ->
the train and validation datasets) and ``check_token_ids``.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from te_npu.errors import ConfigError
from te_npu.training.data import hf_data, megatron_data
from te_npu.training.data.blend import TokenBlend
from te_npu.training.data.gpt_samples import MegatronSplit
from te_npu.training.data.megatron_data import read_global_samples
from te_npu.training.data.hf_stream import HFStream
from te_npu.training.data.splits import DataSplits
from te_npu.training.data.sampling import TokenBatcher, make_batcher, validation_batches
from te_npu.training.data.token_dataset import (
    FORMAT_NAME,
    TokenDataset,
    byte_tokenize,
    describe_invalid_id,
    split_paths,
    write_token_file,
)

__all__ = [
    "DataKind",
    "DataSplits",
    "DATA_KINDS",
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

BYTE_VOCAB_SIZE = 256  # byte-level: token id = byte value
BYTE_EOS_ID = 0  # NUL never occurs in text sources, so it marks a document end
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


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


# ---------------------------------------------------------------------------------------
# The kinds
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataKind:
    """One ``data.kind``.

    ``build(data_cfg, vocab_size, progress)`` -> ``DataSplits`` (``vocab_size``: the model's,
    for checks a build must make first, e.g. a tokenizer's; ``progress``: this rank may show a
    progress bar). ``keys``: the optional ``data.*`` keys (of ``OPTIONAL_KEYS``) the kind reads;
    setting another is an error. ``check(data_cfg)``: its config-only rules (``ConfigError``).
    ``writes_cache``: the build writes files, so rank 0 builds first and the others then open.
    """

    build: Callable[[Any, int | None, bool], DataSplits]
    keys: frozenset[str] = frozenset()
    check: Callable[[Any], None] | None = None
    writes_cache: bool = False


OPTIONAL_KEYS = ("path", "val_path", "blend", "val_blend", "split", "tokenizer", "streaming", "start_sample",
                 "train_samples")
"""``data.*`` keys that mean something for some kinds only (None when unset; false for ``streaming``)."""


def _build_stdlib(d: Any, vocab_size: int | None, progress: bool) -> DataSplits:
    prefix = Path(d.cache_dir) / f"stdlib_py{sys.version_info.major}{sys.version_info.minor}"
    try:
        train, val = build_stdlib_corpus(prefix, d.val_fraction, max_bytes=d.max_bytes, include_tests=d.include_tests)
    except OSError as exc:
        raise ConfigError(f"data.cache_dir: cannot build the stdlib corpus in {d.cache_dir!r}: {exc}") from None
    return DataSplits(TokenDataset(train), TokenDataset(val), "data.kind", "data.kind")


def _build_bin(d: Any, vocab_size: int | None, progress: bool) -> DataSplits:
    dataset = _open_token_file(d.path, "data.path")
    if d.val_path is not None:
        return DataSplits(dataset, _open_token_file(d.val_path, "data.val_path"), "data.path", "data.val_path")
    cut = len(dataset) - int(round(len(dataset) * d.val_fraction))
    return DataSplits(dataset.slice(0, cut), dataset.slice(cut, len(dataset)), "data.path", "data.path")


def _check_bin(d: Any) -> None:
    if d.path is None:
        raise ConfigError("data.path: required when data.kind is 'bin' (prefix of a prepared .bin/.json pair)")


def _open_token_file(prefix: str, key: str) -> TokenDataset:
    try:
        return TokenDataset(prefix)
    except FileNotFoundError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    except (ValueError, KeyError, OSError) as exc:
        raise ConfigError(f"{key}: {prefix!r} is not a readable {FORMAT_NAME} split: {exc}") from None


DATA_KINDS: Mapping[str, DataKind] = MappingProxyType({
    "stdlib": DataKind(_build_stdlib, writes_cache=True),
    "bin": DataKind(_build_bin, frozenset({"path", "val_path"}), _check_bin),
    "megatron": DataKind(megatron_data.build_megatron, megatron_data.KEYS, megatron_data.check_config),
    "hf": DataKind(hf_data.build_hf, hf_data.KEYS, hf_data.check_config, writes_cache=True),
})
"""``data.kind`` -> what it reads and how (``DataKind``)."""


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


def build_splits(d: Any, vocab_size: int | None = None, *, progress: bool = False) -> DataSplits:
    """``DataConfig`` -> its ``DataSplits`` (caches built on first use). ``ConfigError`` for bad input.

    For a kind that ``writes_cache``, call it on one rank first (then barrier) to avoid duplicate
    work; concurrent builds are safe anyway because writes are atomic and deterministic.
    """
    return DATA_KINDS[d.kind].build(d, vocab_size, progress)


def build_datasets(d: Any) -> tuple[TokenDataset | TokenBlend, TokenDataset | TokenBlend]:
    """``(train, val)`` of ``build_splits(d)``."""
    splits = build_splits(d)
    return splits.train, splits.val


SCAN_LIMIT_BYTES = 4 << 30
"""``check_token_ids`` reads every token of a split up to this size before training (about
0.1 s per GiB from the page cache); of a larger one, ``SAMPLE_CHUNKS`` evenly spread chunks of
``SAMPLE_CHUNK_TOKENS``. Every batch is checked exactly either way (``TokenDataset.windows``)."""
SAMPLE_CHUNKS, SAMPLE_CHUNK_TOKENS = 64, 1 << 20


def check_token_ids(data: TokenDataset | TokenBlend, vocab_size: int, key: str) -> str | None:
    """Raise ``ConfigError`` (naming ``key``, or each blend part's key) if ``data`` cannot feed a
    model of ``vocab_size``.

    A header's tokenizer ``vocab_size`` (te_npu files; Megatron's index has none) must not
    exceed the model's; then the ids themselves are read: all of a split up to
    ``SCAN_LIMIT_BYTES`` (a header can be wrong, or the ``.bin`` edited), a sample of a larger
    one. An id >= ``vocab_size``, a negative one (signed Megatron dtypes) or a fraction (float
    dtypes) is refused. Returns a note when only a sample was read.
    """
    if isinstance(data, TokenBlend):
        notes = [check_token_ids(part.data, vocab_size, part.key) for part in data.parts]
        return "; ".join(n for n in notes if n) or None
    if isinstance(data, MegatronSplit):  # each dataset's share of the split, as the tokens of its .bin
        notes = [check_token_ids(view, vocab_size, part_key) for view, part_key in data.token_views()]
        return "; ".join(n for n in notes if n) or None
    if isinstance(data, HFStream):  # nothing to read ahead; load_tokenizer checked its vocabulary
        return (f"{key}: {data.describe()} is tokenized as it is read: its {data.vocab_size}-id tokenizer fits the "
                f"model's vocab_size {vocab_size}, and every batch is checked exactly")
    header_vocab = data.vocab_size
    if header_vocab is not None and header_vocab > vocab_size:
        raise ConfigError(
            f"{key}: {data.describe()} was tokenized with vocab_size {header_vocab} (its .json header), larger "
            f"than the model's vocab_size {vocab_size}; ids >= {vocab_size} would index past the embedding"
        )
    nbytes, note, chunks = len(data) * data.tokens.dtype.itemsize, None, None
    if nbytes > SCAN_LIMIT_BYTES:
        chunks = _spread_chunks(len(data), SAMPLE_CHUNKS, SAMPLE_CHUNK_TOKENS)
        read = sum(b - a for a, b in chunks)
        note = (f"{key}: {data.describe()} ({nbytes / 2**30:.1f} GiB) is too large to read before training: "
                f"sampled {read} of its {len(data)} tokens; every batch is checked exactly")
    bad = data.first_token_at_or_above(vocab_size, chunks)
    if bad is not None:
        header = f" (the .json header says vocab_size {header_vocab})" if header_vocab is not None else ""
        raise ConfigError(f"{key}: {data.describe()} holds token id {bad[1]} at token offset {bad[0]}, which "
                          f"{describe_invalid_id(bad[1], vocab_size)}{header}")
    return note


def _spread_chunks(num_tokens: int, count: int, size: int) -> list[tuple[int, int]]:
    """``count`` ranges of ``size`` tokens spread evenly over ``[0, num_tokens)``, first and last included."""
    starts = np.linspace(0, max(num_tokens - size, 0), count).astype(np.int64)
    return [(int(a), int(min(a + size, num_tokens))) for a in np.unique(starts)]
