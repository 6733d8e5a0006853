"""The acceptance run's files under ``--out``: what each rank of a job leaves, and when a phase ended.

``jobs/<job>/<phase>/rank<r>.json``: one rank's result of a phase (its rules' problems and
evidence, or its error). ``jobs/<job>/<phase>/ended.json``: the phase ended (its job ended, or its
own rank failed it); a case is judged only when every phase it reads ended. ``cases/<id>.json``: a
case's verdict (a re-run with the same ``--out`` skips the case).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["write_json", "JobFiles"]


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (a reader sees the old file or the whole new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


class JobFiles:
    """The per-rank and per-phase files of the run in ``out`` with ``nproc`` ranks per job."""

    def __init__(self, out: Path, nproc: int):
        self.out, self.nproc = Path(out), nproc

    def job_dir(self, job: str) -> Path:
        return self.out / "jobs" / job

    def phase_dir(self, job: str, phase: str) -> Path:
        return self.job_dir(job) / phase

    def rank_files(self, job: str, phase: str) -> list[Path]:
        return sorted(self.phase_dir(job, phase).glob("rank*.json"), key=lambda p: int(p.stem[4:]))

    def read(self, job: str, phase: str) -> list[dict] | None:
        """Every rank's result of the phase, or None while some rank's is missing."""
        files = self.rank_files(job, phase)
        return [json.loads(p.read_text()) for p in files] if len(files) == self.nproc else None

    def read_partial(self, job: str, phase: str) -> dict[int, dict]:
        """rank -> result, for the ranks that wrote one."""
        return {int(p.stem[4:]): json.loads(p.read_text()) for p in self.rank_files(job, phase)}

    def ended(self, job: str, phase: str) -> bool:
        return (self.phase_dir(job, phase) / "ended.json").exists()

    def mark_ended(self, job: str, phase: str, **why) -> None:
        write_json(self.phase_dir(job, phase) / "ended.json", why)

    def case_file(self, case: str) -> Path:
        return self.out / "cases" / f"{case}.json"
