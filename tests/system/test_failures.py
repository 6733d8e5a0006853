"""Issues 15 and 21 through the real launcher: failures are loud, fast and lose nothing.

Each test starts ``python -m te_npu.training.launch`` (torchrun) on 2 CPU ranks with the tiny
recipe shrunk to 2 layers and seq 64, optionally with one injected fault
(``tests/system/faulty_pretrain.py``), and checks exit codes, what is printed, which processes
are left and what the checkpoint folder holds. A ``wait`` that times out means a hang.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from te_npu.distributed.storage import dcp
from tests.distributed.harness import _free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "dsv3_tiny_mxfp8.yaml"
SMALL = ["model.overrides={num_hidden_layers: 2, n_shared_experts: 2}", "training.seq_len=64",
         "training.eval_interval=0", "logging.plot=false", "training.warmup_steps=2"]
HANG = 120  # seconds after which a job that should have ended counts as hung


class Job:
    """One launched job; ``markers`` holds ``rank step pid`` lines written after each step."""

    def __init__(self, workdir: Path, *overrides: str, fault: str = "", nproc: int = 2, ckpt: Path | None = None,
                 module: str = "tests.system.faulty_pretrain", prefix: tuple[str, ...] = ()):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.ckpt = ckpt or workdir / "ckpt"
        self.markers = workdir / "steps.txt"
        self.log = workdir / "out.txt"
        faults = ",".join(filter(None, [f"step_marker:{self.markers}", fault]))
        env = dict(os.environ, FAULT=faults, OMP_NUM_THREADS="1",
                   PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        cmd = [sys.executable, "-m", "te_npu.training.launch", "--nproc_per_node", str(nproc),
               "--master_port", str(_free_port()), "-m", module, "--config", str(RECIPE), *SMALL,
               "training.quant_kernel=eager",
               f"logging.dir={workdir / 'logs'}", f"checkpoint.dir={self.ckpt}", *overrides]
        self.started = time.monotonic()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([*prefix, *cmd], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait(self, timeout: float = HANG) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job hung for {timeout} s:\n{self.output()}") from None

    def kill(self) -> None:
        for pid in self.worker_pids().values():
            _signal(pid, signal.SIGKILL)
        _signal(-self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def output(self) -> str:
        return self.log.read_text()

    def steps_done(self) -> int:
        """The last step every rank has finished."""
        fields = self.markers.read_text().split() if self.markers.exists() else []
        last: dict[str, int] = {}
        for rank, step in zip(fields[0::3], fields[1::3]):
            last[rank] = max(last.get(rank, 0), int(step))
        return min(last.values()) if len(last) == 2 else 0

    def worker_pids(self) -> dict[int, int]:
        if not self.markers.exists():
            return {}
        fields = self.markers.read_text().split()
        return {int(r): int(p) for r, p in zip(fields[0::3], fields[2::3])}

    def wait_for(self, condition, what: str, timeout: float = HANG) -> None:
        end = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended ({self.proc.returncode}) before {what}:\n{self.output()}")
            if time.monotonic() > end:
                self.kill()
                raise AssertionError(f"timed out waiting for {what}:\n{self.output()}")
            time.sleep(0.2)

    def wait_steps(self, n: int) -> dict[int, int]:
        self.wait_for(lambda: len(self.worker_pids()) == 2 and self.steps_done() >= n, f"{n} steps")
        return self.worker_pids()


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        assert time.monotonic() < end, f"processes {[p for p in pids if _alive(p)]} still alive after {timeout} s"
        time.sleep(0.2)


def _latest_verified(directory: Path) -> str:
    path = dcp.latest_checkpoint(directory)
    dcp.verify_step(path)
    return os.path.basename(path)


# ---- 1. one failing rank: one report, every rank out ----------------------------------------------


def test_failure_on_one_rank_is_reported_once_and_stops_every_rank(tmp_path):
    job = Job(tmp_path, "training.train_steps=50", fault="raise:1:3")
    assert job.wait() == 1
    out = job.output()
    assert out.count("injected fault on rank 1 at iteration 3") == 2  # the report's first line + traceback's last
    assert out.count("Traceback") == 1 and "[rank 1/2] failed: ValueError" in out
    assert "Connection closed" not in out  # the peer's secondary error stays silent
    _wait_gone(job.worker_pids().values())


# ---- 2. signals ---------------------------------------------------------------------------------------


def test_sigint_to_the_launcher_stops_every_rank_and_keeps_latest(tmp_path):
    job = Job(tmp_path, "training.train_steps=200", "checkpoint.interval=1", "checkpoint.keep_last=2")
    pids = job.wait_steps(3)
    os.kill(job.proc.pid, signal.SIGINT)
    assert job.wait() == 128 + signal.SIGINT
    _wait_gone(pids.values(), timeout=5)
    out = job.output()
    assert out.count("interrupted by SIGINT; stopped without saving") == 1, out
    assert int(_latest_verified(job.ckpt).removeprefix("step_")) >= 2


def test_sigint_to_one_rank_stops_the_job(tmp_path):
    job = Job(tmp_path, "training.train_steps=200", "checkpoint.interval=2")
    pids = job.wait_steps(3)
    os.kill(pids[1], signal.SIGINT)
    assert job.wait() == 128 + signal.SIGINT
    _wait_gone(pids.values(), timeout=5)
    assert "[rank 1/2] interrupted by SIGINT" in job.output()


def test_sigint_during_a_save_leaves_the_previous_latest(tmp_path):
    saving = tmp_path / "saving"
    job = Job(tmp_path, "training.train_steps=200", "checkpoint.interval=2",
              fault=f"save_marker:{saving},slow_save:60:4")
    job.wait_for(saving.exists, "the save of step 4")
    os.kill(job.proc.pid, signal.SIGINT)
    assert job.wait() == 128 + signal.SIGINT
    assert _latest_verified(job.ckpt) == "step_2"
    assert (job.ckpt / "step_4.tmp").is_dir() and not (job.ckpt / "step_4").exists()


def test_sigterm_with_save_on_sigterm_saves_then_exits(tmp_path):
    job = Job(tmp_path, "training.train_steps=200", "checkpoint.interval=0", "checkpoint.save_on_sigterm=true")
    job.wait_steps(3)
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.wait() == 128 + signal.SIGTERM
    out = job.output()
    step = int(_latest_verified(job.ckpt).removeprefix("step_"))
    assert step >= 3 and f"stopped on SIGTERM after iteration {step} (checkpoint saved)" in out, out


# ---- 3. orphans and the folder lock -------------------------------------------------------------------


def test_killed_launcher_leaves_no_orphans_and_the_lock_guards_the_folder(tmp_path):
    first = Job(tmp_path / "a", "training.train_steps=400", "checkpoint.interval=2")
    pids = first.wait_steps(3)
    second = Job(tmp_path / "b", "training.train_steps=400", ckpt=first.ckpt)  # same folder, while it runs
    assert second.wait() == 2
    out = second.output()
    assert "is in use by another job" in out and f"pid {pids[0]}" in out and "Traceback" not in out
    os.killpg(first.proc.pid, signal.SIGKILL)  # the launcher's whole group: the ranks are in their own sessions
    first.proc.wait()
    _wait_gone(pids.values(), timeout=10)
    saved = int(dcp.latest_checkpoint(first.ckpt).rsplit("_", 1)[1])
    third = Job(tmp_path / "c", f"training.train_steps={saved + 2}", "checkpoint.resume=auto", ckpt=first.ckpt)
    assert third.wait() == 0, third.output()
    out = third.output()
    assert f"resumed from checkpoint at iteration {saved}" in out  # the folder is free again once they are gone


# ---- 4. a diverged run --------------------------------------------------------------------------------


def test_diverged_run_stops_nonzero_and_keeps_the_good_checkpoints(tmp_path):
    good = Job(tmp_path / "good", "training.train_steps=4", "checkpoint.interval=2", "checkpoint.keep_last=2")
    assert good.wait() == 0
    bad = Job(tmp_path / "bad", "training.train_steps=30", "checkpoint.interval=2", "checkpoint.keep_last=2",
              "checkpoint.resume=auto", "training.lr=1e4", "training.warmup_steps=0", ckpt=good.ckpt)
    assert bad.wait() == 3
    out = bad.output()
    assert out.count("training stopped (diverged)") == 1 and "nothing saved, no checkpoint pruned" in out
    assert (good.ckpt / "step_4").is_dir()  # the last good checkpoint survives (keep_last=2)
    assert _latest_verified(good.ckpt) == "step_4"


def test_diverged_fresh_run_keeps_no_checkpoint_saved_after_the_divergence_began(tmp_path):
    """The issue's run: lr 1e4, the loss jumps, then sits at ln(256) with grad norm 0; its step_4 used to
    be kept as the only checkpoint. Saves every step, so one lands after the divergence began."""
    job = Job(tmp_path, "training.train_steps=30", "checkpoint.interval=1", "checkpoint.keep_last=2",
              "training.lr=1e4", "training.warmup_steps=0")
    assert job.wait() == 3
    out = job.output()
    assert out.count("training stopped (diverged)") == 1, out
    line = next(x for x in out.splitlines() if "training stopped (diverged)" in x)
    assert "training.max_loss_factor" in line or "training.collapse_steps" in line, line
    began = int(line.split("divergence began at iteration ")[1].split(")")[0])
    assert f"moved to {job.ckpt / 'diverged'}" in line, line
    assert all(step < began - 1 for step in dcp.list_steps(job.ckpt)), os.listdir(job.ckpt)
    assert os.listdir(job.ckpt / "diverged")  # set aside, not deleted
    if dcp.list_steps(job.ckpt):
        assert int(_latest_verified(job.ckpt).removeprefix("step_")) < began - 1
    else:
        assert not (job.ckpt / "latest").exists()  # nothing good: a restart starts over, not from a dead model


# ---- 5. configuration and data errors: one line, exit 2 -----------------------------------------------


@pytest.mark.parametrize("case", ["yaml_syntax", "empty_file", "bad_token_ids", "edited_tokens"])
def test_config_errors_through_the_launcher_script_are_one_line(tmp_path, case):
    import numpy as np

    from te_npu.training.data import write_token_file

    recipe, extra = RECIPE, []
    if case == "yaml_syntax":
        recipe = tmp_path / "bad.yaml"
        recipe.write_text(RECIPE.read_text().replace("  lr: 3.0e-3", "  lr: [3.0e-3"))
    elif case == "empty_file":
        recipe = tmp_path / "empty.yaml"
        recipe.write_text("")
    else:  # a token file edited after its header was written
        ids = np.random.default_rng(0).integers(1, 256, size=200_000)
        write_token_file(tmp_path / "bad", [("d", b"", ids)], vocab_size=256, tokenizer={}, eos_token_id=None,
                         split="train")
        tokens = np.memmap(tmp_path / "bad.bin", dtype=np.uint16, mode="r+")
        tokens[5000:5010] = 40000 if case == "bad_token_ids" else 7
        tokens.flush()
        if case == "bad_token_ids":  # a header without a digest (older files): the id scan finds it
            meta = json.loads((tmp_path / "bad.json").read_text())
            del meta["sha256"]
            (tmp_path / "bad.json").write_text(json.dumps(meta))
        extra = ["data.kind=bin", f"data.path={tmp_path / 'bad'}", "data.shuffle=false"]
    env = dict(os.environ, RECIPE=str(recipe), MASTER_PORT=str(_free_port()))
    done = subprocess.run(["bash", "scripts/pretrain_dsv3.sh", *SMALL, "training.quant_kernel=eager",
                           f"logging.dir={tmp_path / 'logs'}",
                           f"checkpoint.dir={tmp_path / 'ckpt'}", *extra], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=HANG)
    lines = (done.stdout + done.stderr).strip().splitlines()
    errors = [line for line in lines if "Error" in line]
    assert done.returncode == 2 and len(errors) == 1 and errors[0].startswith("ConfigError: "), lines
    assert "Traceback" not in done.stderr and len(lines) == 1, lines
    if case == "bad_token_ids":
        assert "token id 40000 at token offset 5000" in errors[0]
    if case == "edited_tokens":
        assert "bad.bin: its SHA-256 is" in errors[0] and errors[0].startswith("ConfigError: data.path: "), errors[0]


# ---- 6. a 2-rank checkpoint resumes on 1 rank ------------------------------------------------------------


def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path):
    two = Job(tmp_path / "two", "training.train_steps=4", "checkpoint.interval=2")
    assert two.wait() == 0
    one = Job(tmp_path / "one", "training.train_steps=6", "checkpoint.resume=auto", "fsdp_config.dp_shard_size=1",
              nproc=1, ckpt=two.ckpt)
    assert one.wait() == 0, one.output()
    out = one.output()
    assert "resumed from checkpoint at iteration 4" in out and "consumed samples 32)" in out
    assert "consumed samples:           36" in out  # 1 rank x micro batch 4 after the 32 of the 2-rank run


# ---- 7. a rank blocked outside Python still leaves after a signal ---------------------------------------


def test_watchdog_ends_a_rank_blocked_in_a_collective(tmp_path):
    code = (
        "import datetime, os, signal, threading, time\n"
        "import torch.distributed as dist\n"
        "from te_npu.training import job\n"
        "job.SIGNAL_GRACE_S = 1.0\n"
        "def body(stop):\n"
        "    store = dist.TCPStore('127.0.0.1', 0, 1, True, timeout=datetime.timedelta(seconds=60))\n"
        "    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
        "    store.wait(['never'])  # blocks in C++: the Python handler cannot run\n"
        "raise SystemExit(job.run_job(body))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=HANG)
    # 143 from the watchdog (the store's own 60 s timeout would raise instead: exit code 1)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "still running 1 s after SIGTERM" in done.stderr


# ---- 8. issue 21: rollback, the publication window, stalls, crafted metadata, a full disk -------------


def _train_records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "train"]


def test_rollback_with_load_step_redoes_the_steps_bitwise_and_keeps_the_newer_ones(tmp_path):
    """The issue's repro: 12 steps saving every 4, then checkpoint.load_step=4 with train_steps=12
    used to exit 1 at the save of step 8 (Errno 39) on every restart."""
    first = Job(tmp_path / "a", "training.train_steps=12", "checkpoint.interval=4", "checkpoint.keep_last=0")
    assert first.wait() == 0, first.output()
    again = Job(tmp_path / "b", "training.train_steps=12", "checkpoint.interval=4", "checkpoint.keep_last=0",
                "checkpoint.resume=auto",
                "checkpoint.load_step=4", f"logging.dir={first.workdir / 'logs'}", ckpt=first.ckpt)
    assert again.wait() == 0, again.output()
    out = again.output()
    assert "Traceback" not in out and "resumed from checkpoint at iteration 4" in out
    assert f"newer steps (step_8, step_12) were moved to {first.ckpt / 'abandoned'}" in out, out
    assert _latest_verified(first.ckpt) == "step_12" and dcp.list_steps(first.ckpt) == [4, 8, 12]
    assert sorted(os.listdir(first.ckpt / "abandoned")) == ["step_12", "step_8"]
    metrics = first.workdir / "logs" / "metrics.jsonl"
    steps = [r["step"] for r in _train_records(metrics)]
    assert steps == list(range(1, 13)), steps  # every step once
    redone = {r["step"]: r["lm_loss"] for r in _train_records(metrics.with_suffix(".redone.jsonl"))}
    again_losses = {r["step"]: r["lm_loss"] for r in _train_records(metrics) if r["step"] > 4}
    assert redone == again_losses and sorted(redone) == list(range(5, 13))  # the redo is bitwise the same


def test_kill_between_publication_and_rename_resumes_from_the_published_step(tmp_path):
    job = Job(tmp_path / "a", "training.train_steps=20", "checkpoint.interval=4", fault="die_after_publish:8")
    assert job.wait() != 0
    assert (job.ckpt / "latest").read_text() == "step_8" and not (job.ckpt / "step_8").exists()
    assert (job.ckpt / "step_8.tmp" / "manifest.json").is_file()
    again = Job(tmp_path / "b", "training.train_steps=10", "checkpoint.interval=4", "checkpoint.resume=auto",
                ckpt=job.ckpt)
    assert again.wait() == 0, again.output()
    out = again.output()
    assert "finished the interrupted save of step_8" in out and "resumed from checkpoint at iteration 8" in out, out
    assert _latest_verified(job.ckpt) == "step_10" and dcp.list_steps(job.ckpt) == [8, 10]  # keep_last 2


def test_sigstop_of_one_rank_ends_the_job_naming_it(tmp_path):
    """A frozen rank (SIGSTOP: as a rank in D state or a dead host) used to hang the job silently."""
    job = Job(tmp_path, "training.train_steps=400", "training.collective_timeout_s=10")
    pids = job.wait_steps(3)
    try:
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        job.wait_for(lambda: "stalled" in job.output(), "the stall report")
        named = time.monotonic() - stopped
        code = job.wait()
        took = time.monotonic() - stopped
        _wait_gone(pids.values())
    finally:
        for pid in pids.values():
            _signal(pid, signal.SIGKILL)
    out = job.output()
    lines = [x for x in out.splitlines() if "stalled" in x]
    assert code == 4 and len(lines) == 1, out
    assert lines[0].startswith("[rank 0/2] stalled: rank 1 (pid ") and f"pid {pids[1]}," in lines[0], lines[0]
    assert "has sent no heartbeat for" in lines[0] and "Traceback" not in out
    print(f"SIGSTOP of rank 1: named after {named:.1f} s, job exited {code} after {took:.1f} s "
          "(collective_timeout_s=10; torchrun SIGKILLs a stopped rank after its 30 s grace)")


def test_crafted_metadata_is_refused_through_the_launcher_and_runs_no_code(tmp_path):
    import pickle

    from te_npu.distributed.storage.manifest import file_entry

    first = Job(tmp_path / "a", "training.train_steps=4", "checkpoint.interval=2")
    assert first.wait() == 0
    step = first.ckpt / "step_4"
    marker = tmp_path / "code_ran"

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (step / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    manifest = json.loads((step / "manifest.json").read_text())  # whoever can write the folder re-hashes it
    manifest["files"][".metadata"] = file_entry(str(step / ".metadata"))
    (step / "manifest.json").write_text(json.dumps(manifest))
    again = Job(tmp_path / "b", "training.train_steps=6", "checkpoint.resume=auto", ckpt=first.ckpt)
    assert again.wait() == 2
    lines = again.output().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ConfigError: "), lines
    assert "step_4/.metadata: refused: it names the global posix.system" in lines[0], lines[0]
    assert not marker.exists()


def _tiny_disk(mount: Path, size: str) -> tuple[str, ...]:
    """A command prefix that runs the rest on a private tmpfs of ``size`` at ``mount`` (user namespace)."""
    mount.mkdir(parents=True, exist_ok=True)
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {mount}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs here (unshare -Urm): {probe.stderr.strip()}")
    return ("unshare", "-Urm", "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs {mount} && exec "$@"', "sh")


def test_a_save_that_cannot_fit_is_one_line_naming_the_folder_and_bytes(tmp_path):
    """A full disk used to be a 67-line traceback ("unexpected pos 704 vs 598")."""
    disk = tmp_path / "disk"
    job = Job(tmp_path, "training.train_steps=6", "checkpoint.interval=2", ckpt=disk / "ckpt",
              prefix=_tiny_disk(disk, "24m"))
    assert job.wait() == 1
    out = job.output()
    lines = [x for x in out.splitlines() if "free, the step needs about" in x]
    assert len(lines) == 1 and "Traceback" not in out, out
    assert f"checkpoint.save of step 2 to {disk / 'ckpt'}: {disk / 'ckpt'} has " in lines[0], lines[0]


def test_disk_full_in_the_middle_of_a_save_is_one_line(tmp_path):
    """The free-space check passes (its headroom is disabled here), then the disk fills while DCP writes."""
    disk = tmp_path / "disk"
    code = (
        "import sys, torch\n"
        "from te_npu.distributed import MasterWeightOptimizer\n"
        "from te_npu.distributed.storage import dcp\n"
        "from te_npu.training.job import run_job\n"
        "from tests.distributed.harness import build\n"
        "checkpoint._SPACE_MARGIN = (0.3, 0)\n"
        "def body(stop):\n"
        "    model, init = build('mxfp8', seed=0)\n"
        "    opt = MasterWeightOptimizer(model, init, lr=1e-2)\n"
        f"    dcp.save('{disk}/ckpt', model, opt, 1)\n"
        "sys.exit(run_job(body))\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([*_tiny_disk(disk, "600k"), sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=HANG)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len([x for x in err if "no space left on the device" in x]) == 1, done.stderr
    assert "Traceback" not in done.stderr and f"of {disk}/ckpt" in done.stderr


def test_converter_errors_are_one_line_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "scripts/convert_checkpoint.py", "dcp-to-hf", "--config", str(RECIPE),
                           "--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "hf")], cwd=REPO,
                          capture_output=True, text=True, timeout=HANG,
                          env=dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("ConfigError: "), lines
    assert "is not a te_npu DCP checkpoint" in lines[0]


# ---- 9. issue 32: a busy rank is named, a compile is not a stall ------------------------------------


@pytest.mark.parametrize("fault", ["busy:1:3:25:sleep", "busy:1:3:25:gil", "busy:1:3:25:spin", "busy_save:1:2:25"],
                         ids=["sleep", "gil", "spin", "save"])
def test_a_rank_busy_past_the_collective_timeout_is_named_exit_4(tmp_path, fault):
    """A live rank busy past training.collective_timeout_s used to end with gloo's 60-line
    `Timed out waiting 10000ms` traceback naming no rank, exit 1."""
    job = Job(tmp_path, "training.train_steps=6", "training.collective_timeout_s=10", "checkpoint.interval=2",
              fault=fault)
    job.wait_for(lambda: "faulty_pretrain: rank 1 busy for" in job.output(), "the busy rank")
    busy = time.monotonic()
    code = job.wait()
    took = time.monotonic() - busy
    out = job.output()
    lines = [x for x in out.splitlines() if "stalled:" in x]
    assert code == 4 and len(lines) == 1 and "Traceback" not in out, out
    pids = job.worker_pids()
    assert f"rank 1 (pid {pids[1]}, host " in lines[0], lines[0]
    if fault.endswith(":gil"):  # its heartbeat thread cannot run while it holds the GIL
        assert "has sent no heartbeat for" in lines[0], lines[0]
    else:
        what = "checkpoint save" if fault.startswith("busy_save") else "optimizer step"
        assert f"is alive but in iteration {2 if 'save' in fault else 3}, {what} for" in lines[0], lines[0]
        assert "the other ranks waited for it" in lines[0], lines[0]
        assert "while this rank was in iteration" in lines[0], lines[0]
    assert "launch: the job failed with exit code 4" in out, out
    print(f"{fault}: exit {code} {took:.1f} s after rank 1 turned busy (collective_timeout_s=10); {lines[0]}")


def test_a_cold_compile_of_the_first_step_is_not_a_stall(tmp_path):
    """torch.compile of the quantization kernels with an empty inductor cache takes ~10-19 s in the
    first step (and the first evaluation): at collective_timeout_s=5 that used to end a healthy job
    as a stall (exit 4). The warm-up gets training.first_step_timeout_s instead."""
    cache = tmp_path / "inductor"
    cache.mkdir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # inherited by the launched job (a cold cache)
    try:
        job = Job(tmp_path, "training.train_steps=4", "training.collective_timeout_s=5", "training.eval_interval=2",
                  "training.quant_kernel=compiled", "checkpoint.interval=0")
    finally:
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]
    code = job.wait(timeout=600)
    out = job.output()
    assert code == 0 and "stalled" not in out, out
    first = next(x for x in out.splitlines() if "iteration        1/" in x)
    ms = float(first.split("elapsed time per iteration (ms): ")[1].split(" |")[0])
    assert "quantization kernel: compiled" in out and "validation loss at iteration 2" in out, out
    assert any(cache.iterdir())  # the compile did run cold, into this cache
    print(f"cold compiled first step: {ms / 1e3:.1f} s at collective_timeout_s=5, exit {code}")


# ---- 10. issue 32: an export is never lost or destructive ---------------------------------------------


def test_an_interrupted_export_is_completed_by_the_rerun_and_keeps_a_users_file(tmp_path):
    """SIGTERM during the final HF export, then the same command: the rerun used to say 'training already
    complete; nothing to do' and leave hf/step_4.tmp; a later export deleted a file the user added to it."""
    export, marker = tmp_path / "export", tmp_path / "exporting"
    hf = ("checkpoint.last_save_format=hf", f"checkpoint.export_dir={export}", "checkpoint.interval=2")
    first = Job(tmp_path / "a", "training.train_steps=4", *hf, fault=f"save_marker:{marker},slow_export:60")
    first.wait_for(marker.exists, "the HF export")
    os.kill(first.proc.pid, signal.SIGTERM)
    assert first.wait() == 128 + signal.SIGTERM
    assert (tmp_path / "export.tmp").is_dir() and not export.exists()
    again = Job(tmp_path / "b", "training.train_steps=4", *hf, ckpt=first.ckpt)
    assert again.wait() == 0, again.output()
    out = again.output()
    assert "training already complete at iteration 4, its HF export is not (an interrupted export" in out, out
    assert f"; it replaces the interrupted export left in {export}.tmp" in out, out
    record = json.loads((export / "te_npu_export.json").read_text())
    assert record["step"] == 4 and "model.safetensors" in record["files"] and not (tmp_path / "export.tmp").exists()
    (export / "tokenizer.json").write_text('{"user": true}')
    more = Job(tmp_path / "c", "training.train_steps=6", *hf, ckpt=first.ckpt)
    assert more.wait() == 0, more.output()
    notes = [x for x in more.output().splitlines() if "note: kept" in x]
    assert notes == [f" note: kept tokenizer.json in {export}: not written by the earlier export of this run it "
                     "replaces, so left as it was"], more.output()
    assert (export / "tokenizer.json").read_text() == '{"user": true}'
    assert json.loads((export / "te_npu_export.json").read_text())["step"] == 6
    # the converter on that step, over an interrupted export of it, completes it too
    (tmp_path / "conv.tmp" / "sharded").mkdir(parents=True)
    (tmp_path / "conv.tmp" / "sharded" / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"partial")
    done = subprocess.run([sys.executable, "scripts/convert_checkpoint.py", "dcp-to-hf", "--config", str(RECIPE),
                           "--checkpoint", str(first.ckpt), "--out", str(tmp_path / "conv"), "--no-progress", *SMALL],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG,
                          env=dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))
    assert done.returncode == 0, done.stderr
    assert f"it completes the interrupted export left in {tmp_path / 'conv'}.tmp" in done.stdout, done.stdout
    assert json.loads((tmp_path / "conv" / "te_npu_export.json").read_text())["step"] == 6


