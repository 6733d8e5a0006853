"""Stalls end the job: every rank sends a heartbeat, and a rank that sees a peer go silent, or
that has waited in one step too long, names the stalled rank in one line and ends the job.

A rank can stop making progress without failing: SIGSTOP, a debugger, a process stuck in the
kernel (D state), a host that vanished without closing its sockets, or a rank that is alive but
busy far longer than its peers (a sleep, a long C call, a slow read). Its peers then wait in a
collective with nothing printed -- gloo raises only after the process group's timeout, NCCL /
HCCL's watchdogs abort after theirs with messages that do not say which rank stalled.
``StallWatch`` closes that gap, on any backend:

- the trainer marks what its main thread is doing (``with watch.phase("forward/backward",
  step)``: a few attribute writes, no I/O);
- a thread sends ``{beat, pid, host, step, phase, phase_s, seq, where, waiting, done}`` to the
  job's store every ``period`` seconds (``period_for``: at most 5 s) and reads every peer's;
  the first record is written when the watch starts, so a rank stopped at once is still named
  by pid and host;
- a peer whose beat has not changed for ``timeout_s`` is **silent**: stopped, frozen, gone, or
  holding the GIL in a long C call so its heartbeat thread cannot run (measured on this rank's
  clock, so hosts need no clock sync); this rank's own main thread is **stuck** when it has
  stayed in one *bounded* phase (a step's pieces, an evaluation) longer than its limit (the
  timeout, or the phase's own ``limit_s``: warm-up). Saves, loads and exports are unbounded
  (their duration is storage's): inside them only silence counts, and the process group's own
  timeout bounds each of their collectives;
- the first rank to see either (decided through the store, as ``te_npu.training.job`` decides
  the first failure) prints one line naming the stalled rank(s) -- pid, host, what each last did
  -- and every rank that sees it leaves with ``EXIT_STALLED`` (4). torchrun then stops the rest;
  a stopped process only yields to SIGKILL, after torchrun's 30 s grace.

Who is being waited for (``waited_for``). Each record carries the rank's ``seq`` (phases entered
plus phases left: every rank runs the same phases in the same order, so a smaller ``seq`` is a
rank behind) and where its main thread is (``where``: the innermost Python frame; ``waiting``:
that frame is inside ``torch.distributed``, i.e. the rank waits in a collective). A rank that
has waited too long names, in this order: peers gone silent; else the ranks behind; else the
ranks alive in the same phase but not inside a collective (busy). Only when no rank stands out
does the line list what every rank does instead. ``diagnose`` gives the job's error path the
same line when a collective raised its timeout before the watch's own verdict, so every stall
ends the same way, whichever detector fires first.

Warm-up: the trainer gives the first step of a process and its first evaluation
``training.first_step_timeout_s`` (``phase(..., limit_s=...)``), and raises the process group's
timeout to match for that phase (a compile, a graph build, communicator setup).

Lost peers (``lost_peers``): a collective that broke because a peer's connection closed (gloo's
"Connection closed / reset by peer") means a peer's process ended. A peer on its own error path
says so first (``mark_failing``: its record carries ``failed``), so the ranks whose collectives
broke tell a peer that failed (it reports itself) from one that is gone: killed, or its node lost
(a node's launcher killed, its host down). A peer in this rank's pid namespace (same host) is gone
when its pid is (checked for up to 2 s: a lost node's ranks die within a moment of each other);
another host's peer when its heartbeat does not change for one period and a second; a store that no longer answers means node 0 is gone (torchrun's agent there hosts it).
The line names the node when all its ranks are gone (``node 1 (ranks 2-3, host h) lost: ...``),
else the ranks; each record carries its node (torchrun's ``GROUP_RANK``).

Nothing here runs without a process group of more than one rank.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from typing import Callable, Iterator

__all__ = ["StallWatch", "EXIT_STALLED", "period_for", "waited_for", "rank_ranges"]

EXIT_STALLED = 4
_KEY = "te_npu/heartbeat/{}"
_MAX_PERIOD_S = 5.0
_LOCAL_GRACE_S = 2.0
"""Seconds a live peer on this host may take to end or to mark itself failing (``lost_peers``)."""
_COLLECTIVE_CODE = "/torch/distributed/"
"""A main thread whose innermost Python frame lies under this path waits in a collective."""


def period_for(timeout_s: float) -> float:
    """Seconds between heartbeats: a fifth of the timeout, at most 5 s, at least 0.2 s."""
    return max(0.2, min(_MAX_PERIOD_S, timeout_s / 5))


def rank_ranges(ranks) -> str:
    """``[2, 3, 5]`` -> ``"2-3, 5"``: ranks as runs of consecutive numbers."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)


