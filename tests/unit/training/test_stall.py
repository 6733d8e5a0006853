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
