"""A checkpoint folder's namespace: the steps it holds, the one ``latest`` names, who owns what
is in it, and the only ways te_npu changes them. Every question about a checkpoint folder is
answered here; the DCP writer (``dcp``), the Trainer's preflight (``resume: auto``), the
Trainer's checkpointer and the converter ask these functions.

    dir/step_{N}/         a complete step (``manifest.json`` is its last file)
    dir/step_{N}.tmp/     a save in progress, or one that died before it was published
    dir/latest            ``step_{N}``: the published step, a plain name inside ``dir``
    dir/abandoned/        this run's steps that a rollback set aside (``roll_back``)
    dir/diverged/         steps saved after a divergence began (``set_aside``)
    dir/hf/step_{N}/      the run's Hugging Face export of step N (``export_dir``, unless
                          ``checkpoint.export_dir`` names another place)
    dir/te_npu.lock       the job that owns the folder (``checkpoint_lock``)

The rules, each kept here:

- **What a step folder is.** A step folder holds te_npu's record ``te_npu.json`` and DCP's
  ``.metadata``; a save writes ``.metadata`` (DCP's last file), then ``te_npu.json``, then the
  manifest, so a step whose save completed has both (``is_step_dir``: a folder that loads; its
  manifest is verified on load). A folder holding only one of the two is a step folder whose
  save did not complete, or was copied in part (``holds_step_files``): never a folder a new run
  starts in (``resume: auto`` refuses it rather than writing steps inside it), never one that
  loads. Step folders are named ``step_N`` (``step_name``, ``step_of``).

- **Publication.** A save moves ``latest`` to ``step_N`` once ``step_N.tmp`` is complete (its
  manifest written), and only then renames the directory (``publish``). A job that dies between
  the two leaves ``latest`` naming ``step_N`` with every file in ``step_N.tmp``: ``resolve_latest(
  ..., pending=True)`` already answers ``step_N``, and ``finish_interrupted_save``, run by the next
  job once it holds the folder's lock, completes the rename. A job that dies earlier leaves the
  previous ``latest`` and its step untouched; its unpublished ``step_N.tmp`` is removed by the
  next save of ``N``. So a complete, published step is never lost.
- **One history per folder.** A run that continues from step ``K`` (``checkpoint.load_step=K``,
  or any restart that redoes steps) first points ``latest`` at ``K``, then moves its own
  lineage's steps newer than ``K`` into ``abandoned/`` (``roll_back``): a later save of the same
  step number never meets an old directory, and the old step is kept, not replaced. The
  ``step_N`` directories of a lineage are always one chain of ``parent`` links.
- **Nothing of another run.** ``latest`` must name a ``step_N`` inside its folder; a save never
  replaces another lineage's step (``refuse_foreign``, and before a run starts ``foreign_steps``);
  an HF export replaces only an earlier export of its own lineage (``foreign_export``: its
  ``te_npu_export.json`` names the lineage); ``prune`` deletes only complete steps on the chain of
  the step just written, beyond the newest ``keep_last``; ``set_aside`` moves, never deletes.

Every function that changes the folder runs on one process (rank 0, holding the lock); the
readers are pure functions of what is on disk.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid

from te_npu.distributed.storage.hf_checkpoint import export_owner
from te_npu.distributed.storage.manifest import MANIFEST_NAME, ManifestError, fsync_dir, read_manifest, verify_files
from te_npu.errors import ConfigError

__all__ = [
    "LATEST",
    "META",
    "DCP_METADATA",
    "ABANDONED",
    "DIVERGED",
    "new_lineage",
    "list_steps",
    "step_info",
    "is_step_dir",
    "holds_step_files",
    "step_name",
    "step_of",
    "step_names",
    "held_checkpoints",
    "foreign_steps",
    "export_dir",
    "foreign_export",
    "latest_checkpoint",
    "resolve_latest",
    "pending_step",
    "finish_interrupted_save",
    "latest_position",
    "set_latest",
    "publish",
    "refuse_foreign",
    "roll_back",
    "set_aside",
    "prune",
    "previous_complete_step",
    "steps_hint",
]

LATEST = "latest"
META = "te_npu.json"
"""te_npu's record of a step: ``step``, ``world_size``, ``lineage``, ``parent``, ``saved``."""
DCP_METADATA = ".metadata"
"""DCP's index of a step's tensors (a pickle: read only through ``metadata.SafeFileSystemReader``)."""
ABANDONED, DIVERGED = "abandoned", "diverged"
_STEP_DIR = re.compile(r"step_(\d+)")
_TMP = ".tmp"


