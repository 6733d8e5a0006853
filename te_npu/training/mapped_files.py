"""Which memory-mapped file killed a rank: a SIGBUS / SIGSEGV is diagnosed from outside.

The token data (``.bin`` / ``.idx``, te_npu token files) is read through ``np.memmap``. A file
truncated or replaced by a shorter one while the job runs turns the next read of a page past its
new end into SIGBUS, and the rank dies in the kernel's hands: no Python handler runs, nothing
is printed. So the ranks leave a record and the launcher reads it:

- ``record(folder, rank)`` (the trainer, once its data is open): every regular file this process
  has mapped (``/proc/self/maps``) with its size then, as ``<folder>/rank<R>.json``;
- ``diagnose(folder, rank)`` (the launcher, when rank ``R`` died of SIGBUS or SIGSEGV): each
  recorded file whose size changed since (or that is gone), in words; [] if none did.

The folder is the launcher's (``te_npu.training.launch`` passes it as ``TE_NPU_MAPPED_FILES``;
``te_npu.training.runtime.launch_env`` reads it). Linux only (``/proc``); elsewhere nothing is recorded.
"""
from __future__ import annotations

import json
import os

__all__ = ["ENV", "record", "diagnose", "mapped_files"]

ENV = "TE_NPU_MAPPED_FILES"
"""The environment variable naming the folder the ranks record their mapped files in."""


def mapped_files(maps: str = "/proc/self/maps") -> dict[str, int]:
    """``{path: size in bytes now}`` of every regular file mapped into this process ({} without /proc)."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    sizes: dict[str, int] = {}
    for line in lines:
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        if not path.startswith("/") or path in sizes or path.endswith(" (deleted)"):
            continue
        try:
            sizes[path] = os.stat(path).st_size
        except OSError:
            continue
    return sizes


def record(folder: str | None, rank: int) -> None:
    """Write this process's mapped files and their sizes to ``<folder>/rank<rank>.json`` (no-op without a folder)."""
    if not folder:
        return
    path = os.path.join(folder, f"rank{rank}.json")
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), "files": mapped_files()}, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # a diagnosis aid: never a reason to stop the job


def diagnose(folder: str, rank: int) -> list[str]:
    """What changed, for each file rank ``rank`` had mapped whose size is not what it was
    (``"/d/train.bin is now 4096 bytes, 819200 when the job mapped it"``); [] if none or no record."""
    try:
        with open(os.path.join(folder, f"rank{rank}.json"), encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    changed = []
    for path, size in sorted(files.items()):
        try:
            now = os.stat(path).st_size
        except OSError:
            changed.append(f"{path} is gone ({size} bytes when the job mapped it)")
            continue
        if now != size:
            changed.append(f"{path} is now {now} bytes, {size} when the job mapped it")
    return changed
