"""The acceptance run's order: which jobs still run, each until its phases ended, then the verdicts.

``orchestrate(settings, launch)``: one run per ``--out`` (``te_npu.testing.owned_jobs.JobFolder``);
the cases without a verdict in ``cases/<id>.json`` are to judge; every phase they read that has
not ended is run, job by job (training before resume, timing and profiling last), each job through
``launch(folder, job, phases)`` (torchrun's ranks, owned by the folder: they die with this
process). A phase that failed ended its job, so the job is launched again for the phases after it;
the phases of a launch a signal ended stay un-ended and are run again by a re-run. Then each case
whose phases all ended is judged (``verdicts.judge``) and the report written.

``in_torchrun(settings)``: the run started as a rank by ``torchrun`` itself: every rank runs the
jobs' phases in this process (Q3-09's resume in the same processes, with a fresh Trainer), then
rank 0 judges and reports.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from te_npu.testing.acceptance.job_files import JobFiles, write_json
from te_npu.testing.acceptance.matrix import NEEDS, REPORTED
from te_npu.testing.acceptance.rank_phases import job_process_group, run_rank_job
from te_npu.testing.acceptance.report import write_report
from te_npu.testing.acceptance.run_config import RunSettings
from te_npu.testing.acceptance.verdicts import judge
from te_npu.testing.owned_jobs import JobFolder, terminate_on_sigterm

__all__ = ["NAME", "orchestrate", "in_torchrun", "plan", "prepare_launch"]

NAME = "q3_acceptance"  # the prefix of every progress line (the command's name)
Launch = Callable[[JobFolder, str, list[str]], "int | None"]


def plan(settings: RunSettings) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """(cases to judge, cases finished before, job -> phases still to run), jobs in run order."""
    files = JobFiles(settings.out, settings.nproc)
    todo = [c for c in settings.cases if not files.case_file(c).exists()]
    needed: dict[str, list[str]] = {}
    for case in todo:
        for job, phase in [(j, p) for j, p, _ in NEEDS[case]] + REPORTED.get(case, []):
            if not files.ended(job, phase) and phase not in needed.setdefault(job, []):
                needed[job].append(phase)
    order = sorted(needed, key=lambda j: (j.startswith("resume"), j.startswith(("perf", "profile")), j))  # resume after train
    return todo, [c for c in settings.cases if c not in todo], {j: needed[j] for j in order if needed[j]}


def prepare_launch(settings: RunSettings, job: str, phases: list[str]) -> None:
    """Before a launch: what an interrupted attempt left of these phases is not evidence (removed);
    an earlier attempt's DCP steps of a main phase are kept, set aside."""
    jobdir = JobFiles(settings.out, settings.nproc).job_dir(job)
    for phase in phases:
        for stale in (jobdir / phase).glob("*.json"):
            if stale.name == "ended.json" or (stale.name.startswith("rank") and stale.stem[4:].isdigit()):
                stale.unlink()
    if "main" in phases and (jobdir / "dcp").exists():
        aside = jobdir / f"dcp.before-{time.strftime('%Y%m%d-%H%M%S')}"
        (jobdir / "dcp").rename(aside)
        print(f"{NAME}: {job}: moved the steps of an earlier attempt to {aside}", flush=True)


def orchestrate(settings: RunSettings, launch: Launch) -> int:
    """The whole run (module doc); its exit code: 0 when no case fails, 1 otherwise."""
    terminate_on_sigterm()  # SIGTERM ends the running job first (the owner pipe covers SIGKILL)
    with JobFolder(settings.out) as folder:
        todo, skipped, needed = plan(settings)
        if skipped:
            print(f"{NAME}: {', '.join(skipped)} finished in {settings.out} before; skipped", flush=True)
        for job, phases in needed.items():
            _run_until_ended(settings, lambda ps, job=job: launch(folder, job, ps), job, phases)
        return _judge_all(settings, todo)


def _run_until_ended(settings: RunSettings, launch_phases, job: str, phases: list[str]) -> None:
    files = JobFiles(settings.out, settings.nproc)
    while phases:
        start = time.time()
        prepare_launch(settings, job, phases)
        code = launch_phases(phases)
        print(f"{NAME}: job {job} ({', '.join(phases)}) "
              f"{'interrupted by a signal' if code is None else f'exit {code}'} in {time.time() - start:.0f} s",
              flush=True)
        if code is None:
            return
        for phase in phases:
            if not files.ended(job, phase) and files.read(job, phase) is not None:
                files.mark_ended(job, phase, exit=code)
        left = [p for p in phases if not files.ended(job, p)]
        if left == phases:  # the job ended before any phase did: the first one is its failure
            files.mark_ended(job, left[0], exit=code, note="the job ended before every rank wrote this phase")
            left = left[1:]
        phases = left


def _judge_all(settings: RunSettings, todo: list[str]) -> int:
    files = JobFiles(settings.out, settings.nproc)
    for case in todo:
        if not all(files.ended(j, p) for j, p, _ in NEEDS[case]):
            print(f"{NAME}: {case} not judged: its jobs were interrupted (a re-run runs them)", flush=True)
            continue
        verdict = judge(settings, case)
        write_json(files.case_file(case), verdict)
        first = f": {verdict['reasons'][0]}" if verdict["reasons"] else ""
        print(f"{NAME}: {case} {verdict['verdict']}{first}", flush=True)
    verdicts = [json.loads(files.case_file(c).read_text()) for c in settings.cases if files.case_file(c).exists()]
    code = write_report(settings, verdicts)
    print(f"{NAME}: report {settings.out / 'report.md'} and {settings.out / 'report.json'}", flush=True)
    return code


def in_torchrun(settings: RunSettings) -> int:
    """The run as ranks of one ``torchrun`` (module doc)."""
    files = JobFiles(settings.out, settings.nproc)
    todo, _, needed = plan(settings)
    with job_process_group(settings):
        for job, phases in needed.items():
            run_rank_job(settings, job, phases)
    if int(os.environ.get("RANK", 0)) != 0:
        return 0
    deadline = time.time() + 600  # the other ranks' last files
    while time.time() < deadline and any(files.read(j, p) is None for j, ps in needed.items() for p in ps):
        time.sleep(2)
    for job, phases in needed.items():
        for phase in phases:
            if files.read(job, phase) is not None:
                files.mark_ended(job, phase, exit=0)
    return _judge_all(settings, todo)
