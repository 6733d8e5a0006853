"""The checkpoint folder lock: one job per folder, the holder named, stale locks taken over."""
from __future__ import annotations

import json
import os
import socket

import pytest

from te_npu import ConfigError
from te_npu.distributed.storage.lock import LOCK_NAME, acquire_folder_lock, describe_holder


def _hold_in_child(directory):
    """Fork a process that takes the lock and waits; returns (pid, write end that releases it)."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: stdlib only, then leave without running the parent's atexit / pytest
        try:
            lock = acquire_folder_lock(directory)
            os.write(ready_w, b"1")
            os.read(go_r, 1)
            lock.release()
        finally:
            os._exit(0)
    os.read(ready_r, 1)
    return pid, go_w


def test_checkpoint_lock_second_job_fails_naming_the_holder(tmp_path):
    pid, release = _hold_in_child(str(tmp_path))
    try:
        with pytest.raises(ConfigError) as info:
            acquire_folder_lock(str(tmp_path))
        message = str(info.value)
        assert message.startswith("checkpoint.dir: ") and "in use by another job" in message
        assert f"pid {pid}" in message and f"host {socket.gethostname()}" in message and "it is running" in message
        assert "kill" not in message  # a healthy job's pid is not an invitation to kill it
        assert "wait for that job to end or stop it, or give this run another checkpoint.dir" in message
    finally:
        os.write(release, b"1")
        os.waitpid(pid, 0)
    lock = acquire_folder_lock(str(tmp_path))  # released cleanly: free again, and not stale
    assert lock.stale_holder is None
    lock.release()
    assert "released" in json.loads((tmp_path / LOCK_NAME).read_text())


def test_checkpoint_lock_of_a_killed_holder_is_taken_over(tmp_path):
    # what a SIGKILLed job leaves: the holder record, no "released", and no lock (the kernel dropped it)
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "node7", "pid": 4242, "started": "then"}))
    lock = acquire_folder_lock(str(tmp_path))
    assert lock.stale_holder == {"host": "node7", "pid": 4242, "started": "then"}
    note = describe_holder(lock.stale_holder)  # what the takeover note prints: nobody holds it now
    assert note == "host node7, pid 4242, started then" and "holds" not in note
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    lock.release()  # idempotent


def test_checkpoint_lock_unwritable_folder_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"checkpoint\.dir: cannot create the lock file"):
        acquire_folder_lock(str(tmp_path / "file" / "ckpt"))


def test_checkpoint_lock_names_the_kernels_holder_when_the_record_is_wrong(tmp_path):
    """A lock file whose record names a pid that is gone while the lock is held (a record written in
    another PID namespace, or edited): the message names the pid the kernel says holds it."""
    pid, release = _hold_in_child(str(tmp_path))
    try:
        path = tmp_path / LOCK_NAME
        record = json.dumps({"host": socket.gethostname(), "pid": 999999999, "started": "then"})
        fd = os.open(path, os.O_WRONLY)  # this process holds no lock on it: closing drops nothing
        os.pwrite(fd, record.encode().ljust(200), 0)
        os.close(fd)
        with pytest.raises(ConfigError) as info:
            acquire_folder_lock(str(tmp_path))
        if not os.path.exists("/proc/locks"):
            pytest.skip("no /proc/locks here: the kernel's holder cannot be read")
        assert f"the kernel says pid {pid} on this host holds the lock" in str(info.value), str(info.value)
    finally:
        os.write(release, b"1")
        os.waitpid(pid, 0)


def test_checkpoint_lock_discarded_by_a_refused_start_leaves_the_disk_as_found(tmp_path):
    """A job that fails before writing anything removes the lock file and the folder it created;
    a lock file (or folder) that was there before stays, marked released."""
    new = tmp_path / "new" / "ckpt"
    acquire_folder_lock(str(new)).release(discard=True)
    assert not new.exists() and (tmp_path / "new").is_dir()  # only what the lock created is removed
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    acquire_folder_lock(str(kept)).release(discard=True)
    assert sorted(os.listdir(kept)) == ["notes.txt"]
    acquire_folder_lock(str(kept)).release()  # a normal end: the file stays, marked released
    acquire_folder_lock(str(kept)).release(discard=True)  # not created by this lock: kept, marked
    assert "released" in json.loads((kept / LOCK_NAME).read_text())
