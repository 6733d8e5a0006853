"""One orchestrator per report folder, and the jobs it starts owned by it (the acceptance run:
``te_npu.testing.acceptance.orchestration``).

``JobFolder(out)`` is entered once per run of the orchestrator:

1. it locks ``<out>/te_npu.lock`` (``te_npu.distributed.storage.lock``: a POSIX lock the kernel
   drops when the holder dies, even by ``kill -9``); a second orchestrator on the same folder
   fails at once, in one line naming the pid that holds it;
2. it then makes sure no job started by an earlier orchestrator of the folder is still alive:
   ``<out>/running_job.json`` names the process group of the job running at any moment; a
   group still alive is waited for (it dies with its owner: ``te_npu.process_tree``) up to
   ``wait_s``, then refused naming it -- never two jobs on one folder.

``run(cmd, log)`` starts a job (the launcher) with ``process_tree.start_owned``: its own process
group, which dies with this process whatever ends it (the owner pipe); an exception here
(Ctrl-C, SIGTERM turned into one) ends the group first (SIGTERM, SIGKILL after a grace). It
returns the launcher's exit code, or None when the launcher was ended by a signal (an
interrupted job, whose phases must not be judged).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from te_npu import process_tree
from te_npu.distributed.storage.lock import FolderLock, acquire_folder_lock
from te_npu.errors import ConfigError

__all__ = ["JobFolder", "RUNNING_NAME", "terminate_on_sigterm"]

RUNNING_NAME = "running_job.json"


class JobFolder:
    """The folder's lock and the one job running in it (module doc)."""

    def __init__(self, out: str | os.PathLike, *, key: str = "--out", wait_s: float = 30.0):
        self.out, self.key, self.wait_s = Path(out), key, wait_s
        self.lock: FolderLock | None = None

    def __enter__(self) -> JobFolder:
        self.lock = acquire_folder_lock(str(self.out), key=self.key,
                                        advice="one acceptance run per folder: wait for it to end or stop it, or "
                                               f"give this run another {self.key}")
        try:
            self._wait_for_earlier_job()
        except BaseException:
            self.lock.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.lock is not None:
            self.lock.release()

    def run(self, cmd: list[str], log: Path, **popen_kwargs) -> int | None:
        """Start ``cmd`` owned (its output into ``log``), wait; its exit code, None if a signal ended it."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            proc = process_tree.start_owned(cmd, stdout=f, stderr=subprocess.STDOUT, **popen_kwargs)
        record = self.out / RUNNING_NAME
        _write_json(record, {"pgid": proc.pid, "host": socket.gethostname(), "cmd": cmd[:6],
                             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        try:
            code = proc.wait()
        except BaseException:
            process_tree.end_owned(proc)
            raise
        process_tree.end_owned(proc, grace_s=0)  # anything the launcher left in its group
        record.unlink(missing_ok=True)
        return None if code < 0 else code

    def _wait_for_earlier_job(self) -> None:
        record = self.out / RUNNING_NAME
        try:
            earlier = json.loads(record.read_text())
        except (OSError, ValueError):
            return
        pgid = earlier.get("pgid")
        if not isinstance(pgid, int) or earlier.get("host") != socket.gethostname():
            return
        if not process_tree.wait_group_gone(pgid, self.wait_s):
            raise ConfigError(f"{self.key}: {str(self.out)!r}: a job of an earlier run (process group {pgid}, started "
                              f"{earlier.get('started', '?')}) is still alive {self.wait_s:.0f} s after its owner "
                              f"ended; stop it (kill -- -{pgid}) before re-running")
        record.unlink(missing_ok=True)


def terminate_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit(143)`` in this (main) thread, so ``run`` ends its job first."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)