def new_lineage() -> str:
    """A fresh lineage id for a run that starts from scratch."""
    return uuid.uuid4().hex[:16]


# ---- reading ------------------------------------------------------------------------------------


def list_steps(directory: str | os.PathLike) -> list[int]:
    """Step numbers of the ``step_N`` directories in ``directory`` (complete or not), ascending."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for n in names if (m := _STEP_DIR.fullmatch(n))
                  and os.path.isdir(os.path.join(directory, n)))


def step_info(step_dir: str | os.PathLike) -> dict:
    """``te_npu.json`` of a step directory: ``step``, ``world_size``, ``lineage`` (None if older),
    ``parent``, ``saved``; ``ConfigError`` naming the file if it cannot be read."""
    path = os.path.join(step_dir, META)
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"checkpoint {os.fspath(step_dir)}: cannot read {META}: {exc}") from None
    if not isinstance(info, dict) or "step" not in info:
        raise ConfigError(f"checkpoint {os.fspath(step_dir)}: {path} is not a te_npu step record (no 'step')")
    info.setdefault("lineage", None)
    return info


def is_step_dir(path: str | os.PathLike) -> bool:
    """``path`` is a step folder whose save completed: it holds both ``te_npu.json`` and ``.metadata``
    (the module doc: what a step folder is)."""
    return all(os.path.isfile(os.path.join(path, name)) for name in (META, DCP_METADATA))


def holds_step_files(path: str | os.PathLike) -> bool:
    """``path`` is a step folder, complete or not: it holds ``te_npu.json`` or ``.metadata``. A new
    run never starts in such a folder (``resume: auto`` refuses one that is not ``is_step_dir``)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in (META, DCP_METADATA))


def step_name(step: int) -> str:
    """The folder name of ``step``: ``step_N``."""
    return f"step_{int(step)}"


def step_of(name: str) -> int | None:
    """The step a ``step_N`` folder name stands for, None for any other name."""
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def step_names(steps: list[int]) -> str:
    """The newest four of ``steps`` as folder names (``..., step_6, step_8``), for messages."""
    if not steps:
        return "no step_N directory"
    shown = ", ".join(step_name(s) for s in steps[-4:])
    return ("..., " if len(steps) > 4 else "") + shown


def held_checkpoints(directory: str | os.PathLike) -> list[str]:
    """What of a run ``directory`` holds: its newest four ``step_N`` and ``latest`` (empty: none)."""
    held = [step_name(s) for s in list_steps(directory)[-4:]]
    return held + ([LATEST] if os.path.exists(os.path.join(directory, LATEST)) else [])


def foreign_steps(directory: str | os.PathLike, steps: list[int], lineage: str | None) -> list[str]:
    """The ``step_N`` folders among ``steps`` that ``directory`` holds and that are not of
    ``lineage`` (None: a new run, for which every existing step is another run's; an unreadable
    ``te_npu.json`` is never this run's)."""
    foreign = []
    for step in sorted(set(steps) & set(list_steps(directory))):
        try:
            theirs = step_info(os.path.join(directory, step_name(step))).get("lineage")
        except ConfigError:
            theirs = "unknown"
        if lineage is None or theirs != lineage:
            foreign.append(step_name(step))
    return foreign


def export_dir(directory: str | os.PathLike, step: int, configured: str | None = None) -> str:
    """Where the HF export of ``step`` goes: ``configured`` (``checkpoint.export_dir``) if set,
    else ``<directory>/hf/step_N``."""
    return configured or os.path.join(os.fspath(directory), "hf", step_name(step))


def foreign_export(path: str | os.PathLike, lineage: str) -> str | None:
    """What at ``path`` an HF export of ``lineage`` may not replace, in words; None when it may:
    ``path`` absent, an empty directory, or an earlier export of this lineage (``te_npu_export.json``
    names it). Anything else -- an HF checkpoint, a tokenizer, another run's export, a file -- is
    said with what it holds."""
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        return "something that is not a directory"
    names = sorted(os.listdir(path))
    owner = export_owner(path)
    if not names or (owner is not None and owner.get("lineage") == lineage):
        return None
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    whose = "another run's export" if owner is not None else "files that are not an export of this run"
    return f"{whose} ({shown})"


def latest_checkpoint(directory: str | os.PathLike) -> str:
    """The DCP step directory ``directory`` refers to (``latest``'s step, or ``directory`` itself
    if it is a step directory); ``ConfigError`` naming what is wrong otherwise."""
    return resolve_latest(directory)


