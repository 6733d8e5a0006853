"""The on-disk cache of Megatron's sample indices, which knows what it was built from.

``<cache_dir>/megatron_indices/<md5>-<Class>-<split>-<name>.npy`` plus a ``-description.txt``
(the md5 is of it: path, split, seed, sequence length, samples, as Megatron's
``--data-cache-path`` holds them) and, written last, a ``-check.json``:

    {"format": "te_npu index check 1",
     "built_from": {...},                      # what the arrays were computed from (below)
     "files": {"<name>.npy": {"bytes": n, "crc32": c}, ...}}

``built_from`` is the caller's record of the inputs the description does not pin: for a GPT
split the SHA-256 of its sequence lengths (``int32 [S]``, 4 bytes per sequence: the only part
of the data the indices depend on; the pointers are checked against the lengths when the
``.idx`` is opened, the document boundaries and token values do not enter the indices), so a
dataset re-segmented in place under the same sizes is seen. At open every array file is also
checked against its size and CRC-32, so a cache corrupted in place is seen the same way (about
1 s per GiB of index on a loaded core, once per open).

A cache that does not match (other inputs, a bad checksum, no check record: an older te_npu
or an interrupted write) is rebuilt, and ``notes`` gets one line naming the data and what
changed; where it cannot be rebuilt (``may_build=False``: other ranks map it already; or its
folder is not writable) ``StaleIndexCache`` is raised with that line. Files are written under
temporary names and renamed (a reader that mapped the old ones keeps them), the check record
last; arrays are read memory-mapped, never unpickled.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from te_npu.errors import ConfigError

__all__ = ["IndexCache", "StaleIndexCache", "CHECK_FORMAT", "file_crc32"]

CHECK_FORMAT = "te_npu index check 1"
_READ = 1 << 24


class StaleIndexCache(ConfigError):
    """A cache that does not match its data and cannot be rebuilt here (one-line message)."""


def file_crc32(path: Path) -> int:
    """CRC-32 of a whole file, read in 16 MiB chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            crc = zlib.crc32(chunk, crc)
    return crc


class IndexCache:
    """Index arrays kept in ``<cache_dir>/megatron_indices`` under the md5 of their description,
    checked against ``built_from`` and their own checksums at open (module doc). ``label``
    names the data in messages."""

    def __init__(self, cache_dir: str | os.PathLike, description: dict[str, Any], cls: str, split: str, *,
                 built_from: dict[str, Any] | None = None, label: str = ""):
        self.description = json.dumps(description, indent=4, sort_keys=True)
        digest = hashlib.md5(self.description.encode(), usedforsecurity=False).hexdigest()
        self.folder = Path(cache_dir) / "megatron_indices"
        self.base = f"{digest}-{cls}-{split}"
        self.built_from = json.loads(json.dumps(built_from or {}))  # plain JSON values, as read back
        self.label = label or self.base
        self.notes: list[str] = []

    def path(self, name: str) -> Path:
        return self.folder / f"{self.base}-{name}"

    def load(self, names: Sequence[str]) -> tuple[dict[str, np.ndarray] | None, str | None]:
        """``(arrays memory-mapped, None)`` for a cache that matches, else ``(None, why)``: why is
        None when there is no cache (nothing to report), else what is wrong with the one there."""
        try:
            if self.path("description.txt").read_text() != self.description:
                return None, None
        except OSError:
            return None, None
        try:
            check = json.loads(self.path("check.json").read_text())
        except (OSError, ValueError):
            return None, "it has no readable check record (written by an older te_npu, or its write was interrupted)"
        if not isinstance(check, dict) or check.get("format") != CHECK_FORMAT:
            return None, f"its check record is not {CHECK_FORMAT!r}"
        changed = _changes(check.get("built_from"), self.built_from)
        if changed:
            return None, f"the data changed since it was built ({changed})"
        files = check.get("files") or {}
        arrays = {}
        for name in names:
            path = self.path(f"{name}.npy")
            expected = files.get(f"{name}.npy") or {}
            try:
                size = path.stat().st_size
                if size != expected.get("bytes"):
                    return None, f"{path.name} holds {size} bytes, its check record {expected.get('bytes')}"
                if file_crc32(path) != expected.get("crc32"):
                    return None, f"{path.name} does not match its CRC-32 (changed or corrupted in place)"
                arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as exc:
                return None, f"{path.name} cannot be read ({exc})"
        return arrays, None

    def load_or_build(self, names: Sequence[str], build: Callable[[], dict[str, np.ndarray]], *,
                      may_build: bool = True) -> dict[str, np.ndarray]:
        """The cached arrays when they match, else ``build()`` saved atomically and returned mapped
        (a stale cache is reported in ``notes``); ``StaleIndexCache`` where it cannot be written."""
        cached, why = self.load(names)
        if cached is not None:
            return cached
        where = f"the sample index cache {self.folder}/{self.base}-*"
        if not may_build:
            raise StaleIndexCache(f"{self.label}: {where} {'does not exist' if why is None else 'is stale: ' + why}; "
                                  "it is not rebuilt here because other ranks map it already (restart the job: "
                                  "rank 0 rebuilds it before the others read it)")
        try:
            self._write(names, build())
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            state = "cannot be written" if why is None else f"is stale ({why}) and cannot be rebuilt"
            raise StaleIndexCache(f"{self.label}: {where} {state}: {exc.strerror} (give data.cache_dir a writable "
                                  "folder)") from None
        if why is not None:
            self.notes.append(f"{self.label}: rebuilt {where}: {why}")
        loaded, again = self.load(names)
        if loaded is None:
            raise OSError(f"{self.folder}: the index files just written under {self.base}-* cannot be read back "
                          f"({again})")
        return loaded

    def _write(self, names: Sequence[str], arrays: dict[str, np.ndarray]) -> None:
        """Arrays, description, then the check record (the commit point), each renamed into place."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = f".tmp{os.getpid()}"
        files = {}
        for name in names:
            target = self.path(f"{name}.npy")
            part = target.with_name(target.name + tmp)
            with open(part, "wb") as f:
                np.save(f, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            files[target.name[len(self.base) + 1:]] = {"bytes": part.stat().st_size, "crc32": file_crc32(part)}
            os.replace(part, target)
        check = {"format": CHECK_FORMAT, "built_from": self.built_from, "files": files}
        for name, text in (("description.txt", self.description), ("check.json", json.dumps(check, indent=1))):
            target = self.path(name)
            target.with_name(target.name + tmp).write_text(text)
            os.replace(target.with_name(target.name + tmp), target)


def _changes(recorded: Any, now: dict[str, Any]) -> str:
    """What differs between two ``built_from`` records, as ``key: old -> new`` items ('' if none)."""
    recorded = recorded if isinstance(recorded, dict) else {}
    keys = sorted(set(recorded) | set(now))
    return "; ".join(f"{k}: {_short(recorded.get(k))} -> {_short(now.get(k))}" for k in keys
                     if recorded.get(k) != now.get(k))


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text[:17] + '..."' if isinstance(value, str) and len(value) > 16 else text
