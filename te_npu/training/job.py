"""One rank of a training job: how it starts, stops and dies ("fail together").

``run_job(body)`` runs ``body(stop)`` (set up + train) and returns the rank's exit code:

- an exception on any rank is reported once for the whole job, by the first rank that
  fails (decided through the process group's store): one line for a ``ConfigError``
  or a stop rule, otherwise one line and that rank's traceback. The other ranks (whose
  collectives now fail) print nothing and exit with the same code. No barrier runs on the
  error path: the process group is aborted and the rank leaves with ``os._exit``, so
  nothing waits for a peer that is gone; torchrun then stops the rest.
- SIGINT stops at once (nothing half-saved: checkpoint saves are atomic), SIGTERM too unless
  the trainer takes it gracefully (``checkpoint.save_on_sigterm``: finish the step, save,
  exit). A rank still alive ``SIGNAL_GRACE_S`` after the signal (blocked in a collective,
  where Python handlers cannot run) is ended by a watchdog thread, which sees the signal at
  once through ``signal.set_wakeup_fd``; a second signal ends it immediately.
- under torchrun a rank exits when its launcher dies (``PR_SET_PDEATHSIG`` on Linux, and
  the watchdog polls the parent pid), so a killed launcher leaves no orphan training on.
- a rank that stops making progress without failing (SIGSTOP, D state, a vanished host) is
  found by its peers' stall watch (``te_npu.training.guards.stall``, started by the trainer once the
  process group exists): the first rank to see it prints one line naming the stalled rank and
  every rank that sees it leaves with exit code 4. A collective that times out first (the
  process group's timeout, ``training.collective_timeout_s``; ``is_collective_timeout``) is
  reported the same way, exit 4: the watch's line naming the rank the others waited for (a
  silent one, one behind, or one alive but busy outside the collective).
- a lost peer: a collective that broke on a closed connection ("Connection closed / reset by
  peer") whose peer did not fail on its own (``StallWatch.lost_peers``: its process ended, or
  its node is gone -- a killed launcher, a host down) is exit 4 too, one line naming the node
  (``node 1 (ranks 2-3, host h) lost: ...``) or the ranks. Under ``te_npu.training.launch`` the
  ranks leave that line to their launcher (``launch_report.leave_note``), which prints it once
  per surviving node as its summary; under a plain torchrun the first rank to fail prints it.
- a full disk (``te_npu.distributed.storage.disk_space.DiskFullError``) is one line too, without a
  traceback: the folder, the bytes needed, what is left.

Exit codes: 0 done, 1 error, 2 configuration error (before anything was built), 3 stopped
by a divergence rule, 4 a stalled or lost rank (or node) ended the job, 128 + signal number when
interrupted.

The launcher's environment is read by ``te_npu.training.runtime.launch_env``, which also holds the
``StopRequest`` the signal handlers share with the Trainer; this module's only private torch touch
is ``_job_store``.
"""
from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Callable

import torch.distributed as dist

from te_npu.compat import default_store
from te_npu.distributed.storage.disk_space import DiskFullError
from te_npu.errors import ConfigError, exception_chain
from te_npu.training import launch_report
from te_npu.training.guards.divergence import TrainingDiverged
from te_npu.training.guards.stall import EXIT_STALLED
from te_npu.training.runtime import LaunchEnv, StopRequest, launch_env

__all__ = [
    "EXIT_OK",
    "EXIT_ERROR",
    "EXIT_CONFIG",
    "EXIT_DIVERGED",
    "EXIT_STALLED",
    "SIGNAL_GRACE_S",
    "JobInterrupted",
    "exit_code_for",
    "is_collective_timeout",
    "lost_a_peer",
    "root_cause",
    "run_job",
]

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_DIVERGED = 0, 1, 2, 3
SIGNAL_GRACE_S = 10.0
"""Seconds a rank may take to stop after SIGINT / SIGTERM before the watchdog ends it."""
REPEAT_SIGNAL_S = 2.0
"""A signal this long after the first one ends the rank at once ("press Ctrl-C again");
sooner, it is the same stop (torchrun forwards SIGINT, then SIGTERM, within milliseconds)."""
ERROR_PATH_DEADLINE_S = 10.0
"""Seconds the error path (report, abort) may take before the watchdog ends the rank."""
_PR_SET_PDEATHSIG = 1
_FAILURE_KEY = "te_npu/job_failure"


