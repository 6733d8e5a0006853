"""The stall watch in one process: two ranks' watches over one in-memory store (torch's HashStore)."""
from __future__ import annotations

import os
import time

import pytest
from torch.distributed import HashStore

from te_npu.training.guards.stall import StallWatch, period_for, waited_for

TIMEOUT = 2.0  # seconds; heartbeats every 0.4 s


class _Rank:
    def __init__(self, store, rank):
        self.lines: list[str] = []
        self.watch = StallWatch(on_stall=self.lines.append)
        self.watch.start(TIMEOUT, store=store, rank=rank, world=2)

    def freeze(self):
        """As SIGSTOP: the heartbeat thread stops without telling anyone."""
        self.watch._stopped.set()
        self.watch._thread.join()


def _wait_for(condition, what, limit=30.0):
    end = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < end, f"no {what} within {limit} s"
        time.sleep(0.05)


@pytest.fixture
def ranks():
    store = HashStore()
    pair = [_Rank(store, 0), _Rank(store, 1)]
    yield pair
    for r in pair:
        r.watch.stop()


def test_stall_watch_names_a_frozen_peer_in_one_line(ranks):
    zero, one = ranks
    with one.watch.phase("forward/backward", 3):
        _wait_for(lambda: zero.watch._peers.get(1, {}).get("phase") == "forward/backward", "heartbeat of rank 1")
        one.freeze()
        with zero.watch.phase("loss all-reduce", 3):  # rank 0 now waits for rank 1 in the collective
            _wait_for(lambda: zero.lines, "verdict")
    line = zero.lines[0]
    assert line.startswith("[rank 0/2] stalled: rank 1 (pid ") and f"pid {os.getpid()}, host " in line, line
    assert "has sent no heartbeat for" in line and "stopped, frozen or its host is gone" in line
    assert "(last seen in iteration 3, forward/backward)" in line and "this rank was in iteration 3, loss all-reduce" in line
    assert "training.collective_timeout_s=2" in line and "\n" not in line
    assert zero.watch.diagnose() is not None  # what the job's error path reports if a collective timed out first


def test_stall_watch_a_bounded_phase_that_never_ends_is_a_stall(ranks):
    zero, one = ranks
    with zero.watch.phase("forward/backward", 7), one.watch.phase("checkpoint save", 7, bounded=False):
        _wait_for(lambda: zero.lines, "verdict")
    line = zero.lines[0]
    assert line.startswith("[rank 0/2] stalled: this rank's iteration 7, forward/backward has not finished after"), line
    assert "no rank is behind the others: rank 0 (pid" in line and "rank 1 (pid" in line, line
    assert "in iteration 7, checkpoint save for" in line and "\n" not in line, line
    assert one.lines == []  # rank 1 is in an unbounded phase (storage's time) and its peer beats


def test_stall_watch_a_timed_out_collective_names_the_rank_behind(ranks):
    """gloo's timeout fired first, every heartbeat is alive: the rank still in an earlier phase is
    the one the others waited for (issue 32: this used to be a 60-line traceback, exit 1)."""
    zero, one = ranks
    with one.watch.phase("forward/backward", 3):
        pass
    with one.watch.phase("optimizer step", 3):  # rank 1: busy in its optimizer step
        for name in ("forward/backward", "optimizer step"):
            with zero.watch.phase(name, 3):
                pass
        with zero.watch.phase("loss all-reduce", 3):  # rank 0 waits for it in the next collective
            _wait_for(lambda: zero.watch._peers.get(1, {}).get("phase") == "optimizer step", "heartbeat of rank 1")
            assert zero.watch.diagnose() is None  # not every failure is a stall: only a timeout is
            line = zero.watch.diagnose(timed_out=True)
    assert line.startswith(f"[rank 0/2] stalled: rank 1 (pid {os.getpid()}, host "), line
    assert "is alive but in iteration 3, optimizer step for " in line and " at test_stall.py:" in line, line
    assert "the other ranks waited for it; a collective timed out while this rank was in iteration 3, loss " \
           "all-reduce (training.collective_timeout_s=2); ending the job" in line, line


