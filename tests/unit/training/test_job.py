"""run_job in one process: exit codes, one report per failure, signals, handlers restored."""
import os
import signal

import pytest

from te_npu import ConfigError
from te_npu.training.guards.divergence import TrainingDiverged
from te_npu.training.job import EXIT_CONFIG, EXIT_DIVERGED, EXIT_ERROR, EXIT_OK, run_job


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)


def _raise(exc):
    def body(stop):
        raise exc

    return body


def test_job_config_error_is_one_line_exit_2(capsys):
    assert run_job(_raise(ConfigError("training.lr: 0 is out of range"))) == EXIT_CONFIG
    assert capsys.readouterr().err == "ConfigError: training.lr: 0 is out of range\n"


def test_job_config_error_before_the_process_group_prints_once_per_node(capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")  # every rank makes the same checks: local rank 0 speaks
    assert run_job(_raise(ConfigError("data.path: missing"))) == EXIT_CONFIG
    assert capsys.readouterr().err == ""


def test_job_divergence_is_one_line_exit_3(capsys):
    assert run_job(_raise(TrainingDiverged("iteration 7: training loss is nan"))) == EXIT_DIVERGED
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "training stopped (diverged): iteration 7" in err


def test_job_error_prints_one_traceback_exit_1(capsys):
    assert run_job(_raise(ValueError("bad batch"))) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("failed: ValueError: bad batch\n") and err.count("Traceback") == 1


def test_job_disk_full_is_one_line_exit_1(capsys):
    from te_npu.distributed.storage.disk_space import DiskFullError

    message = "checkpoint.save of step 8 to /ckpt: /ckpt has 1.0 MiB free, the step needs about 3.4 GiB"
    assert run_job(_raise(DiskFullError(message))) == EXIT_ERROR
    assert capsys.readouterr().err == message + "\n"


def test_job_sigint_stops_with_130_and_restores_handlers(capsys):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    reached = []

    def body(stop):
        os.kill(os.getpid(), signal.SIGINT)
        reached.append("after")  # the handler raises before this line

    assert run_job(body) == 128 + signal.SIGINT
    assert reached == []
    assert "interrupted by SIGINT; stopped without saving" in capsys.readouterr().err
    assert {s: signal.getsignal(s) for s in before} == before


def test_job_graceful_sigterm_reaches_the_step_loop():
    seen = []

    def body(stop):
        stop.graceful = True  # what the Trainer sets with checkpoint.save_on_sigterm
        os.kill(os.getpid(), signal.SIGTERM)
        seen.append(stop.signum)  # the loop would save here, then return

    assert run_job(body) == 128 + signal.SIGTERM
    assert seen == [signal.SIGTERM]


def test_job_success_is_0():
    assert run_job(lambda stop: None) == EXIT_OK


def test_job_interruption_inside_dcp_keeps_its_exit_code(capsys):
    # DCP gathers a rank's exception (pickled) and re-raises it as a CheckpointException on every rank
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.utils import _wrap_exception

    from te_npu.training.job import JobInterrupted

    interrupted = pickle.loads(pickle.dumps(JobInterrupted(signal.SIGINT)))
    assert interrupted.signum == signal.SIGINT and str(interrupted) == "interrupted by SIGINT"
    wrapped = CheckpointException("write", {1: _wrap_exception(interrupted)})
    assert run_job(_raise(wrapped)) == 128 + signal.SIGINT
    assert "interrupted by SIGINT; stopped without saving" in capsys.readouterr().err


def test_job_signal_inside_a_checkpoint_write_is_reported_as_the_signal(capsys):
    """SIGTERM landing in torch.save: its zip writer's __exit__ raises "unexpected pos" while the
    interruption propagates, and DCP hands that to every rank; the job still reports the signal."""
    from torch.distributed.checkpoint.api import CheckpointException

    from te_npu.training.job import JobInterrupted

    def body(stop):
        try:
            try:
                raise JobInterrupted(signal.SIGTERM)
            except JobInterrupted:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
        except RuntimeError as exc:
            raise CheckpointException("write", {0: exc}) from None

    assert run_job(body) == 128 + signal.SIGTERM
    assert "interrupted by SIGTERM; stopped without saving" in capsys.readouterr().err


def test_job_rank_of_a_multi_rank_job_never_finalizes_on_the_error_path(tmp_path):
    """An interruption inside close() can leave the process group half destroyed (no longer
    "initialized", its gloo backend still referenced): a rank that was part of a multi-rank job
    still leaves with os._exit, so the interpreter never finalizes with a live gloo group (which
    aborts: "terminate called without an active exception")."""
    import subprocess
    import sys

    code = (
        "import atexit, sys\n"
        "from torch.distributed import HashStore\n"
        "from te_npu.training.job import run_job\n"
        "atexit.register(lambda: print('finalized', flush=True))\n"
        "def body(stop):\n"
        "    stop.watch.start(600, store=HashStore(), rank=0, world=2)  # as the trainer does with its group\n"
        "    raise ValueError('after the group was torn down')\n"
        "sys.exit(run_job(body))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=str(tmp_path))
    assert done.returncode == EXIT_ERROR, done.stderr
    assert "finalized" not in done.stdout and "ValueError: after the group was torn down" in done.stderr


@pytest.mark.parametrize("message, timed_out", [
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30000ms for send operation "
     "to complete", True),
    ("Application timeout caused pair closure", True),
    ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600000 ms", True),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:27045", False),
    ("mat1 and mat2 shapes cannot be multiplied", False),
], ids=["gloo-recv", "gloo-pair", "nccl-watchdog", "peer-closed", "other"])
def test_job_collective_timeouts_are_recognised_through_the_chain(message, timed_out):
    from te_npu.training.job import is_collective_timeout

    try:
        try:
            raise RuntimeError(message)
        except RuntimeError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert is_collective_timeout(outer) is timed_out


def test_job_a_peer_gone_without_failing_is_left_to_the_launcher_in_one_line_exit_4(tmp_path):
    """Issue 29: a collective broke on a closed connection and the peer's process is gone (its
    node lost): exit 4 (EXIT_STALLED), the line left for the launcher, nothing printed."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    code = (
        "import json, sys\n"
        "from torch.distributed import HashStore\n"
        "from te_npu.training.job import run_job\n"
        "def body(stop):\n"
        "    store = HashStore()\n"
        "    stop.watch.start(600, store=store, rank=0, world=2)\n"
        f"    store.set('te_npu/heartbeat/1', json.dumps({{'beat': 3, 'pid': {int(dead.stdout)}, 'host': 'h', 'node': 1, "
        "'pidns': stop.watch._pidns}))\n"
        "    raise RuntimeError('[pair.cc:534] Connection closed by peer [127.0.0.1]:1234')\n"
        "sys.exit(run_job(body))\n"
    )
    notes = tmp_path / "launcher"
    notes.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env["TE_NPU_MAPPED_FILES"] = str(notes)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=str(tmp_path))
    assert done.returncode == 4 and done.stderr == "", done.stderr
    line = (notes / "lost_rank0.txt").read_text()
    assert line.startswith("node 1 (rank 1, host h) lost: connections closed and the process of rank 1 ended; "), line
    del env["TE_NPU_MAPPED_FILES"]  # a plain torchrun: the rank prints the line itself
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=str(tmp_path))
    assert done.returncode == 4 and done.stderr.splitlines() == [f"[rank 0] {line}"], done.stderr