# ---- 11. issue 32: the launcher's summary names the first rank to die, and a truncated data file ----------


def test_kill_9_of_one_rank_is_named_by_the_launcher(tmp_path):
    """The summary used to name rank 0's "Connection closed by peer" instead of rank 1's SIGKILL."""
    job = Job(tmp_path, "training.train_steps=400")
    pids = job.wait_steps(3)
    os.kill(pids[1], signal.SIGKILL)
    assert job.wait() == 128 + signal.SIGKILL
    out = job.output()
    summary = [x for x in out.splitlines() if x.startswith("launch: ")]
    assert summary and summary[0].startswith(f"launch: the job failed: rank 1 (pid {pids[1]}) was killed by SIGKILL, "
                                             "the first rank to fail"), out
    assert "Traceback" not in out, out


def test_a_data_file_truncated_while_the_job_runs_is_named_exit_2(tmp_path):
    """A .bin truncated under the running job used to end with only `rank 0 was killed by SIGBUS`."""
    import numpy as np

    from te_npu.training.data import write_token_file

    ids = np.random.default_rng(0).integers(1, 256, size=400_000)
    write_token_file(tmp_path / "tok", [("d", b"", ids)], vocab_size=256, tokenizer={}, eos_token_id=None,
                     split="train")
    job = Job(tmp_path, "training.train_steps=400", "data.kind=bin", f"data.path={tmp_path / 'tok'}")
    job.wait_steps(2)
    os.truncate(tmp_path / "tok.bin", 4096)
    code = job.wait()
    out = job.output()
    line = next((x for x in out.splitlines() if x.startswith("launch: ")), "")
    assert code == 2, out
    assert "was killed by SIGBUS reading a file that changed under it: " in line, out
    assert f"{tmp_path / 'tok.bin'} is now 4096 bytes, 800000 when the job mapped it" in line, line