def _ranks(ranks) -> str:
    return f"rank{'s' if len(set(ranks)) > 1 else ''} {rank_ranges(ranks)}"


def _pid_namespace() -> str | None:
    """This process's pid namespace (boot id and namespace inode): peers that share it can be
    checked by pid; None where there is no ``/proc``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    """``pid`` is a live process here (a zombie, killed but not yet reaped, is not)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except (OSError, IndexError, ValueError):
        return False


def _tcp_address(store) -> tuple[str, int] | None:
    """The host and port of the TCP store under ``store``'s prefixes, None for another kind."""
    while store is not None and not (hasattr(store, "host") and hasattr(store, "port")):
        store = getattr(store, "underlying_store", None)
    return (store.host, int(store.port)) if store is not None else None


def _answers(address: tuple[str, int] | None, timeout_s: float = 2.0) -> bool:
    """The TCP store at ``address`` still accepts connections (a plain socket: a dead store's
    client calls print a C++ warning with a stack trace each)."""
    if address is None:
        return True
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:
        return False


def waited_for(records: dict[int, dict]) -> list[int]:
    """The ranks the others wait for, from every live rank's last record (``{rank: record}``):
    those behind (the smallest ``seq``, when the ranks' differ), else those not inside a
    collective (``waiting`` false) while another rank is; [] when no rank stands out."""
    if len(records) < 2:
        return []
    seqs = {r: int(rec.get("seq", 0)) for r, rec in records.items()}
    if len(set(seqs.values())) > 1:
        low = min(seqs.values())
        return sorted(r for r, s in seqs.items() if s == low)
    busy = sorted(r for r, rec in records.items() if not rec.get("waiting"))
    return busy if len(busy) < len(records) else []


