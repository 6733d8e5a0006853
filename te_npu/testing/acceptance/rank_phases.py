"""One rank's part of an acceptance job: its phases, each leaving ``jobs/<job>/<phase>/rank<r>.json``.

Jobs (``te_npu.testing.acceptance.matrix``): ``train-<fmt>`` runs the phases of ``PHASES`` (the
main phase saves a DCP step ``SHORT_STEPS`` before its end and keeps its later steps, masters and
weights for the resume); ``resume-<fmt>`` loads that step in fresh processes and trains
``SHORT_STEPS`` more; ``perf`` times warm-up + steady steps per format with no probe subscribed
(profiling off); ``profile`` runs the same configuration under the profiler
(``te_npu.testing.step_profile``) for ``PROFILE_STEPS`` steps after the warm-up.

Every phase is a fresh ``Trainer`` in the job's process group (``job_process_group``: a group
torchrun's store has seen destroyed cannot be made again in the same processes). A phase's error
is recorded, never raised on one rank (the next phase still runs); on more ranks it ends the job on
every rank (``te_npu.training.job.run_job``: none is left waiting in a collective), and the
orchestrator starts the job again for its remaining phases.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from te_npu.testing.acceptance import rules as R
from te_npu.testing.acceptance.evidence import peak_memory, phase_evidence, reset_peak_memory
from te_npu.testing.acceptance.job_files import JobFiles, write_json
from te_npu.testing.acceptance.matrix import (
    MISALIGNED_FQN,
    MISALIGNED_SHAPE,
    PERF_STEADY,
    PERF_WARMUP,
    PHASES,
    PROFILE_STEPS,
    SHORT_STEPS,
    phase_rules,
)
from te_npu.testing.acceptance.run_config import RunSettings
from te_npu.testing.acceptance.runs import closing, make_trainer, resume_phase, run_phase, step_record
from te_npu.testing.step_profile import profile_steps
from te_npu.training.job import lost_a_peer
from te_npu.training.trainer import Trainer

__all__ = ["job_process_group", "run_rank_job"]


@contextlib.contextmanager
def job_process_group(settings: RunSettings):
    """The ranks' process group, for every phase this process runs (each phase's Trainer joins it)."""
    owned = False
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():
        if settings.npu:
            torch.npu.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("hccl" if settings.npu else "gloo", timeout=datetime.timedelta(minutes=30))
        owned = True
    yield  # an exception leaves without a barrier: run_job aborts the group, the peers are stopped
    if owned:
        dist.barrier()
        dist.destroy_process_group()


def run_rank_job(settings: RunSettings, job: str, phases: list[str]) -> None:
    """This rank's part of ``job`` for ``phases``, inside :func:`job_process_group`."""
    with job_process_group(settings):
        _run_phases(settings, job, phases)


def _run_phases(settings: RunSettings, job: str, phases: list[str]) -> None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    jobdir = JobFiles(settings.out, settings.nproc).job_dir(job)
    kind, _, fmt = job.partition("-")
    for phase in (["resume"] if kind == "resume" else phases):  # perf / profile: the phases are formats
        body = {"train": lambda: _train(settings, fmt, phase, jobdir, rank, world),
                "resume": lambda: _resume(settings, fmt, jobdir, rank),
                "perf": lambda: _perf(settings, phase, jobdir / phase),
                "profile": lambda: _profiled(settings, phase, jobdir / phase, rank)}[kind]
        _record_phase(settings, jobdir / phase / f"rank{rank}.json", rank, world, body)


def _record_phase(settings: RunSettings, out: Path, rank: int, world: int, body) -> None:
    """Run one phase on this rank, writing ``out`` with its time and peak memory (module doc)."""
    host_reset = reset_peak_memory(settings.npu)
    start = time.time()
    try:
        data = body()
    except Exception as exc:  # noqa: BLE001 - recorded as the phase's failure
        data = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        data.update(seconds=round(time.time() - start, 1), world=world, memory=peak_memory(settings.npu, host_reset))
        write_json(out, data)
        if not lost_a_peer(exc):  # this rank's own failure: the phase ended (a peer's death is not one)
            write_json(out.with_name("ended.json"), {"failed_on_rank": rank, "error": data["error"]})
        if world > 1:
            raise  # the job ends on every rank (run_job), none waits in a collective; the orchestrator goes on
        return
    data.update(seconds=round(time.time() - start, 1), world=world, memory=peak_memory(settings.npu, host_reset))
    write_json(out, data)


