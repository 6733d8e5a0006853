"""``data.kind: stdlib`` (the default): the interpreter's standard-library ``.py`` sources,
byte-level tokenized, cached in the te_npu token format (``token_dataset``).

    data: {kind: stdlib, cache_dir: data_cache, max_bytes: 12582912, val_fraction: 0.05}

Token = byte value (vocab 256); byte 0 (NUL), absent from source text, ends each document. The
files are the stdlib's ``.py`` sources in sorted relative-path order (``site-packages`` and, unless
``include_tests``, test directories left out), the longest prefix of at most ``max_bytes``;
validation is whole files (``split_by_file``: ``sha256(relative path) < val_fraction``). The cache
``<cache_dir>/stdlib_py<major><minor>_{train,val}`` is rebuilt only when its build record (python
version, stdlib path, parameters) changes; the build writes files, so in a multi-rank run rank 0
builds it first (``KIND.writes_cache``). The splits are ``TokenDataset`` objects.

``tokenize_files`` / ``split_by_file`` / ``BYTE_*`` also serve ``scripts/prepare_data.py``.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from te_npu.errors import ConfigError
from te_npu.training.data.kind import DataKind
from te_npu.training.data.splits import DataSplits
from te_npu.training.data.token_dataset import TokenDataset, byte_tokenize, split_paths, write_token_file

__all__ = ["KIND", "BYTE_VOCAB_SIZE", "BYTE_EOS_ID", "tokenize_files", "split_by_file", "stdlib_sources",
           "build_stdlib_corpus"]

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


def build_stdlib(d: Any, vocab_size: int | None, progress: bool) -> DataSplits:
    """The ``data`` section -> train / validation ``TokenDataset`` of the cached corpus (built now if
    absent or stale); ``ConfigError`` naming ``data.cache_dir`` when it cannot be written."""
    prefix = Path(d.cache_dir) / f"stdlib_py{sys.version_info.major}{sys.version_info.minor}"
    try:
        train, val = build_stdlib_corpus(prefix, d.val_fraction, max_bytes=d.max_bytes, include_tests=d.include_tests)
    except OSError as exc:
        raise ConfigError(f"data.cache_dir: cannot build the stdlib corpus in {d.cache_dir!r}: {exc}") from None
    return DataSplits(TokenDataset(train), TokenDataset(val), "data.kind", "data.kind")


KIND = DataKind(build_stdlib, writes_cache=True)
"""The registry entry (``te_npu.training.data.DATA_KINDS["stdlib"]``): no optional ``data.*`` key."""