def resolve_latest(directory: str | os.PathLike, *, pending: bool = False) -> str:
    """``latest_checkpoint``; with ``pending``, a ``latest`` whose save died between publication
    and rename (``pending_step``) answers the step path it is about to have (the caller holds, or
    is about to take, the lock and runs ``finish_interrupted_save``)."""
    directory = os.fspath(directory)
    if os.path.isfile(directory):
        raise ConfigError(f"checkpoint {directory!r} is a file; only DCP checkpoint directories are supported")
    if is_step_dir(directory):
        return directory
    name = _read_latest(directory)
    if name is not None:
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            if _complete_tmp(path):
                if pending:
                    return path
                raise ConfigError(f"{os.path.join(directory, LATEST)} names {name!r}, whose save was interrupted after "
                                  f"it was published: its files are complete in {path}{_TMP}; the next run on the folder "
                                  f"finishes it (or rename {name}{_TMP} to {name})")
            raise ConfigError(f"{os.path.join(directory, LATEST)} names {name!r}, but {path} does not exist (deleted or "
                              f"never written); {steps_hint(directory)}")
        if not is_step_dir(path):
            raise ConfigError(f"{os.path.join(directory, LATEST)} names {name!r}, but {path} is not a te_npu DCP "
                              f"checkpoint step (no {META} / {DCP_METADATA} in it); {steps_hint(directory)}")
        return path
    if holds_step_files(directory):
        missing = [n for n in (META, DCP_METADATA) if not os.path.isfile(os.path.join(directory, n))]
        raise ConfigError(f"{directory!r} is an incomplete step folder (no {', '.join(missing)} in it: a save that did "
                          "not complete, or a partial copy): it neither loads nor takes a new run; point checkpoint.dir "
                          "at the folder that holds the steps and resume a complete one (checkpoint.load_step=N)")
    steps = list_steps(directory)
    if steps:
        raise ConfigError(f"{directory!r} holds {step_names(steps)} but no 'latest' marker (deleted?): name the step "
                          f"to load (checkpoint.load_step={steps[-1]} for the newest)")
    raise ConfigError(f"{directory!r} is not a te_npu DCP checkpoint (no 'latest' marker, no step_N directory); "
                      "only DCP checkpoints written by te_npu.distributed.storage.dcp.save load")


def pending_step(directory: str | os.PathLike) -> str | None:
    """The name ``latest`` gives if that step's save died after publication (``step_N`` absent,
    ``step_N.tmp`` complete), else None."""
    directory = os.fspath(directory)
    try:
        name = _read_latest(directory)
    except ConfigError:
        return None
    if name is None or os.path.exists(os.path.join(directory, name)):
        return None
    return name if _complete_tmp(os.path.join(directory, name)) else None


def latest_position(directory: str) -> tuple[str, int | None]:
    """``(lineage, step)`` of the step ``latest`` names, or a new lineage without parent."""
    try:
        info = step_info(latest_checkpoint(directory))
    except ConfigError:
        return new_lineage(), None
    return info.get("lineage") or new_lineage(), int(info["step"])


def previous_complete_step(directory: str | os.PathLike, before: int) -> int | None:
    """The newest step below ``before`` whose manifest reads and whose files have their sizes."""
    for step in reversed([s for s in list_steps(directory) if s < before]):
        path = os.path.join(directory, step_name(step))
        try:
            files = read_manifest(path)
        except ManifestError:
            continue
        if not verify_files(path, files, files, checksums=False):
            return step
    return None


def steps_hint(directory: str) -> str:
    steps = list_steps(directory)
    if not steps:
        return "the folder holds no step_N directory"
    return f"the folder holds {step_names(steps)}: name one with checkpoint.load_step=N"


# ---- changing the folder (rank 0, lock held) ------------------------------------------------------