def _train(settings: RunSettings, fmt: str, phase: str, jobdir: Path, rank: int, world: int) -> dict:
    extra, steps = PHASES[phase]
    steps = settings.steps if steps is None else steps
    cfg = settings.config(fmt, jobdir / phase, extra)
    if phase == "misaligned":
        return _misaligned(settings, cfg)
    save_at = steps - SHORT_STEPS if phase == "main" and steps > SHORT_STEPS else None
    dcp_dir = str(jobdir / "dcp")
    result = run_phase(settings.model.task(), cfg, steps, save_at=save_at, save_dir=dcp_dir)
    data = {"rules": phase_rules(settings, fmt, phase, result, cfg, world, steps), **phase_evidence(result),
            "save_at": save_at, "config": cfg.to_dict()}
    if save_at is not None:
        data["rules"]["checkpoint_contents"] = R.check_checkpoint_contents(
            os.path.join(dcp_dir, f"step_{save_at}"), result, world)
        torch.save(result["masters"], jobdir / f"masters_rank{rank}.pt")
        write_json(jobdir / f"continuous_rank{rank}.json",
                   {"records": result["records"], "weights": phase_evidence(result)["weights"]})
    return data


def _misaligned(settings: RunSettings, cfg) -> dict:
    """Q3-10's shard row: setup must refuse the misaligned weight before any model exists."""
    trainer, _ = make_trainer(settings.model.task(), [])
    error = None
    try:
        with closing(trainer):
            trainer.setup(cfg)
    except Exception as exc:  # noqa: BLE001 - the refusal under test
        error = str(exc)
    problems = R.check_misaligned_shard(error, MISALIGNED_FQN, MISALIGNED_SHAPE, hasattr(trainer, "model"))
    return {"rules": {"misaligned_shard": problems}, "error_message": error}


def _resume(settings: RunSettings, fmt: str, jobdir: Path, rank: int) -> dict:
    source = settings.out / "jobs" / f"train-{fmt}"
    continuous = json.loads((source / f"continuous_rank{rank}.json").read_text())
    continuous["masters"] = torch.load(source / f"masters_rank{rank}.pt", weights_only=True)
    cfg = settings.config(fmt, jobdir / "resume")
    save_at = len(continuous["records"]) - SHORT_STEPS
    result = resume_phase(settings.model.task(), cfg, str(source / "dcp"), SHORT_STEPS)
    problems, measured = R.check_resume(continuous, result, save_at)
    return {"rules": {"resume": problems}, "measured": measured, **phase_evidence(result)}


def _plain_trainer(settings: RunSettings, lines: list[str]):
    """A production Trainer with no probe subscribed (the timing and profiled phases)."""
    return Trainer(settings.model.task(), print_fn=lines.append)


def _perf(settings: RunSettings, fmt: str, workdir: Path) -> dict:
    """Warm-up + steady optimizer steps with no probe subscribed (profiling off), the raw per-step data."""
    warmup = PERF_WARMUP["npu" if settings.npu else "cpu"]
    cfg = settings.config(fmt, workdir)
    lines: list[str] = []
    trainer = _plain_trainer(settings, lines)
    with closing(trainer):
        trainer.setup(cfg)
        records = [step_record(trainer.train_step()) for _ in range(warmup + PERF_STEADY)]
    return {"records": records, "warmup": warmup, "config": cfg.to_dict(), "lines": lines[-10:]}


def _profiled(settings: RunSettings, fmt: str, workdir: Path, rank: int) -> dict:
    """The timing job's configuration, warm-up, then PROFILE_STEPS steps under the profiler: the
    time shares of quant / MM-GMM / all-gather / reduce-scatter, the trace and table in ``<workdir>/rank<r>/``."""
    warmup = PERF_WARMUP["npu" if settings.npu else "cpu"]
    cfg = settings.config(fmt, workdir)
    lines: list[str] = []
    records: list[dict] = []
    trainer = _plain_trainer(settings, lines)
    with closing(trainer):
        trainer.setup(cfg)
        for _ in range(warmup):
            trainer.train_step()
        profile = profile_steps(lambda: records.append(step_record(trainer.train_step())), PROFILE_STEPS,
                                workdir / f"rank{rank}", npu=settings.npu)
    profile["files"] = [f"{fmt}/rank{rank}/{name}" for name in profile["files"]]
    return {"records": records, "warmup": warmup, **profile, "lines": lines[-10:]}