def test_stall_watch_warm_up_phase_gets_its_own_limit(ranks):
    zero, one = ranks
    with zero.watch.phase("forward/backward", 1, limit_s=4 * TIMEOUT), one.watch.phase("checkpoint save", 1,
                                                                                         bounded=False):
        time.sleep(2 * TIMEOUT)
        assert zero.lines == []  # past collective_timeout_s, within the warm-up allowance
        _wait_for(lambda: zero.lines, "verdict")
    assert "has not finished after" in zero.lines[0] and "warm-up training.first_step_timeout_s=8" in zero.lines[0]


@pytest.mark.parametrize("records, late", [
    ({0: {"seq": 5, "waiting": True}, 1: {"seq": 3, "waiting": False}}, [1]),  # rank 1 behind
    ({0: {"seq": 4, "waiting": True}, 1: {"seq": 4, "waiting": True}, 2: {"seq": 2, "waiting": True}}, [2]),
    ({0: {"seq": 3, "waiting": True}, 1: {"seq": 3, "waiting": False}}, [1]),  # same phase, rank 1 not in a collective
    ({0: {"seq": 3, "waiting": True}, 1: {"seq": 3, "waiting": True}}, []),  # all wait: nobody stands out
    ({0: {"seq": 3, "waiting": False}, 1: {"seq": 3, "waiting": False}}, []),
    ({0: {"seq": 3}}, []),
], ids=["behind", "behind-of-3", "busy", "all-waiting", "all-busy", "alone"])
def test_stall_waited_for(records, late):
    assert waited_for(records) == late


def test_stall_watch_is_quiet_for_live_peers_unbounded_phases_and_peers_that_left(ranks):
    zero, one = ranks
    with zero.watch.phase("checkpoint save", 4, bounded=False):
        time.sleep(3 * TIMEOUT)
        one.watch.stop()  # rank 1 finished: it says so; its silence is not a stall
        time.sleep(2 * TIMEOUT)
    assert zero.lines == [] and one.lines == []
    assert zero.watch.diagnose() is None


def test_stall_watch_without_a_job_or_a_peer_does_nothing():
    watch = StallWatch()  # no on_stall: a trainer outside run_job
    watch.start(TIMEOUT, store=HashStore(), rank=0, world=2)
    with watch.phase("forward/backward", 1):
        assert watch._thread is None
    watch.stop()
    alone = StallWatch(on_stall=print)
    alone.start(TIMEOUT, store=HashStore(), rank=0, world=1)
    assert alone._thread is None and alone.diagnose() is None


def test_stall_heartbeat_period():
    assert period_for(600) == 5.0 and period_for(10) == 2.0 and period_for(0.1) == 0.2


def test_stall_watch_names_a_peer_stopped_before_its_first_beat_by_pid():
    """A rank stopped in its first seconds used to be named "(never reported)", without its pid."""
    store, lines = HashStore(), []
    zero = StallWatch(on_stall=lines.append)
    one = StallWatch(on_stall=print)
    one.start(TIMEOUT, store=store, rank=1, world=2)
    one._stopped.set()  # frozen at once: no heartbeat after the one written at start
    one._thread.join()
    zero.start(TIMEOUT, store=store, rank=0, world=2)
    try:
        _wait_for(lambda: lines, "verdict")
    finally:
        zero.stop()
    assert lines[0].startswith(f"[rank 0/2] stalled: rank 1 (pid {os.getpid()}, host "), lines[0]
    assert "never reported" not in lines[0]


# ---- lost peers: a collective broke on a closed connection (issue 29: a lost node) ------------------

import json  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from te_npu.training.guards.stall import rank_ranges  # noqa: E402


def _put(store, rank, **record):
    store.set(f"te_npu/heartbeat/{rank}", json.dumps({"beat": 1, "pid": 1, "host": "elsewhere", "node": 1,
                                                      "pidns": "elsewhere", "step": 4, "phase": "forward/backward",
                                                      **record}))


def _watch(store, rank, world, node=0):
    watch = StallWatch(on_stall=print)
    watch.start(TIMEOUT, store=store, rank=rank, world=world, node=node)
    return watch


def test_stall_rank_ranges():
    assert rank_ranges([3, 2, 5, 7, 6]) == "2-3, 5-7" and rank_ranges([4]) == "4"