def set_latest(directory: str, name: str | None) -> None:
    """Point ``latest`` at ``name`` (temp file + fsync + ``os.replace``), or remove it (None)."""
    path = os.path.join(directory, LATEST)
    if name is None:
        if os.path.exists(path):
            os.remove(path)
            fsync_dir(directory)
        return
    tmp = path + _TMP
    with open(tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(directory)


def publish(directory: str, name: str) -> None:
    """Make the complete ``name.tmp`` the folder's ``latest`` step: ``latest`` first, then the
    rename (see the module doc). ``name`` must not exist (``set_aside`` an old one first)."""
    set_latest(directory, name)
    os.rename(os.path.join(directory, name + _TMP), os.path.join(directory, name))
    fsync_dir(directory)


def finish_interrupted_save(directory: str) -> str | None:
    """Complete a save that died between publication and rename (``pending_step``); returns a
    note saying what was done, or None when there was nothing to do."""
    name = pending_step(directory)
    if name is None:
        return None
    os.rename(os.path.join(directory, name + _TMP), os.path.join(directory, name))
    fsync_dir(directory)
    return f"finished the interrupted save of {name} in {directory} (its files were complete in {name}{_TMP})"


def refuse_foreign(final: str, lineage: str) -> None:
    """``RuntimeError`` if the step directory ``final`` exists and belongs to another lineage."""
    if not os.path.exists(final):
        return
    try:
        theirs = step_info(final).get("lineage")
    except ConfigError:
        theirs = "unknown (no readable te_npu.json)"
    if theirs != lineage:
        raise RuntimeError(f"checkpoint.save: {final} exists and belongs to another run (lineage {theirs}, this "
                           f"run {lineage}); refusing to replace it")


def roll_back(directory: str, step_dir: str) -> list[str]:
    """Make ``step_dir`` (a step of ``directory``) the head of its lineage's history: point
    ``latest`` at it, then move the lineage's newer steps into ``abandoned/``. Returns where
    each moved step now is (empty in the common case: ``latest`` names the newest step)."""
    directory, step_dir = os.path.abspath(directory), os.path.abspath(step_dir)
    if os.path.dirname(step_dir) != directory:
        return []  # a step loaded from elsewhere: this folder's history is not its
    info = step_info(step_dir)
    step, lineage = int(info["step"]), info.get("lineage")
    name = os.path.basename(step_dir)
    if _read_latest(directory) != name:
        set_latest(directory, name)  # first: an interrupted rollback restarts from `step`, never from a newer step
    newer = [step_name(s) for s in list_steps(directory) if s > step and _lineage_of(directory, s) == lineage]
    return set_aside(directory, newer, ABANDONED)


def set_aside(directory: str, names: list[str], reason: str) -> list[str]:
    """Move the step directories ``names`` into ``directory/reason/`` (``.1``, ``.2`` ... when the
    name is taken there); returns their new paths. Nothing is deleted."""
    moved = []
    if not names:
        return moved
    target = os.path.join(directory, reason)
    os.makedirs(target, exist_ok=True)
    for name in names:
        destination, k = os.path.join(target, name), 0
        while os.path.exists(destination):
            k += 1
            destination = os.path.join(target, f"{name}.{k}")
        os.rename(os.path.join(directory, name), destination)
        moved.append(destination)
    fsync_dir(target)
    fsync_dir(directory)
    return moved


def prune(directory: str, keep_last: int, lineage: str, newest: int) -> None:
    """Delete the complete steps of ``newest``'s history chain (``parent`` links, same lineage)
    beyond the newest ``keep_last``; nothing off the chain is touched.

    A pruned step is renamed ``step_K.pruning`` first (atomic), so an interrupted prune never
    leaves a half-deleted ``step_K``; leftover ``.pruning`` directories go on the next prune.
    """
    chain, step = [], newest
    while step is not None and (not chain or step < chain[-1]):
        path = os.path.join(directory, step_name(step))
        try:
            info = step_info(path)
        except ConfigError:
            break  # the chain ends where a step is gone (pruned earlier) or unreadable
        if info.get("lineage") != lineage or int(info.get("step", -1)) != step:
            break
        chain.append(step)
        step = info.get("parent")
    for step in chain[keep_last:]:
        path = os.path.join(directory, step_name(step))
        if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            os.rename(path, path + ".pruning")
    for name in os.listdir(directory):
        if name.endswith(".pruning") and _STEP_DIR.fullmatch(name[: -len(".pruning")]):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


# ---- helpers ------------------------------------------------------------------------------------


def _read_latest(directory: str) -> str | None:
    """The step name in ``directory/latest`` (None if there is none); ``ConfigError`` unless it is
    a plain ``step_N`` of this folder."""
    marker = os.path.join(directory, LATEST)
    if not os.path.isfile(marker):
        return None
    try:
        with open(marker) as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{marker}: cannot read it: {exc}") from None
    if not _STEP_DIR.fullmatch(name):
        raise ConfigError(f"{marker} names {name[:200]!r}, which is not a step of this folder (a 'latest' holds one "
                          f"plain step_N name inside {directory}); {steps_hint(directory)}")
    return name


def _complete_tmp(final: str) -> bool:
    """``final.tmp`` holds a finished save: a manifest whose files are all there with their sizes."""
    tmp = final + _TMP
    try:
        files = read_manifest(tmp)
    except ManifestError:
        return False
    return not verify_files(tmp, files, files, checksums=False)


def _lineage_of(directory: str, step: int) -> str | None:
    try:
        return step_info(os.path.join(directory, step_name(step))).get("lineage")
    except ConfigError:
        return "unreadable"  # never matches a lineage: an unreadable step is left where it is

