"""Stalls end the job: every rank sends a heartbeat, and a rank that sees a peer go silent, or
that has waited in one step too long, names the stalled rank in one line and ends the job.

A rank can stop making progress without failing: SIGSTOP, a debugger, a process stuck in the
kernel (D state), a host that vanished without closing its sockets. Its peers then wait in a
collective with nothing printed -- gloo raises only after the process group's timeout, NCCL /
HCCL's watchdogs abort after theirs with messages that do not say which rank stalled.
``StallWatch`` closes that gap, on any backend:

- the trainer marks what its main thread is doing (``with watch.phase("forward/backward",
  step)``: two attribute writes, no I/O);
- a thread sends ``{beat, pid, host, step, phase, phase_s, done}`` to the job's store every
  ``period`` seconds (``period_for``: at most 5 s) and reads every peer's;
- a peer whose beat has not changed for ``timeout_s`` is **silent**: stopped, frozen or gone
  (measured on this rank's clock, so hosts need no clock sync); this rank's own main thread is
  **stuck** when it has stayed in one *bounded* phase (a step's pieces, an evaluation) that long:
  it waits for a peer stuck in the kernel, or the whole job waits for something. Saves, loads and
  exports are unbounded (their duration is storage's): inside them only silence counts, and
  the process group's own timeout bounds each of their collectives;
- the first rank to see either (decided through the store, as ``te_npu.training.job`` decides
  the first failure) prints one line naming the stalled rank(s) -- pid, host, what each last did
  -- and every rank that sees it leaves with ``EXIT_STALLED`` (4). torchrun then stops the rest;
  a stopped process only yields to SIGKILL, after torchrun's 30 s grace.

``diagnose`` gives the same line to the job's error path when a collective timed out before the
watch fired (the silent peer is then the cause, not the timeout). Nothing here runs without a
process group of more than one rank.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from typing import Callable, Iterator

__all__ = ["StallWatch", "EXIT_STALLED", "period_for"]

EXIT_STALLED = 4
_KEY = "te_npu/heartbeat/{}"
_MAX_PERIOD_S = 5.0


def period_for(timeout_s: float) -> float:
    """Seconds between heartbeats: a fifth of the timeout, at most 5 s, at least 0.2 s."""
    return max(0.2, min(_MAX_PERIOD_S, timeout_s / 5))


class StallWatch:
    """One rank's heartbeat and stall verdicts (see the module doc).

    ``on_stall(line)`` is called once, from the watch thread, with the one-line verdict; it is
    expected to end the process (``te_npu.training.job`` passes its first-failure report).
    """

    def __init__(self, on_stall: Callable[[str], None] | None = None) -> None:
        self.on_stall = on_stall
        self.timeout_s = 0.0
        self.rank, self.world = 0, 1
        self._phase: tuple[str, int, bool] | None = None  # (name, step, bounded)
        self._since = time.monotonic()
        self._beat = 0
        self._peers: dict[int, dict] = {}
        self._changed: dict[int, float] = {}
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = None

    # ---- the main thread's side -------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str, step: int, *, bounded: bool = True) -> Iterator[None]:
        """Mark the main thread as doing ``name`` of ``step`` (``bounded``: it must end within
        the timeout) until the block ends."""
        outer, since = self._phase, self._since
        self._phase, self._since = (name, int(step), bounded), time.monotonic()
        try:
            yield
        finally:
            self._phase, self._since = outer, since if outer is not None else time.monotonic()

    @property
    def started(self) -> bool:
        """The watch ran: this process is (or was) a rank of a multi-rank process group."""
        return self._thread is not None

    def start(self, timeout_s: float, *, store, rank: int, world: int) -> None:
        """Start heartbeating through ``store`` (the process group's) as ``rank`` of ``world``."""
        if self.on_stall is None or world < 2 or self._thread is not None:
            return
        self.timeout_s, self.rank, self.world, self._store = float(timeout_s), rank, world, store
        now = time.monotonic()
        self._changed = {p: now for p in range(world) if p != rank}
        self._thread = threading.Thread(target=self._run, name="te_npu-stall-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop heartbeating; peers are told this rank left on purpose (not a stall)."""
        if self._thread is None or self._stopped.is_set():
            return
        self._stopped.set()
        self._thread.join(timeout=2 * period_for(self.timeout_s) + 1.0)
        with contextlib.suppress(Exception):  # the store may be gone with the job
            self._store.set(_KEY.format(self.rank), json.dumps({**self._record(), "done": True}))

    def diagnose(self) -> str | None:
        """The stall line if a peer has missed 2 heartbeats or more (else None): the cause of a
        collective that timed out before the watch's own verdict."""
        if self._thread is None:
            return None
        now = time.monotonic()
        silent = self._silent(now, 2 * period_for(self.timeout_s))
        return self._silent_line(silent, now) if silent else None

    # ---- the watch thread ---------------------------------------------------------------------
    def _run(self) -> None:
        period = period_for(self.timeout_s)
        while not self._stopped.wait(period):
            self._beat += 1
            try:
                self._store.set(_KEY.format(self.rank), json.dumps(self._record()))
                self._read_peers()
            except Exception:  # noqa: BLE001 - the store is going away with the job; nothing to watch
                continue
            line = self._verdict(time.monotonic())
            if line is not None and not self._stopped.is_set():
                self.on_stall(line)
                return

    def _record(self) -> dict:
        name, step, _ = self._phase or ("between steps", -1, False)
        return {"beat": self._beat, "pid": os.getpid(), "host": socket.gethostname(), "step": step, "phase": name,
                "phase_s": round(time.monotonic() - self._since, 1)}

    def _read_peers(self) -> None:
        now = time.monotonic()
        for peer in self._changed:
            key = _KEY.format(peer)
            if not self._store.check([key]):
                continue  # not started yet: silent since the watch started
            record = json.loads(self._store.get(key))
            if record.get("beat") != self._peers.get(peer, {}).get("beat"):
                self._changed[peer] = now
            self._peers[peer] = record

    def _verdict(self, now: float) -> str | None:
        silent = self._silent(now, self.timeout_s)
        stuck = self._phase is not None and self._phase[2] and now - self._since > self.timeout_s
        if not silent and not stuck:
            return None
        quiet = self._silent(now, 2 * period_for(self.timeout_s))  # a peer gone quiet is the cause, if any
        return self._silent_line(quiet, now) if quiet else self._stuck_line(now)

    def _silent(self, now: float, for_s: float) -> list[int]:
        return [p for p, t in self._changed.items() if now - t >= for_s and not self._peers.get(p, {}).get("done")]

    def _silent_line(self, silent: list[int], now: float) -> str:
        who = "; ".join(f"rank {p} ({self._identity(p)}) has sent no heartbeat for {now - self._changed[p]:.1f} s"
                        f"{self._last_seen(p)}" for p in silent)
        return (f"[rank {self.rank}/{self.world}] stalled: {who}: stopped, frozen or its host is gone; this rank was "
                f"{self._doing()}; ending the job (training.collective_timeout_s={self.timeout_s:g})")

    def _stuck_line(self, now: float) -> str:
        others = "; ".join(f"rank {p} ({self._identity(p)}) {self._peer_doing(p)}" for p in sorted(self._changed))
        return (f"[rank {self.rank}/{self.world}] stalled: {self._doing()} has not finished after "
                f"{now - self._since:.1f} s (training.collective_timeout_s={self.timeout_s:g}); its peers: {others}; "
                "ending the job")

    def _doing(self) -> str:
        if self._phase is None:
            return "between steps"
        name, step, _ = self._phase
        return f"in iteration {step}, {name}" if step >= 0 else f"in {name}"

    def _identity(self, peer: int) -> str:
        record = self._peers.get(peer)
        return f"pid {record.get('pid')}, host {record.get('host')}" if record else "never reported"

    def _last_seen(self, peer: int) -> str:
        record = self._peers.get(peer)
        if not record:
            return ""
        where = f"iteration {record['step']}, {record['phase']}" if record.get("step", -1) >= 0 else record.get("phase")
        return f" (last seen in {where})"

    def _peer_doing(self, peer: int) -> str:
        record = self._peers.get(peer)
        if not record:
            return "never reported"
        if record.get("step", -1) < 0:
            return f"in {record.get('phase')} for {record.get('phase_s')} s"
        return f"in iteration {record['step']}, {record['phase']} for {record.get('phase_s')} s"
