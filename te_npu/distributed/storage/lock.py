"""One job per checkpoint folder: an exclusive lock on ``<dir>/te_npu.lock``, held by rank 0.

The lock is a POSIX record lock (``fcntl.lockf``) on the whole file, taken without waiting.
The kernel releases it when the holding process dies (SIGKILL included), it is not inherited
by forked children, and it works on NFS (through the lock manager). While held, the file holds
the holder's identity as JSON (``host``, ``pid``, ``started`` ISO time, ``argv``); a clean
release adds ``released``. A second job on the same folder fails at start naming the holder;
a file whose holder never released it (killed) but whose lock is free is a stale lock: it is
taken over and the takeover is reported.

POSIX locks belong to the process, and closing *any* descriptor of the file drops them: the
holder never opens the file a second time (it reads and writes through the one descriptor).
Stdlib only, so a test can hold a lock from a forked process cheaply.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass

from te_npu.errors import ConfigError

__all__ = ["LOCK_NAME", "FolderLock", "acquire_folder_lock", "describe_holder"]

LOCK_NAME = "te_npu.lock"


@dataclass
class FolderLock:
    """A held lock; ``stale_holder`` is the identity of a previous holder that died holding it."""

    path: str
    fd: int
    holder: dict
    stale_holder: dict | None = None
    created_file: bool = False
    created_dir: bool = False

    def release(self, *, discard: bool = False) -> None:
        """Mark the file released and drop the lock (idempotent). ``discard`` (a job that failed
        before writing anything): a lock file this lock created is removed instead, and the
        folder too when this lock created it and nothing else is in it, so a refused start leaves
        the disk as it found it."""
        if self.fd < 0:
            return
        try:
            if discard and self.created_file:
                os.unlink(self.path)  # before the close: no other job can take this file's lock meanwhile
            else:
                _write(self.fd, {**self.holder, "released": _now()})
        except OSError:
            pass  # the lock goes with the descriptor either way
        finally:
            os.close(self.fd)  # closing the only descriptor releases the POSIX lock
            self.fd = -1
        if discard and self.created_dir:
            try:
                os.rmdir(os.path.dirname(self.path))  # only if empty
            except OSError:
                pass


def acquire_folder_lock(directory: str, *, key: str = "checkpoint.dir", advice: str | None = None) -> FolderLock:
    """Create ``directory`` if needed and lock it for this process, or raise ``ConfigError``
    naming the holder (``key`` is the config field the message names, ``advice`` the message's
    end; default: the checkpoint folder's)."""
    try:
        created_dir = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, LOCK_NAME)
        created_file = not os.path.exists(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot create the lock file in {directory!r}: {exc.strerror or exc}") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        previous = _read(fd)
        os.close(fd)
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            raise ConfigError(f"{key}: cannot lock {path!r}: {exc.strerror or exc}") from None
        advice = advice or ("two jobs must not write one checkpoint folder: wait for that job to end or stop it, or "
                            "give this run another checkpoint.dir")
        raise ConfigError(f"{key}: {directory!r} is in use by another job ({_describe_holder_of(path, previous)}; "
                          f"lock file {path}); {advice}") from None
    previous = _read(fd)
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": _now(), "argv": sys.argv}
    try:
        _write(fd, holder)
    except OSError as exc:
        os.close(fd)
        raise ConfigError(f"{key}: {directory!r} is not writable: {exc.strerror or exc}") from None
    stale = previous if previous and "pid" in previous and "released" not in previous else None
    return FolderLock(path, fd, holder, stale, created_file=created_file, created_dir=created_dir)


def describe_holder(holder: dict | None) -> str:
    """``host h, pid p, started t`` of a lock file's content (a record, not a claim that it runs)."""
    if not holder:
        return "holder unknown: the lock file was empty"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {holder.get('started', '?')}"


def _describe_holder_of(path: str, holder: dict | None) -> str:
    """Who holds the lock on ``path`` now: the recorded holder, checked against this host's
    processes and, on Linux, the kernel's own table of POSIX locks."""
    text = describe_holder(holder)
    actual = _local_lock_holder(path)
    recorded = holder.get("pid") if holder and holder.get("host") == socket.gethostname() else None
    if actual is not None and actual != recorded:
        return f"{text} according to the lock file, but the kernel says pid {actual} on this host holds the lock"
    if isinstance(recorded, int):
        return text + ("; it is running" if _alive(recorded) else "")
    return text


def _local_lock_holder(path: str) -> int | None:
    """The pid of the local process that holds a POSIX lock on ``path`` (``/proc/locks``; None
    where that table does not exist or lists no local holder, e.g. a lock taken over NFS)."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "POSIX" and fields[5] == inode:
            try:
                return int(fields[4])
            except ValueError:
                return None
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 1 << 16, 0)
        return json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return None


def _write(fd: int, record: dict) -> None:
    data = (json.dumps(record) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
