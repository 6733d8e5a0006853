"""The launcher's one-line summary of a failed job: which rank failed first, and how.

torchrun's own choice of "first failure" is the smallest timestamp, in whole seconds, then the
smallest rank: after ``kill -9`` of rank 1 it names rank 0, whose collective then failed with
"Connection closed by peer" in the same second. Here a rank killed by a signal comes first (a
signal comes from outside the job; the others' errors are its consequence), then the earliest,
then the lowest rank. A rank killed by SIGBUS / SIGSEGV is diagnosed from the files it had
memory-mapped (``te_npu.training.mapped_files``): the data file whose size changed under it is
named, and the job's exit code is 2 (a data fault), never only the signal.
"""
from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

from te_npu.training import mapped_files

__all__ = ["EXIT_DATA", "first_failure", "summarize", "exit_code_of"]

EXIT_DATA = 2
"""A rank read a data file that changed under it: a data fault, like a configuration error."""
_DATA_SIGNALS = (signal.SIGBUS, signal.SIGSEGV)


def exit_code_of(exitcode: int) -> int:
    """A worker's ``exitcode`` (negative: killed by that signal) as a shell exit status."""
    return 128 - exitcode if exitcode < 0 else exitcode


def first_failure(failures: Mapping[int, Any]) -> int:
    """The rank that failed first among torchrun's ``{rank: ProcessFailure}`` (see the module doc)."""
    return min(failures, key=lambda r: (failures[r].exitcode >= 0, failures[r].timestamp, r))


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
