"""The launcher's summary line: the first rank to fail and how; a SIGBUS names the changed file (issue 32)."""
from __future__ import annotations

import signal
from types import SimpleNamespace

import numpy as np

from te_npu.training import mapped_files
from te_npu.training.launch_report import first_failure, summarize


def _failure(exitcode, pid, timestamp=100):
    return SimpleNamespace(exitcode=exitcode, pid=pid, timestamp=timestamp)


def test_launch_report_names_the_killed_rank_not_the_peer_whose_collective_broke():
    failures = {0: _failure(1, 1000), 1: _failure(-signal.SIGKILL, 1001)}  # same second, as torchrun sees it
    line, code = summarize(failures, None)
    assert first_failure(failures) == 1 and code == 128 + signal.SIGKILL
    assert line == ("launch: the job failed: rank 1 (pid 1001) was killed by SIGKILL, the first rank to fail; then "
                    "rank 0 (pid 1000) exited 1"), line


def test_launch_report_exit_codes_and_config_errors():
    assert summarize({0: _failure(2, 10)}, None) == (None, 2)  # the ConfigError line says it all
    line, code = summarize({1: _failure(4, 11, timestamp=5), 0: _failure(1, 10, timestamp=6)}, None)
    assert code == 4 and line.startswith("launch: the job failed with exit code 4 (rank 1, pid 11, failed first"), line


def test_launch_report_sigbus_names_the_memory_mapped_file_that_shrank(tmp_path):
    data = tmp_path / "train.bin"
    data.write_bytes(bytes(8192))
    tokens = np.memmap(data, dtype=np.uint16, mode="r")  # the rank's view of its data
    record_dir = tmp_path / "mapped"
    record_dir.mkdir()
    mapped_files.record(str(record_dir), 0)
    assert summarize({0: _failure(-signal.SIGBUS, 7)}, str(record_dir))[1] == 128 + signal.SIGBUS  # nothing changed
    with open(data, "r+b") as f:
        f.truncate(100)
    line, code = summarize({0: _failure(-signal.SIGBUS, 7), 1: _failure(1, 8)}, str(record_dir))
    assert code == 2, line
    assert line == (f"launch: the job failed: rank 0 (pid 7) was killed by SIGBUS reading a file that changed under "
                    f"it: {data} is now 100 bytes, 8192 when the job mapped it (truncated or replaced while the job "
                    "ran; a data fault, exit 2); then rank 1 (pid 8) exited 1"), line
    del tokens


def test_launch_report_sigsegv_without_a_changed_file_says_so(tmp_path):
    line, code = summarize({0: _failure(-signal.SIGSEGV, 7)}, str(tmp_path))
    assert code == 128 + signal.SIGSEGV and "(no memory-mapped file of it changed size)" in line, line


def test_launch_report_a_lost_node_is_the_line_its_surviving_ranks_left(tmp_path):
    """Issue 29: another node's launcher killed; this node's ranks exit 4 after naming it."""
    from te_npu.training.launch_report import leave_note

    line = "node 1 (ranks 2-3, host h) lost: connections closed and the processes of ranks 2-3 ended; ..."
    leave_note(str(tmp_path), 1, line + " (rank 1's view)")
    leave_note(str(tmp_path), 0, line)
    failures = {0: _failure(4, 10), 1: _failure(4, 11)}
    assert summarize(failures, str(tmp_path)) == (f"launch: {line}", 4)  # the lowest rank's line
    killed = {0: _failure(4, 10), 1: _failure(-signal.SIGKILL, 11)}  # a rank of this node was killed: that first
    assert summarize(killed, str(tmp_path))[0].startswith("launch: the job failed: rank 1 (pid 11) was killed by SIGKILL")
    assert summarize(failures, str(tmp_path / "none"))[0].startswith("launch: the job failed with exit code 4")


def test_launch_report_ranks_torchrun_stopped_itself_are_not_the_cause():
    """torchrun's failures include the ranks it ended after the first failure: SIGTERM to a rank
    still starting (a config error on its peer), SIGKILL 30 s later to a stopped one (a stall)."""
    config = {1: _failure(2, 11, timestamp=100), 0: _failure(-signal.SIGTERM, 10, timestamp=100)}
    assert first_failure(config) == 1 and summarize(config, None) == (None, 2)
    stall = {0: _failure(4, 10, timestamp=100), 1: _failure(-signal.SIGKILL, 11, timestamp=131)}
    line, code = summarize(stall, None)
    assert first_failure(stall) == 0 and code == 4, line
    assert line.endswith("then rank 1 (pid 11) was killed by SIGKILL"), line
    killed = {0: _failure(4, 10, timestamp=101), 1: _failure(-signal.SIGKILL, 11, timestamp=100)}  # kill -9 of rank 1
    assert first_failure(killed) == 1 and summarize(killed, None)[1] == 128 + signal.SIGKILL
    alone = {0: _failure(-signal.SIGTERM, 10)}  # nothing else failed: the signal is the cause
    assert summarize(alone, None)[1] == 128 + signal.SIGTERM
