"""Child process trees that die with the process that started them, whatever ends it.

``start_owned(cmd)`` starts ``cmd`` in a session (and process group) of its own and hands it the
read end of a pipe whose only write end stays in this process (``TE_NPU_OWNER_FD`` names the
child's end). The child calls ``watch_owner()`` first thing: a daemon thread blocks reading that
pipe, and when it reads end-of-file -- the owner is gone, even by ``kill -9``, since the kernel
closes a dead process's descriptors -- it kills the child's whole process group with SIGKILL:
the child itself and everything it started that did not leave the group (ninja and the
compilers of a native build, torchrun's agent). End-of-file is also what a child sees when its
owner died before it started watching, so there is no window at start-up.

Why not ``PR_SET_PDEATHSIG`` alone: it kills the one process, not the tree under it (ninja's
``cc1plus`` live on, adopted by pid 1); it fires on the death of the parent *thread*; and it is
Linux only. The pipe works on every POSIX system. Process trees that move into sessions of their
own (torchrun's workers) are not reached by the group kill: they must watch their parent
themselves (``te_npu.training.job``: ``PR_SET_PDEATHSIG`` plus a parent-pid poll).

``end_owned(proc)`` is the orderly way out for the owner (an exception, Ctrl-C): SIGTERM to the
group, SIGKILL after a grace period. Stdlib only.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

__all__ = ["OWNER_FD_ENV", "start_owned", "end_owned", "watch_owner", "group_alive"]

OWNER_FD_ENV = "TE_NPU_OWNER_FD"


def start_owned(cmd: list[str], *, env: dict[str, str] | None = None, **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd)`` in a new session that holds the owner pipe (module doc); the
    child must call ``watch_owner()`` for its group to die with this process."""
    read_end, write_end = os.pipe()  # both non-inheritable: only the child gets read_end (pass_fds)
    env = dict(os.environ if env is None else env, **{OWNER_FD_ENV: str(read_end)})
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, pass_fds=(read_end,), **popen_kwargs)
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    proc.owner_pipe = write_end  # closed by end_owned / when this process dies
    return proc


def end_owned(proc: subprocess.Popen, grace_s: float = 5.0) -> int:
    """Stop ``proc``'s process group: SIGTERM, then SIGKILL after ``grace_s``; its exit status."""
    if proc.poll() is None:
        _killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):  # then SIGKILL below
            proc.wait(timeout=grace_s)
    _killpg(proc.pid, signal.SIGKILL)  # stragglers of the group, even after its leader has gone
    code = proc.wait()
    release(proc)
    return code


def release(proc: subprocess.Popen) -> None:
    """Close the owner pipe of an ended ``proc`` (its group then dies if anything is left in it)."""
    fd = getattr(proc, "owner_pipe", -1)
    if fd >= 0:
        os.close(fd)
        proc.owner_pipe = -1


def watch_owner() -> bool:
    """In a child of ``start_owned``: kill this process group when the owner pipe reaches
    end-of-file (the owner died). False when this process was not started that way."""
    fd = os.environ.pop(OWNER_FD_ENV, None)  # popped: this process's own children do not inherit it
    if fd is None:
        return False
    fd = int(fd)

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 64):  # the owner never writes: returns b"" (EOF) once it is gone
                continue
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="te_npu-owner-watch", daemon=True).start()
    return True


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still alive (zombies not yet reaped count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Poll until group ``pgid`` has no process left, up to ``timeout_s``; whether it is gone."""
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _killpg(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group has gone already
        os.killpg(pgid, signum)
