"""Building the native kernels survives a build that was killed mid-way: torch's ``lock`` file it
left behind is removed under te_npu's build turn (an ``flock``, which dies with its holder)
instead of hanging every later build, and two builders take turns."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from te_npu.ops.kernels import native_cpu


def test_a_stale_torch_build_lock_is_removed_with_one_line(tmp_path, capsys):
    (tmp_path / "lock").write_bytes(b"")  # what a killed FileBaton holder leaves
    with native_cpu.build_turn(tmp_path):
        assert not (tmp_path / "lock").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "lock") in err[0] and "killed" in err[0]


def test_no_lock_no_line(tmp_path, capsys):
    with native_cpu.build_turn(tmp_path):
        pass
    assert capsys.readouterr().err == ""


def _builder(build_dir, then: str) -> subprocess.Popen:
    """A process that takes the build turn in ``build_dir``, says so, then runs ``then``."""
    code = ("import pathlib, time; from te_npu.ops.kernels import native_cpu as n\n"
            f"with n.build_turn(pathlib.Path({str(build_dir)!r})):\n    print('got the turn', flush=True)\n    {then}")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_second_builder_waits_for_the_turn_and_gets_it_when_the_holder_dies(tmp_path):
    holder = _builder(tmp_path, "time.sleep(120)")
    waiter = None
    try:
        assert holder.stdout.readline().strip() == "got the turn"
        waiter = _builder(tmp_path, "pass")
        time.sleep(2.0)
        assert waiter.poll() is None, "the second builder must wait while the turn is held"
        holder.kill()  # SIGKILL: the kernel releases a dead holder's flock
        out, _ = waiter.communicate(timeout=60)
        assert out.strip() == "got the turn"
    finally:
        holder.kill()
        holder.wait()
        if waiter is not None and waiter.poll() is None:
            waiter.kill()


@pytest.mark.slow
def test_a_fresh_build_with_a_stale_lock_completes(tmp_path):
    """The real build (about a minute on 2 cores) into a fresh TORCH_EXTENSIONS_DIR whose build
    folder holds a killed build's lock: before the build turn this hung forever."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    code = ("from te_npu.ops.kernels import native_cpu as n\n"
            "_, build_dir = n._extension(); (build_dir / 'lock').write_bytes(b'')\n"
            "ok, why = n.is_available(return_reason=True); print('built' if ok else why)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.stdout.strip().splitlines()[-1] == "built", done.stdout + done.stderr
    assert "removed" in done.stderr and "killed mid-way" in done.stderr


def test_each_copy_of_te_npu_builds_in_its_own_folder(tmp_path, monkeypatch):
    """Two checkouts (or a checkout and an installed wheel) with the same sources get different
    build folders: ninja's build file names the sources by absolute path, so one shared folder
    was rebuilt by each copy in turn. The same copy keeps its name."""
    name, build_dir = native_cpu._extension()
    assert native_cpu._extension() == (name, build_dir)
    monkeypatch.setattr(native_cpu, "_NATIVE_DIR", tmp_path)
    other, other_dir = native_cpu._extension()
    assert other != name and other_dir != build_dir
    assert other.rsplit("_", 1)[0] == name.rsplit("_", 1)[0]  # te_npu_native_cpu_<capability>_
