"""Disk space: a check before a large write, and a full disk said in one line.

A full disk surfaces from deep inside a writer, often without an errno (torch's zip writer
reports ``unexpected pos 704 vs 598``; DCP wraps it in a ``CheckpointException`` per rank).
``check_free_space`` refuses a write that cannot fit before it starts; ``space_error`` turns a
failed write into a ``DiskFullError`` when the disk is the cause: ``ENOSPC`` / ``EDQUOT``
anywhere in the exception's chain (or among DCP's per-rank failures, a ``CheckpointException``,
which is a ``BaseException``), or the folder's free space now under ``FULL_BELOW``; never for an
interruption. ``te_npu.training.job`` prints a ``DiskFullError`` in one line.
"""
from __future__ import annotations

import errno
import os
import shutil

from te_npu.errors import exception_chain

__all__ = ["DiskFullError", "FULL_BELOW", "free_bytes", "check_free_space", "space_error", "raise_if_disk_full",
           "format_bytes"]

FULL_BELOW = 16 << 20
"""A write that failed while its folder has less free space than this failed for lack of space."""
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(RuntimeError):
    """A write did not fit (or would not): the message names the folder, the bytes and what to do."""


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes free for this process on the filesystem of ``path`` (its nearest existing ancestor)."""
    path = os.path.abspath(os.fspath(path))
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return shutil.disk_usage(path).free


def format_bytes(n: int | float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def check_free_space(path: str | os.PathLike, needed: int, what: str, *, free: int | None = None) -> None:
    """``DiskFullError`` if ``path``'s filesystem has less than ``needed`` bytes free (``free``:
    a value measured already, e.g. by one rank for all)."""
    free = free_bytes(path) if free is None else free
    if free < needed:
        raise DiskFullError(f"{what}: {os.fspath(path)} has {format_bytes(free)} free, the write needs about "
                            f"{format_bytes(needed)}; nothing was written: free space there or use a larger disk")


def space_error(exc: BaseException, path: str | os.PathLike, needed: int, what: str) -> DiskFullError | None:
    """A ``DiskFullError`` describing ``exc`` if it was caused by a full disk at ``path``, else None."""
    if isinstance(exc, DiskFullError):
        return exc
    causes = exception_chain(exc)
    if any(not isinstance(e, Exception) and type(e).__name__ != "CheckpointException" for e in causes):
        return None  # an interruption (SIGINT / SIGTERM) is not a full disk, whatever the free space
    full = any(isinstance(e, OSError) and e.errno in _SPACE_ERRNOS for e in causes)
    try:
        free = free_bytes(path)
    except OSError:
        free = None
    if not full and not (free is not None and free < FULL_BELOW):
        return None
    left = "" if free is None else f" ({format_bytes(free)} free now)"
    return DiskFullError(f"{what}: no space left on the device of {os.fspath(path)}{left}; the write needs about "
                         f"{format_bytes(needed)} ({type(exc).__name__}: {_first_line(exc)})")


def raise_if_disk_full(exc: BaseException, path: str | os.PathLike, needed: int, what: str) -> None:
    """Inside an ``except`` block: raise ``space_error``'s ``DiskFullError`` (from ``exc``) if the
    disk is the cause; return otherwise, for the caller's bare ``raise``."""
    full = space_error(exc, path, needed, what)
    if full is not None and full is not exc:
        raise full from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else repr(exc)
