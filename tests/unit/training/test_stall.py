"""The stall watch in one process: two ranks' watches over one in-memory store (torch's HashStore)."""
from __future__ import annotations

import os
import time

import pytest
from torch.distributed import HashStore

from te_npu.training.stall import StallWatch, period_for

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
    assert line.startswith("[rank 0/2] stalled: in iteration 7, forward/backward has not finished after"), line
    assert "its peers: rank 1 (pid" in line and "in iteration 7, checkpoint save for" in line
    assert one.lines == []  # rank 1 is in an unbounded phase (storage's time) and its peer beats


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