def test_lost_peers_names_a_node_on_another_host_whose_heartbeats_stopped():
    """Another host's ranks: gone when their heartbeats stop (no pid to check there)."""
    store = HashStore()
    _put(store, 2)
    _put(store, 3)
    zero = _watch(store, 0, 4)
    one = _watch(store, 1, 4)
    try:
        start = time.monotonic()
        line = zero.lost_peers(wait_s=0.6)
        took = time.monotonic() - start
    finally:
        zero.stop()
        one.stop()
    assert line.startswith("node 1 (ranks 2-3, host elsewhere) lost: connections closed and ranks 2-3 sent no "
                           "heartbeat for 0.6 s; rank 0 was "), line
    assert line.endswith("ending the job (exit 4)") and "\n" not in line, line
    assert 0.6 <= took < 5, took  # rank 1 (this host, alive) was decided at once


def test_lost_peers_spares_live_peers_on_other_hosts_and_peers_that_failed_on_their_own():
    store = HashStore()
    zero = _watch(store, 0, 3)
    alive = StallWatch(on_stall=print)
    alive._pidns = "another host"  # as a peer on another host: only its heartbeat tells it is alive
    alive.start(TIMEOUT, store=store, rank=1, world=3, node=1)
    failing = _watch(store, 2, 3, node=1)
    failing.mark_failing()  # its own error path: it reports itself
    try:
        assert zero.lost_peers(wait_s=1.5) is None  # rank 1 beats every 0.4 s
    finally:
        for w in (zero, alive, failing):
            w.stop()


def test_lost_peers_on_this_host_are_decided_by_pid_at_once():
    """A peer in this pid namespace whose process ended (kill -9): gone, named with its pid."""
    store = HashStore()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    zero = _watch(store, 0, 3)
    _put(store, 1, pid=os.getpid(), node=0, host=socket.gethostname(), pidns=zero._pidns)  # alive: this process
    _put(store, 2, pid=pid, node=0, host=socket.gethostname(), pidns=zero._pidns)
    try:
        start = time.monotonic()
        line = zero.lost_peers(wait_s=30)
        took = time.monotonic() - start
    finally:
        zero.stop()
    assert took < 5, took
    assert line.startswith(f"rank 2 (node 0, host {socket.gethostname()}, pid {pid}) lost: connections closed and "
                           "the process of rank 2 ended; rank 0 was "), line


def test_lost_peers_a_store_that_no_longer_answers_is_node_0_lost():
    """torchrun's store lives in node 0's agent: when it is gone, so is node 0."""
    from torch.distributed import TCPStore

    server = subprocess.Popen([sys.executable, "-c",
                               "import sys, time\nfrom torch.distributed import TCPStore\n"
                               "s = TCPStore('127.0.0.1', 0, 2, True, wait_for_workers=False)\n"
                               "print(s.port, flush=True)\ntime.sleep(600)\n"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        store = TCPStore("127.0.0.1", port, 2, False)
        _put(store, 0, node=0, host="head")
        _put(store, 1, node=0, host="head")
        two = _watch(store, 2, 4, node=1)
        _wait_for(lambda: 1 in two._peers, "the records of node 0")
        server.kill()
        server.wait()
        two.mark_failing()  # the error path: probes the store once, then leaves it alone
        line = two.lost_peers(wait_s=0.5)
        two.stop()
    finally:
        server.kill()
    assert line.startswith("node 0 (ranks 0-1, host head) lost: the job's store (hosted by node 0's launcher) no "
                           "longer answers; rank 2 was "), line


def test_lost_peers_waits_a_moment_for_the_rest_of_a_dying_node():
    """A lost node's ranks end a moment apart: the one still ending is named with the one gone."""
    store = HashStore()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.8)"])
    zero = _watch(store, 0, 3)
    here = {"host": socket.gethostname(), "pidns": zero._pidns, "node": 1}
    _put(store, 1, pid=int(dead.stdout), **here)
    _put(store, 2, pid=dying.pid, **here)
    try:
        line = zero.lost_peers(wait_s=30)
    finally:
        zero.stop()
        dying.wait()
    assert line.startswith(f"node 1 (ranks 1-2, host {socket.gethostname()}) lost: connections closed and the "
                           "processes of ranks 1-2 ended; "), line
