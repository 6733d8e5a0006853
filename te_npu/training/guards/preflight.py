"""Checks that need only the config, the filesystem and the device, run before anything is built.

Each raises ``ConfigError`` naming the config key. The Trainer runs them at the start of
``setup`` (the data checks live with the data, ``te_npu.training.data.check_token_ids``; the
checkpoint's own checks with the checkpoint, ``te_npu.distributed.storage.dcp``): which step to
resume (``resume_target``), that no planned save replaces another run's step
(``check_step_collisions``), and that the Hugging Face export replaces nothing but an earlier
export of this run and can be written (``check_export_dir``). What a step folder is, its names
and who owns what in the folder are the folder's rules (``te_npu.distributed.storage.folder``);
these checks ask it and say the answer with the config key.
"""
from __future__ import annotations

import errno
import os

import torch

from te_npu.distributed.storage import folder as checkpoint_folder
from te_npu.errors import ConfigError

__all__ = [
    "check_device",
    "check_writable",
    "resume_target",
    "planned_saves",
    "check_step_collisions",
    "check_export_dir",
]


def check_device(device_type: str, local_rank: int, local_world_size: int) -> None:
    """``training.device`` exists here and has a device for every local rank."""
    if device_type == "cpu":
        return
    if device_type == "npu":
        try:
            import torch_npu  # noqa: F401  (registers torch.npu; only on the npu path)
        except Exception as exc:  # noqa: BLE001 - a broken CANN install raises all sorts
            raise ConfigError(f"training.device: 'npu' needs torch_npu, which does not import here: "
                              f"{type(exc).__name__}: {exc}") from None
    backend = getattr(torch, device_type, None)
    if backend is None or not backend.is_available():
        raise ConfigError(f"training.device: {device_type!r} is not available on this machine "
                          f"(torch.{device_type}.is_available() is false); CPU recipes use training.device=cpu")
    count = backend.device_count()
    if max(local_rank + 1, local_world_size) > count:
        raise ConfigError(f"training.device: {local_world_size} ranks on this node need {local_world_size} "
                          f"{device_type} devices, {count} visible")


def check_writable(directory: str, key: str) -> None:
    """Create ``directory`` if needed and prove a file can be written in it (works for root too);
    the ``ConfigError`` says which of the two failed and why (a virtual or read-only filesystem
    is named: creating a file in ``/proc`` fails with ENOENT, which alone reads as a missing folder)."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{key}: {directory!r} is not writable: it cannot be created "
                          f"({_reason(exc, _existing(directory))}{_at(exc, directory)}"
                          f"{_filesystem_of(_existing(directory))})") from None
    probe = os.path.join(directory, f".te_npu_write_test.{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(f"{key}: {directory!r} is not writable: no file can be created in it "
                          f"({_reason(exc, directory)}{_filesystem_of(directory)})") from None


def _reason(exc: OSError, existing_dir: str) -> str:
    """``exc``'s reason; ENOENT inside a folder that exists (procfs, sysfs) is said as what it is."""
    if exc.errno == errno.ENOENT and os.path.isdir(existing_dir):
        return f"its filesystem refuses new entries in {existing_dir!r}, which exists (the OS answers ENOENT)"
    return exc.strerror or str(exc)


