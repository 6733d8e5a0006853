"""The launcher's one-line summary of a failed job: which rank failed first, and how.

torchrun's own choice of "first failure" is the smallest timestamp, in whole seconds, then the
smallest rank: after ``kill -9`` of rank 1 it names rank 0, whose collective then failed with
"Connection closed by peer" in the same second. Here a rank killed by a signal comes first (a
signal comes from outside the job; the others' errors are its consequence), then the earliest,
then the lowest rank -- except the ranks torchrun stopped itself after the first failure (its
SIGTERM to a rank still starting, its SIGKILL 30 s later to a stopped one), which come last. A rank killed by SIGBUS / SIGSEGV is diagnosed from the files it had
memory-mapped (``te_npu.training.mapped_files``): the data file whose size changed under it is
named, and the job's exit code is 2 (a data fault), never only the signal.

A lost node (multi-node: another node's launcher killed, its host down): this node's ranks see
their collectives break on closed connections, find which peers are gone
(``te_npu.training.guards.stall.StallWatch.lost_peers``) and leave that line in the launcher's folder
(``leave_note``); the summary is then that line, ``launch: node 1 (ranks 2-3, host h) lost: ...``,
exit 4 -- unless a rank of this node was killed by a signal (this launcher saw that itself).
"""
from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any

from te_npu.training import mapped_files

__all__ = ["EXIT_DATA", "first_failure", "summarize", "exit_code_of", "leave_note", "lost_note"]

EXIT_DATA = 2
"""A rank read a data file that changed under it: a data fault, like a configuration error."""
_DATA_SIGNALS = (signal.SIGBUS, signal.SIGSEGV)
_NOTE = "lost_rank{}.txt"


def leave_note(folder: str, rank: int, line: str) -> None:
    """A rank's line about a lost peer, for its launcher's summary (``folder``: ``TE_NPU_MAPPED_FILES``)."""
    path = os.path.join(folder, _NOTE.format(rank))
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(line.strip())
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # the launcher's folder is gone: the launcher is too


def lost_note(folder: str | None) -> str | None:
    """The lowest rank's lost-peer line left in ``folder``, or None."""
    if not folder or not os.path.isdir(folder):
        return None
    notes = sorted((int(name[len("lost_rank"):-len(".txt")]), name) for name in os.listdir(folder)
                   if name.startswith("lost_rank") and name.endswith(".txt") and name[9:-4].isdigit())
    for _, name in notes:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                line = f.read().strip()
        except OSError:
            continue
        if line:
            return line
    return None


def exit_code_of(exitcode: int) -> int:
    """A worker's ``exitcode`` (negative: killed by that signal) as a shell exit status."""
    return 128 - exitcode if exitcode < 0 else exitcode


_TORCHRUN_KILL_AFTER_S = 15
"""A rank's SIGKILL this long after the first rank exited is torchrun's (it SIGKILLs a rank that
has not stopped 30 s after its SIGTERM: a stopped or blocked rank), not the job's cause."""


def first_failure(failures: Mapping[int, Any]) -> int:
    """The rank that failed first among torchrun's ``{rank: ProcessFailure}`` (see the module doc).

    torchrun's failures include the ranks it stopped itself once one had failed (SIGTERM, then
    SIGKILL after its 30 s grace): a death by SIGTERM (a running rank's handler turns an outside
    SIGTERM into exit 143, so only torchrun's stop of a rank still starting dies of it) and a
    SIGKILL long after the first exit are consequences, not causes."""
    exits = [f.timestamp for f in failures.values() if f.exitcode >= 0]

    def tier(f) -> int:  # 0: killed from outside (the cause), 1: exited, 2: stopped by torchrun
        if f.exitcode >= 0:
            return 1
        if exits and (-f.exitcode == signal.SIGTERM or f.timestamp > min(exits) + _TORCHRUN_KILL_AFTER_S):
            return 2
        return 0

    return min(failures, key=lambda r: (tier(failures[r]), failures[r].timestamp, r))


def summarize(failures: Mapping[int, Any], mapped_dir: str | None) -> tuple[str | None, int]:
    """``(line, exit code)`` of a failed job; ``line`` None when the failing rank's own report
    says it all (a configuration error)."""
    rank = first_failure(failures)
    failure = failures[rank]
    code = exit_code_of(failure.exitcode)
    others = "".join(f"; then rank {r} (pid {f.pid}) {_how(f.exitcode)}" for r, f in sorted(failures.items()) if r != rank)
    if failure.exitcode < 0:
        signum = -failure.exitcode
        what = f"rank {rank} (pid {failure.pid}) was killed by {_name(signum)}"
        if signum in _DATA_SIGNALS:
            changed = mapped_files.diagnose(mapped_dir, rank) if mapped_dir else []
            if changed:
                return (f"launch: the job failed: {what} reading a file that changed under it: {'; '.join(changed)} "
                        f"(truncated or replaced while the job ran; a data fault, exit {EXIT_DATA}){others}"), EXIT_DATA
            return f"launch: the job failed: {what} (no memory-mapped file of it changed size){others}", code
        return f"launch: the job failed: {what}, the first rank to fail{others}", code
    lost = lost_note(mapped_dir)
    if lost is not None:  # another node is gone: this node's ranks named it
        return f"launch: {lost}", code
    if code == 2:
        return None, code  # a ConfigError: the worker's one line says it all
    return (f"launch: the job failed with exit code {code} (rank {rank}, pid {failure.pid}, failed first; its report is "
            f"above){others}"), code


def _how(exitcode: int) -> str:
    return f"was killed by {_name(-exitcode)}" if exitcode < 0 else f"exited {exitcode}"


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
