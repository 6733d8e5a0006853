"""``te_npu.process_tree``: a child started owned takes its whole process group with it when its
owner dies, even by SIGKILL (no grandchild adopted by pid 1 lives on), and ``end_owned`` stops
the group in order; a process not started that way is left alone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from te_npu import process_tree

REPO = Path(__file__).resolve().parents[2]
# the owner: starts an owned child (which starts a grandchild, as ninja starts cc1plus), prints
# the child's pid (its group), then sleeps until it is killed
OWNER = textwrap.dedent("""
    import sys, time
    from te_npu import process_tree
    child = process_tree.start_owned([sys.executable, "-c", sys.argv[1]])
    print(child.pid, flush=True)
    time.sleep(600)
""")
CHILD = textwrap.dedent("""
    import subprocess, sys, time
    from te_npu import process_tree
    watching = process_tree.watch_owner()
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    time.sleep(600 if watching else 0)
""")


def _start_owner() -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    owner = subprocess.Popen([sys.executable, "-c", OWNER, CHILD], stdout=subprocess.PIPE, text=True, env=env)
    return owner, int(owner.stdout.readline())


def _members(pgid: int) -> list[int]:
    """Live (not zombie) processes of group ``pgid``, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def _wait_members(pgid: int, count: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while len(_members(pgid)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return _members(pgid)


def test_owned_group_dies_with_an_owner_killed_by_sigkill():
    owner, pgid = _start_owner()
    try:
        assert len(_wait_members(pgid, 2, 20)) == 2  # the child and its grandchild, in the child's own group
        assert os.getpgid(pgid) == pgid != os.getpgid(owner.pid)
        owner.kill()
        owner.wait()
        start = time.monotonic()
        while _members(pgid) and time.monotonic() - start < 5:
            time.sleep(0.05)
        assert _members(pgid) == [], "the owned group outlived its owner"
    finally:
        owner.kill()
        for pid in _members(pgid):
            os.kill(pid, signal.SIGKILL)


def test_end_owned_stops_the_group_and_returns_its_status():
    proc = process_tree.start_owned([sys.executable, "-c", CHILD], env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert len(_wait_members(proc.pid, 2, 20)) == 2
        assert process_tree.end_owned(proc, grace_s=2) == -signal.SIGTERM
        assert process_tree.wait_group_gone(proc.pid, 5)
    finally:
        for pid in _members(proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_watch_owner_is_a_no_op_without_an_owner(monkeypatch):
    monkeypatch.delenv(process_tree.OWNER_FD_ENV, raising=False)
    assert process_tree.watch_owner() is False
