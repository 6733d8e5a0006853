"""What a training process is told and shares at run time, below both the job runner
(``te_npu.training.job``) and the ``Trainer``.

``launch_env()`` is the one place the launcher's environment is read (torchrun's ``RANK``,
``WORLD_SIZE``, ... and te_npu's own ``TE_NPU_MAPPED_FILES`` / ``TE_NPU_LAUNCHER_PID``), at call
time. ``StopRequest`` is what the job's signal handlers and the Trainer's step loop share: the
signal that arrived, whether the Trainer takes SIGTERM gracefully, and the rank's stall watch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from te_npu.training import mapped_files
from te_npu.training.guards.stall import StallWatch

__all__ = ["LaunchEnv", "StopRequest", "launch_env"]


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process (torchrun's variables; defaults for one process)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    under_torchrun: bool
    mapped_files_dir: str | None = None
    """Where the launcher asks ranks to record their memory-mapped files (``te_npu.training.mapped_files``)
    and leave the line of a lost node (``launch_report.leave_note``)."""
    node_rank: int = 0
    """This rank's node (torchrun's ``GROUP_RANK``: the launcher's ``--node_rank``)."""
    nnodes: int = 1
    """Nodes of the job (torchrun's ``GROUP_WORLD_SIZE``)."""
    launcher_pid: int | None = None
    """The launcher that started this rank (``te_npu.training.launch`` sets ``TE_NPU_LAUNCHER_PID``;
    None under a plain torchrun: the parent at start-up is taken for it)."""


def launch_env() -> LaunchEnv:
    """Read ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK`` /
    ``GROUP_WORLD_SIZE`` / ``TORCHELASTIC_RUN_ID`` / ``TE_NPU_MAPPED_FILES`` / ``TE_NPU_LAUNCHER_PID``."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    return LaunchEnv(
        rank=int(env.get("RANK", "0")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=world,
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
        under_torchrun="TORCHELASTIC_RUN_ID" in env,
        mapped_files_dir=env.get(mapped_files.ENV) or None,
        node_rank=int(env.get("GROUP_RANK", "0")),
        nnodes=int(env.get("GROUP_WORLD_SIZE", "1")),
        launcher_pid=int(env["TE_NPU_LAUNCHER_PID"]) if env.get("TE_NPU_LAUNCHER_PID", "").isdigit() else None,
    )


class StopRequest:
    """Shared between the signal handler and the trainer's step loop.

    The trainer sets ``graceful`` when it will save on SIGTERM; the handler then sets
    ``signum`` instead of raising, and the trainer stops at the next step boundary (the
    flag is combined over ranks with the step's loss, so every rank stops at the same step).
    ``watch``: the rank's stall watch; the trainer starts it once the process group exists and
    marks its phases (``run_job`` gives it the job's first-failure report).
    """

    def __init__(self, watch: StallWatch | None = None) -> None:
        self.graceful = False
        self.signum: int | None = None
        self.watch = watch or StallWatch()