class JobInterrupted(BaseException):
    """SIGINT / SIGTERM arrived (a ``BaseException``, like ``KeyboardInterrupt``).

    ``args`` is ``(signum,)`` so the exception pickles: DCP gathers a rank's exception to its
    coordinator and re-raises it wrapped in a ``CheckpointException`` on every rank.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(int(signum))
        self.signum = int(signum)

    def __str__(self) -> str:
        return f"interrupted by {signal.Signals(self.signum).name}"


def root_cause(exc: BaseException) -> BaseException:
    """``exc``, or what is behind it: an interruption anywhere in its chain (a signal that lands
    inside ``torch.save`` surfaces as the writer's "unexpected pos" error, raised while handling
    it, possibly carried by DCP's ``CheckpointException`` from another rank), or the config error
    / stop rule a ``CheckpointException`` carries from a rank."""
    chain = exception_chain(exc)
    for inner in chain:  # an interruption anywhere: whatever it broke on the way is its consequence
        if isinstance(inner, (JobInterrupted, KeyboardInterrupt)):
            return inner
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, (ConfigError, TrainingDiverged)):
                return inner
    return exc


def exit_code_for(exc: BaseException) -> int:
    """The exit code of a rank that ended with ``exc`` (see the module doc)."""
    exc = root_cause(exc)
    if isinstance(exc, ConfigError):
        return EXIT_CONFIG
    if isinstance(exc, TrainingDiverged):
        return EXIT_DIVERGED
    if isinstance(exc, JobInterrupted):
        return 128 + exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    return EXIT_ERROR


_TIMEOUT_WORDS = ("timed out", "timeout caused", "operation timeout", "socket timeout", "wait timeout")


def is_collective_timeout(exc: BaseException) -> bool:
    """``exc`` (or what is behind it) is a process group's timeout: gloo's ``Timed out waiting
    ... for recv operation`` / ``Application timeout caused pair closure`` (``RuntimeError``),
    NCCL's / HCCL's watchdog ``DistBackendError`` ("... timed out" / "Watchdog caught collective
    operation timeout"), a store wait's ``DistStoreError`` timeout."""
    return any(isinstance(inner, RuntimeError) and any(w in str(inner).lower() for w in _TIMEOUT_WORDS)
               for inner in exception_chain(exc))


def run_job(body: Callable[[StopRequest], None], *, stderr=None) -> int:
    """Run ``body(stop)`` as one rank of a job; return its exit code, or leave the process with
    ``os._exit`` when a multi-rank job fails (see the module doc)."""
    stderr = stderr or sys.stderr
    env = launch_env()
    stop = StopRequest()
    guard = _SignalGuard(stop, env, stderr)
    stop.watch.on_stall = guard.stalled
    guard.install()
    try:
        body(stop)
    except BaseException as exc:  # noqa: BLE001 - every way out of a rank goes through here
        guard.failing = True
        exc = root_cause(exc)
        code = exit_code_for(exc)
        guard.watchdog.arm(ERROR_PATH_DEADLINE_S, code, "the error path did not finish")
        # a rank of a multi-rank job leaves with os._exit even when its process group is already
        # (half) destroyed -- an interruption inside close(): an interpreter that finalizes with a
        # live gloo group aborts ("terminate called without an active exception")
        multi_rank = (dist.is_initialized() and dist.get_world_size() > 1) or stop.watch.started
        if multi_rank:
            stop.watch.mark_failing()  # a peer whose collective breaks on our connection: we report ourselves
        lost = stop.watch.lost_peers() if multi_rank and code == EXIT_ERROR and _lost_a_peer(exc) else None
        if lost is not None:  # a peer's process ended without failing: killed, or its node is gone
            exc, code = _Lost(lost), EXIT_STALLED
        stall = stop.watch.diagnose(timed_out=is_collective_timeout(exc)) if multi_rank and code == EXIT_ERROR else None
        if stall is not None:  # a peer went silent, or a collective timed out waiting for a rank: name it
            exc, code = _Stalled(stall), EXIT_STALLED
        code = _report(exc, code, env, stderr, multi_rank, store_answers=not multi_rank or stop.watch.store_answers())
        if multi_rank:
            _abort_process_group()
            _flush(stderr)
            os._exit(code)
        return code
    finally:
        stop.watch.stop()
        guard.uninstall()
    code = 128 + stop.signum if stop.signum is not None else EXIT_OK
    if stop.watch.started:  # a rank of a multi-rank job: no interpreter finalization (see _leave)
        _leave(code, stderr)
    return code


def _leave(code: int, stderr) -> None:
    """End a rank of a multi-rank job that succeeded: flush, then ``os._exit``.

    Interpreter finalization is where the rare ``terminate called without an active exception``
    (SIGABRT, exit 134) after a clean run came from: a daemon thread that is inside, or returns
    from, a torch C++ call (a store ``get`` / ``set``, pybind11 with the GIL released) when the
    interpreter finalizes is ended by CPython with ``pthread_exit``, whose unwinding through
    pybind11's ``noexcept`` GIL guard calls ``std::terminate`` (20 of 20 with a store loop in a
    daemon thread at ``sys.exit``). The stall watch, which calls the store every period, was the
    one such thread of a rank, left running whenever ``stop`` gave up its bounded join (2 periods
    + 1 s, on a loaded host); ``stop`` now joins it for good, and leaving without finalizing
    closes the door on any other (a library's daemon thread, a C++ static destructor). The body
    has closed the logs, the lock and the process group already, so nothing is lost."""
    _flush(stderr)
    logging.shutdown()
    os._exit(code)


# ---- reporting ---------------------------------------------------------------------------------


def _report(exc: BaseException, code: int, env: LaunchEnv, stderr, multi_rank: bool, store_answers: bool = True) -> int:
    """Print ``exc`` if this rank is the job's first failure; return the job's exit code
    (``store_answers`` False: the job's store is gone, no rank can be asked who failed first)."""
    rank = dist.get_rank() if dist.is_initialized() else env.rank
    if multi_rank:
        first, code = _claim_first_failure(rank, code) if store_answers else (None, code)
        if isinstance(exc, _Lost) and env.mapped_files_dir and (first is not False or code == EXIT_STALLED):
            # every surviving rank tells its launcher, which prints the line once per node
            launch_report.leave_note(env.mapped_files_dir, rank, str(exc))
            return code
        if first is False:
            return code  # a peer failed first and reported; our error is the consequence
        if first is None:  # the store is gone: say it in one line, without a traceback
            what = str(exc) if isinstance(exc, (_Lost, _Stalled)) else f"{type(exc).__name__}: {_first_line(exc)}"
            print(f"[rank {rank}] {what}", file=stderr, flush=True)
            return code
    elif env.local_rank != 0 and isinstance(exc, ConfigError):
        return code  # before the process group: every rank checks the same things; one line per node
    where = f"[rank {rank}/{env.world_size}] " if env.world_size > 1 else ""
    if isinstance(exc, ConfigError):
        print(f"ConfigError: {exc}", file=stderr, flush=True)
    elif isinstance(exc, TrainingDiverged):
        print(f"{where}training stopped (diverged): {exc}", file=stderr, flush=True)
    elif isinstance(exc, (JobInterrupted, KeyboardInterrupt)):
        print(f"{where}{exc or 'interrupted by SIGINT'}; stopped without saving (the last complete "
              "checkpoint and 'latest' are untouched)", file=stderr, flush=True)
    elif isinstance(exc, (DiskFullError, _Lost)):
        print(f"{where}{exc}", file=stderr, flush=True)
    elif isinstance(exc, _Stalled):
        print(str(exc), file=stderr, flush=True)
    elif isinstance(exc, SystemExit):
        pass  # argparse and friends have printed their message already
    elif multi_rank and _lost_a_peer(exc):  # a consequence: the peer that died is named by the launcher
        print(f"{where}failed: {type(exc).__name__}: {_first_line(exc)} (a peer closed its connection: it died; "
              "the launcher's summary names it)", file=stderr, flush=True)
    else:
        print(f"{where}failed: {type(exc).__name__}: {_first_line(exc)}", file=stderr)
        traceback.print_exception(exc, file=stderr)
        if multi_rank:
            print(f"{where}stopping every rank (exit code {code})", file=stderr)
        _flush(stderr)
    return code


class _Stalled(Exception):
    """The stall watch's verdict, reported as the job's failure (its message is the whole line)."""


class _Lost(Exception):
    """The lost peers' line (``StallWatch.lost_peers``), reported as the job's failure."""


def _claim_first_failure(rank: int, code: int) -> tuple[bool | None, int]:
    """``(True, code)`` if this rank failed first, ``(False, first's code)`` if a peer did,
    ``(None, code)`` if the store cannot be reached."""
    try:
        store = _job_store()
        mine = f"{rank}:{code}"
        current = store.compare_set(_FAILURE_KEY, "", mine).decode()
    except Exception:  # noqa: BLE001 - the store's host may be the rank that died
        return None, code
    first_rank, _, first_code = current.partition(":")
    return (current == mine), int(first_code or code)


_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe")


def lost_a_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is the consequence of a peer's death (a collective that broke on a closed
    connection), not a failure of this rank's own."""
    return _lost_a_peer(exc)


def _lost_a_peer(exc: BaseException) -> bool:
    """``exc`` is a collective that broke because a peer's process ended (gloo's "Connection closed by peer")."""
    return any(isinstance(e, RuntimeError) and any(w in str(e).lower() for w in _PEER_GONE)
               for e in exception_chain(exc))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


def _flush(stream) -> None:
    for s in (sys.stdout, stream):
        try:
            s.flush()
        except Exception:  # noqa: BLE001
            pass


def _job_store():
    """The default process group's store (torchrun's agent store or the init_method's)."""
    return default_store()


def _abort_process_group() -> None:
    """Abort the default process group's communicators without a barrier (bounded by the watchdog)."""
    try:
        dist.group.WORLD.abort()
    except Exception:  # noqa: BLE001 - best effort: os._exit follows
        pass


# ---- signals, parent death, watchdog -----------------------------------------------------------


class _SignalGuard:
    """SIGINT / SIGTERM handlers plus the watchdog thread; installed only from the main thread."""

    def __init__(self, stop: StopRequest, env: LaunchEnv, stderr) -> None:
        self.stop, self.env, self.stderr = stop, env, stderr
        self.failing = False
        self.parent = env.launcher_pid or os.getppid()  # the launcher's pid: its death before this line counts too
        self.watchdog = _Watchdog(self)
        self._previous: dict[int, object] = {}
        self._wakeup_previous = -1
        self._installed = False

    def stalled(self, line: str) -> None:
        """The stall watch's verdict (called from its thread): report it once for the job, leave."""
        rank = dist.get_rank() if dist.is_initialized() else self.env.rank
        first, code = _claim_first_failure(rank, EXIT_STALLED)
        if first is not False:
            print(line, file=self.stderr, flush=True)
        _flush(self.stderr)
        os._exit(code)

    def parent_died(self) -> bool:
        return self.env.under_torchrun and os.getppid() != self.parent

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        self._wakeup_previous = signal.set_wakeup_fd(self.watchdog.wakeup_fd, warn_on_full_buffer=False)
        if self.env.under_torchrun:
            _set_parent_death_signal(signal.SIGTERM)
        self.watchdog.start()
        self._installed = True

    def uninstall(self) -> None:
        if not self._installed:
            return
        signal.set_wakeup_fd(self._wakeup_previous)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self.watchdog.stop()
        self.watchdog.join(timeout=2.0)
        self._installed = False

    def _handle(self, signum: int, frame) -> None:
        if self.failing or self.parent_died():
            return  # the error path / the watchdog is already ending this rank
        if signum == signal.SIGTERM and self.stop.graceful and self.stop.signum is None:
            self.stop.signum = signum
            print(f"[rank {self.env.rank}] SIGTERM: saving a checkpoint after this step, then exiting",
                  file=self.stderr, flush=True)
            return
        raise JobInterrupted(signum)


class _Watchdog(threading.Thread):
    """Sees signals as they arrive (wakeup fd) and ends the rank when it overstays a deadline or
    its launcher is gone; every exit here is ``os._exit`` (the main thread may be stuck)."""

    def __init__(self, guard: _SignalGuard) -> None:
        super().__init__(name="te_npu-job-watchdog", daemon=True)
        self.guard = guard
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)
        self.wakeup_fd = self._write.fileno()
        self._deadline: tuple[float, int, str] | None = None
        self._first_signal: float | None = None
        self._stopped = threading.Event()

    def arm(self, seconds: float, code: int, why: str) -> None:
        """End the process with ``code`` if it is still alive in ``seconds`` (earliest deadline wins)."""
        deadline = time.monotonic() + seconds
        if self._deadline is None or deadline < self._deadline[0]:
            self._deadline = (deadline, code, why)

    def stop(self) -> None:
        self._stopped.set()
        try:
            self._write.send(b"\0")  # wake the select (0 is no signal)
        except OSError:
            pass

    def run(self) -> None:
        while not self._stopped.is_set():
            ready, _, _ = select.select([self._read], [], [], 0.5)
            if ready:
                try:
                    data = self._read.recv(64)
                except BlockingIOError:
                    data = b""
                for signum in data:
                    self._on_signal(signum)
            if self.guard.parent_died():
                self._exit(EXIT_ERROR, f"launcher (pid {self.guard.parent}) died; exiting")
            if self._deadline is not None and time.monotonic() > self._deadline[0]:
                _, code, why = self._deadline
                self._exit(code, why)
        self._read.close()
        self._write.close()

    def _on_signal(self, signum: int) -> None:
        if signum not in (signal.SIGINT, signal.SIGTERM) or self._stopped.is_set():
            return
        name = signal.Signals(signum).name
        if self.guard.parent_died():
            self._exit(EXIT_ERROR, f"launcher (pid {self.guard.parent}) died; exiting")
        now = time.monotonic()
        if self._first_signal is not None and now - self._first_signal >= REPEAT_SIGNAL_S:
            self._exit(128 + signum, f"second signal ({name}); exiting now")
        self._first_signal = self._first_signal or now
        if not (signum == signal.SIGTERM and self.guard.stop.graceful):
            self.arm(SIGNAL_GRACE_S, 128 + signum,
                     f"still running {SIGNAL_GRACE_S:.0f} s after {name} (blocked in a collective?); exiting now")

    def _exit(self, code: int, why: str) -> None:
        rank = dist.get_rank() if dist.is_initialized() else self.guard.env.rank
        try:
            print(f"[rank {rank}] {why}", file=self.guard.stderr, flush=True)
            sys.stdout.flush()
        finally:
            os._exit(code)


def _set_parent_death_signal(signum: int) -> None:
    """Ask Linux to send ``signum`` when the parent (the launcher) dies; no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the watchdog's parent-pid poll still covers it