def _existing(directory: str) -> str:
    """``directory``'s nearest existing ancestor (itself if it exists)."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _at(exc: OSError, directory: str) -> str:
    """``: at <path>`` when the failing path is not ``directory`` itself (a parent)."""
    where = exc.filename if isinstance(exc.filename, str) else None
    return f": at {where!r}" if where and os.path.abspath(where) != os.path.abspath(directory) else ""


def _filesystem_of(directory: str) -> str:
    """``; it is on the <type> filesystem mounted at <dir>[, read-only]`` (Linux ``/proc/mounts``),
    or "" where that cannot be read."""
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return ""
    path = os.path.realpath(directory)
    best = None
    for fields in mounts:
        if len(fields) >= 4:
            point = fields[1].replace("\\040", " ")
            if (path == point or path.startswith(point.rstrip("/") + "/")) and (best is None or len(point) > len(best[1])):
                best = (fields[2], point, "ro" in fields[3].split(","))
    if best is None:
        return ""
    fstype, point, read_only = best
    return f"; it is on the {fstype} filesystem mounted at {point}{', read-only' if read_only else ''}"


def resume_target(c) -> str | None:
    """The step directory ``CheckpointConfig`` ``c`` resumes from, or None to start from scratch.

    ``resume: auto`` starts from scratch only in a folder that holds no step directory and is not
    a step folder itself, complete or not (``checkpoint_folder.holds_step_files``: a user who
    points ``checkpoint.dir`` at a step folder whose save was interrupted gets an error, not a new
    run written inside it); with steps but no ``latest`` it refuses (naming the overrides); a
    ``latest`` naming a missing step is an error naming both; ``load_step`` picks a step
    explicitly. A step whose save died after it was published (``latest`` names it, its files
    are complete in ``step_N.tmp``) is answered by its final path: the Trainer completes the
    rename once it holds the folder's lock.
    """
    if c.resume is False:
        return None
    where = f"checkpoint.dir (checkpoint.resume: {str(c.resume).lower()})"
    if os.path.isfile(c.dir):
        raise ConfigError(f"{where}: {c.dir!r} is a file; only DCP checkpoint directories are supported")
    if c.load_step is not None:
        path = os.path.join(c.dir, checkpoint_folder.step_name(c.load_step))
        if checkpoint_folder.pending_step(c.dir) == os.path.basename(path):
            return path
        if not os.path.isdir(path):
            raise ConfigError(f"checkpoint.load_step: {path} does not exist; the folder holds "
                              f"{checkpoint_folder.step_names(checkpoint_folder.list_steps(c.dir))}")
        return _step(path, where)
    has_marker = os.path.isfile(os.path.join(c.dir, checkpoint_folder.LATEST))
    steps = checkpoint_folder.list_steps(c.dir)
    is_step_folder = checkpoint_folder.holds_step_files(c.dir)  # complete or not: resolve_latest says which
    if c.resume == "auto" and not has_marker and not steps and not is_step_folder:
        return None  # nothing to resume: a new run
    if c.resume is True and not os.path.exists(c.dir):
        raise ConfigError(f"{where}: {c.dir!r} does not exist, so there is nothing to resume")
    if not has_marker and steps and not is_step_folder:
        raise ConfigError(
            f"{where}: {c.dir!r} holds {checkpoint_folder.step_names(steps)} but no 'latest' marker; refusing to "
            f"start from scratch over them: resume one with checkpoint.load_step=N (newest: {steps[-1]}), or start "
            "a new run next to them with checkpoint.resume=false (its pruning never touches their steps)"
        )
    try:
        return checkpoint_folder.resolve_latest(c.dir, pending=True)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def planned_saves(start: int, train_steps: int, interval: int) -> list[int]:
    """Steps a run from ``start`` to ``train_steps`` saves: every ``interval`` and the last."""
    steps = set(range(interval * (start // interval + 1), train_steps, interval)) if interval else set()
    if train_steps > start:
        steps.add(train_steps)
    return sorted(steps)


def check_step_collisions(directory: str, steps: list[int], lineage: str | None, *, resuming: bool = False) -> None:
    """No step this run will save may replace a step directory of another run (``lineage``; None:
    a new run, for which every existing step is another run's). ``resuming``: this run continues
    a lineage (the hint differs: it cannot be told to resume)."""
    foreign = checkpoint_folder.foreign_steps(directory, steps, lineage)
    if not foreign:
        return
    if resuming:
        hint = ("move those steps out of the folder (they are another run's), or give this run another "
                "checkpoint.dir and resume it there from a copy of its step")
    else:
        hint = "use another checkpoint.dir, or resume that run (checkpoint.resume=auto)"
    raise ConfigError(
        f"checkpoint.dir: {directory!r} already holds {', '.join(foreign[:4])} of another run, which this run "
        f"would overwrite when it saves those steps; {hint}"
    )


def check_export_dir(path: str, lineage: str, key: str) -> None:
    """The Hugging Face export to ``path`` replaces nothing but an earlier export of this run
    (``lineage``), and its parent folder is writable (the export is written next to it first).

    Allowed: ``path`` absent, an empty directory, or a directory holding ``te_npu_export.json``
    of this lineage. Anything else -- an HF checkpoint (the run's own ``initial_load_path``), a
    tokenizer, another run's export -- is refused naming what it holds.
    """
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}: {path!r} exists and is not a directory; the export is a directory")
    held = checkpoint_folder.foreign_export(path, lineage)
    if held is not None:
        raise ConfigError(f"{key}: {path!r} holds {held}; the export replaces the whole directory, "
                          "so it must be new, empty, or an earlier export of this run: choose another directory")
    check_writable(os.path.dirname(os.path.abspath(path)), key)


def _step(path: str, where: str) -> str:
    try:
        return checkpoint_folder.latest_checkpoint(path)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