# ---- 12. issue 32: a clean shutdown never aborts ------------------------------------------------------

SHUTDOWNS = 100


def _shutdowns(tmp_path, runs: int, **env) -> list[tuple[int, str]]:
    """Run ``tests/system/shutdown_job.py`` ``runs`` times (3 at once) through the launcher; (exit code, output) each."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[int, str]:
        cmd = [sys.executable, "-m", "te_npu.training.launch", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), "-m", "tests.system.shutdown_job", str(tmp_path / f"run{i}")]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=HANG,
                              env=dict(os.environ, OMP_NUM_THREADS="1", **env,
                                       PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))
        return done.returncode, done.stdout + done.stderr

    with ThreadPoolExecutor(3) as pool:
        return list(pool.map(one, range(runs)))


def test_clean_two_rank_shutdowns_never_abort(tmp_path):
    """A successful run ended once in ~80 with `terminate called without an active exception` (SIGABRT,
    exit 134) after its last save: a daemon thread inside a torch C++ call (a store get / set) while the
    interpreter finalizes is ended by pthread_exit, whose unwinding through pybind11's noexcept GIL guard
    calls std::terminate. A rank of a multi-rank job now never finalizes (it leaves with os._exit once
    its body is done) and the stall watch is joined for good in stop()."""
    stray = {"SHUTDOWN_STRAY_THREAD": "1"}
    finalizing = _shutdowns(tmp_path / "plain_exit", 3, SHUTDOWN_PLAIN_EXIT="1", **stray)
    aborted = [out for code, out in finalizing if "terminate called without an active exception" in out]
    assert aborted, finalizing  # the mechanism: a stray store thread at finalization aborts
    results = _shutdowns(tmp_path / "stray", 5, **stray) + _shutdowns(tmp_path / "clean", SHUTDOWNS)
    bad = [(code, out) for code, out in results if code != 0 or "terminate called" in out]
    print(f"clean 2-rank shutdowns: {len(bad)} of {len(results)} failed or aborted "
          f"({len(aborted)} of {len(finalizing)} aborted with interpreter finalization and a stray store thread)")
    assert not bad, bad[:3]