class StallWatch:
    """One rank's heartbeat and stall verdicts (see the module doc).

    ``on_stall(line)`` is called once, from the watch thread, with the one-line verdict; it is
    expected to end the process (``te_npu.training.job`` passes its first-failure report).
    """

    def __init__(self, on_stall: Callable[[str], None] | None = None) -> None:
        self.on_stall = on_stall
        self.timeout_s = 0.0
        self.rank, self.world, self.node = 0, 1, 0
        self._failing = False
        self._store_gone = False
        self._pidns = _pid_namespace()
        self._phase: tuple[str, int, bool, float | None] | None = None  # (name, step, bounded, limit_s)
        self._since = time.monotonic()
        self._seq = 0  # phases entered plus phases left
        self._failed: tuple | None = None  # (phase, since, seq) when an error left a phase
        self._main = threading.main_thread().ident
        self._beat = 0
        self._peers: dict[int, dict] = {}
        self._changed: dict[int, float] = {}
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = None

    # ---- the main thread's side -------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str, step: int, *, bounded: bool = True, limit_s: float | None = None) -> Iterator[None]:
        """Mark the main thread as doing ``name`` of ``step`` until the block ends. ``bounded``:
        it must end within the timeout, or within ``limit_s`` seconds when given (a warm-up; never
        less than the timeout)."""
        outer, since = self._phase, self._since
        self._phase, self._since = (name, int(step), bounded, limit_s), time.monotonic()
        self._seq += 1
        try:
            yield
        except BaseException:
            if self._failed is None:  # the innermost phase an error left: where the rank was when it failed
                self._failed = (self._phase, self._since, self._seq)
            raise
        finally:
            self._seq += 1
            self._phase, self._since = outer, since if outer is not None else time.monotonic()

    @property
    def started(self) -> bool:
        """The watch ran: this process is (or was) a rank of a multi-rank process group."""
        return self._thread is not None

    def start(self, timeout_s: float, *, store, rank: int, world: int, node: int = 0) -> None:
        """Start heartbeating through ``store`` (the process group's) as ``rank`` of ``world``, on
        node ``node`` (torchrun's ``GROUP_RANK``)."""
        if self.on_stall is None or world < 2 or self._thread is not None:
            return
        self.timeout_s, self.rank, self.world, self._store = float(timeout_s), rank, world, store
        self.node = int(node)
        now = time.monotonic()
        self._changed = {p: now for p in range(world) if p != rank}
        with contextlib.suppress(Exception):  # who this rank is, from the start
            store.set(_KEY.format(rank), json.dumps(self._record()))
        self._thread = threading.Thread(target=self._run, name="te_npu-stall-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop heartbeating and wait for the thread to end (it must not outlive the process
        group's store: see ``te_npu.training.job``); peers are told this rank left on purpose."""
        if self._thread is None or self._stopped.is_set():
            return
        self._stopped.set()
        self._thread.join()  # its store calls are bounded by the store's own timeout
        with contextlib.suppress(Exception):  # the store may be gone with the job
            self._store.set(_KEY.format(self.rank), json.dumps({**self._record(), "done": True}))

    def mark_failing(self) -> None:
        """This rank is on its error path (it reports itself): a peer whose collective broke on
        its closed connection does not count it as lost (``lost_peers``)."""
        if self._thread is None:
            return
        self._failing = True  # the watch thread beats no more: this record is the last
        if self.store_answers():
            with contextlib.suppress(Exception):
                self._store.set(_KEY.format(self.rank), json.dumps(self._record()))

    def store_answers(self) -> bool:
        """The job's store still accepts connections (checked once on the error path: after a
        lost node 0, torchrun's store is gone with its agent, and every call to it would print a
        C++ warning with a stack trace); True without a watch."""
        if self._thread is None:
            return True
        if not self._store_gone and not _answers(_tcp_address(self._store)):
            self._store_gone = True
        return not self._store_gone

    def lost_peers(self, *, wait_s: float | None = None) -> str | None:
        """One line naming the peers that are gone (module doc, "Lost peers"), or None when every
        peer is alive or failed on its own. ``wait_s``: how long another host's peer may go without
        a heartbeat before it counts as gone (default: one period and a second)."""
        if self._thread is None:
            return None
        wait_s = period_for(self.timeout_s) + 1.0 if wait_s is None else wait_s
        try:
            if not self.store_answers():
                raise ConnectionError("the job's store does not answer")
            self._read_peers()
        except Exception:  # noqa: BLE001 - torchrun's store lives in node 0's agent: that node is gone
            self._store_gone = True
            return self._lost_line(self._node_ranks(0) - {self.rank}, "the job's store (hosted by node 0's launcher) "
                                   "no longer answers", node=0)
        gone, local, undecided = set(), set(), {}
        for peer in self._changed:
            record = self._peers.get(peer)
            if record and self._pidns is not None and record.get("pidns") == self._pidns:
                local.add(peer)  # decided by its pid
            else:
                undecided[peer] = record.get("beat") if record else None
        start = time.monotonic()
        while True:
            for peer in list(local):
                record = self._peers.get(peer) or {}
                if record.get("done") or record.get("failed"):
                    local.discard(peer)  # left on purpose, or on its own error path
                elif not _pid_alive(record.get("pid", -1)):
                    local.discard(peer)
                    gone.add(peer)
            for peer in list(undecided):
                record = self._peers.get(peer) or {}
                if record.get("beat") != undecided[peer] or record.get("done") or record.get("failed"):
                    del undecided[peer]
            waited = time.monotonic() - start
            # a live local peer gets a short grace (the ranks of a lost node die within a moment of
            # each other; a live peer whose collective broke too marks itself failing at once)
            if not (undecided and waited < wait_s) and not (local and waited < min(_LOCAL_GRACE_S, wait_s)):
                break
            time.sleep(min(0.2, wait_s))
            with contextlib.suppress(Exception):
                self._read_peers()
        hows = []
        if gone:
            hows.append(f"the process{'es' if len(gone) > 1 else ''} of {_ranks(gone)} ended")
        if undecided:
            hows.append(f"{_ranks(undecided)} sent no heartbeat for {wait_s:.1f} s")
        gone |= set(undecided)
        return self._lost_line(gone, f"connections closed and {' and '.join(hows)}") if gone else None

    def _node_ranks(self, node: int) -> set[int]:
        """The ranks that reported ``node`` as theirs (this rank included)."""
        ranks = {p for p, r in list(self._peers.items()) if r.get("node", 0) == node}
        return ranks | ({self.rank} if self.node == node else set())

    def _lost_line(self, gone: set[int], how: str, node: int | None = None) -> str:
        """``node N (ranks a-b, host h) lost: ...`` when every rank of a node is gone, else the ranks."""
        nodes = sorted({self._peers.get(p, {}).get("node", 0) for p in gone} | ({node} if node is not None else set()))
        parts = []
        for n in nodes:
            ranks = sorted(p for p in gone if self._peers.get(p, {}).get("node", 0) == n)
            hosts = sorted({self._peers[p]["host"] for p in ranks if self._peers.get(p, {}).get("host")})
            host = f", host {', '.join(hosts)}" if hosts else ""
            if n != self.node and (set(ranks) >= self._node_ranks(n) - {self.rank} or node == n):
                parts.append(f"node {n} ({_ranks(ranks) if ranks else 'ranks unknown'}{host})")
            else:
                pids = ", ".join(f"pid {self._peers[p].get('pid')}" for p in ranks if p in self._peers)
                parts.append(f"{_ranks(ranks)} (node {n}{host}"
                             f"{', ' + pids if pids else ''})")
        if self._failed is not None:  # where this rank was when its collective broke
            self._phase, self._since, self._seq = self._failed
        return (f"{' and '.join(parts)} lost: {how}; rank {self.rank} was {self._doing()}; ending the job "
                f"(exit {EXIT_STALLED})")

    def diagnose(self, *, timed_out: bool = False) -> str | None:
        """The stall line for the job's error path, or None: a peer that has missed 2 heartbeats
        or more is the cause of whatever failed; with ``timed_out`` (a collective raised its
        timeout before the watch's own verdict) the line names the rank the others waited for
        (``waited_for``), or what every rank does when none stands out."""
        if self._thread is None:
            return None
        now = time.monotonic()
        silent = self._silent(now, 2 * period_for(self.timeout_s))
        if silent:
            return self._silent_line(silent, now)
        if not timed_out:
            return None
        with contextlib.suppress(Exception):  # the freshest peer records, if the store still answers
            self._read_peers()
        if self._failed is not None:  # back where the collective timed out: this rank waited in it
            self._phase, self._since, self._seq = self._failed
        return self._waiting_line(f"a collective timed out while this rank was {self._doing()}", waiting=True)

    # ---- the watch thread ---------------------------------------------------------------------
    def _run(self) -> None:
        period = period_for(self.timeout_s)
        while not self._stopped.wait(period):
            if self._failing:
                continue  # on the error path: mark_failing wrote the last record
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
        name, step, _, _ = self._phase or ("between steps", -1, False, None)
        where, waiting = self._where()
        return {"beat": self._beat, "pid": os.getpid(), "host": socket.gethostname(), "node": self.node,
                "pidns": self._pidns, "step": step, "phase": name, "phase_s": round(time.monotonic() - self._since, 1),
                "seq": self._seq, "where": where, "waiting": waiting, "failed": self._failing}

    def _where(self) -> tuple[str, bool]:
        """The main thread's innermost Python frame (``file:line function``), and whether it
        lies inside ``torch.distributed`` (the rank waits in a collective)."""
        frame = sys._current_frames().get(self._main)
        if frame is None:
            return "", False
        path = frame.f_code.co_filename.replace(os.sep, "/")
        return f"{os.path.basename(path)}:{frame.f_lineno} {frame.f_code.co_name}", _COLLECTIVE_CODE in path

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
        stuck = self._phase is not None and self._phase[2] and now - self._since > self._limit()
        if not silent and not stuck:
            return None
        quiet = self._silent(now, 2 * period_for(self.timeout_s))  # a peer gone quiet is the cause, if any
        if quiet:
            return self._silent_line(quiet, now)
        return self._waiting_line(f"this rank's {self._doing().removeprefix('in ')} has not finished after "
                                  f"{now - self._since:.1f} s")

    def _limit(self) -> float:
        limit = self._phase[3] if self._phase is not None else None
        return self.timeout_s if limit is None else max(limit, self.timeout_s)

    def _silent(self, now: float, for_s: float) -> list[int]:
        return [p for p, t in self._changed.items() if now - t >= for_s and not self._peers.get(p, {}).get("done")]

    def _silent_line(self, silent: list[int], now: float) -> str:
        who = "; ".join(f"rank {p} ({self._identity(p)}) has sent no heartbeat for {now - self._changed[p]:.1f} s"
                        f"{self._last_seen(p)}" for p in silent)
        return (f"[rank {self.rank}/{self.world}] stalled: {who}: stopped, frozen or its host is gone; this rank was "
                f"{self._doing()}; ending the job (training.collective_timeout_s={self.timeout_s:g})")

    def _waiting_line(self, what: str, *, waiting: bool | None = None) -> str:
        """This rank waited too long (``what``): the rank(s) the others wait for, if any stands out
        (``waiting``: this rank's own state, when known better than its main thread's frame)."""
        records = {p: r for p, r in self._peers.items() if p in self._changed and not r.get("done")}
        records[self.rank] = self._record()
        if waiting is not None:
            records[self.rank]["waiting"] = waiting
        late = waited_for(records)
        limit = f"training.collective_timeout_s={self.timeout_s:g}"
        if self._phase is not None and self._phase[3] is not None:
            limit += f", warm-up training.first_step_timeout_s={self._phase[3]:g}"
        if late:
            who = "; ".join(f"rank {p} ({self._identity(p)}) is alive but {self._doing_of(p)}" for p in late)
            return (f"[rank {self.rank}/{self.world}] stalled: {who}: the other ranks waited for it; {what} "
                    f"({limit}); ending the job")
        ranks = "; ".join(f"rank {p} ({self._identity(p)}) {self._doing_of(p)}" for p in sorted(records))
        return (f"[rank {self.rank}/{self.world}] stalled: {what} ({limit}); no rank is behind the others: {ranks}; "
                "ending the job")

    def _doing(self) -> str:
        if self._phase is None:
            return "between steps"
        name, step, _, _ = self._phase
        return f"in iteration {step}, {name}" if step >= 0 else f"in {name}"

    def _identity(self, peer: int) -> str:
        if peer == self.rank:
            return f"pid {os.getpid()}, host {socket.gethostname()}, this rank"
        record = self._peers.get(peer)
        return f"pid {record.get('pid')}, host {record.get('host')}" if record else "never reported"

    def _last_seen(self, peer: int) -> str:
        record = self._peers.get(peer)
        if not record:
            return ""
        where = f"iteration {record['step']}, {record['phase']}" if record.get("step", -1) >= 0 else record.get("phase")
        return f" (last seen in {where})"

    def _doing_of(self, peer: int) -> str:
        """What ``peer`` (or this rank) last reported doing: phase, for how long, where."""
        record = self._record() if peer == self.rank else self._peers.get(peer)
        if not record:
            return "never reported"
        at = f" at {record['where']}" if record.get("where") else ""
        if record.get("waiting"):
            at += " (in a collective)"
        if record.get("step", -1) < 0:
            return f"in {record.get('phase')} for {record.get('phase_s')} s{at}"
        return f"in iteration {record['step']}, {record['phase']} for {record.get('phase_s')} s{at}"
