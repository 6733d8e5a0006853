"""DCP checkpoints of the high-precision view: what a step holds, how it is saved and loaded
(docs/reliability.md tells the folder's rules from the user's side).

Layout of ``dir`` (one sub-directory per step, written atomically; the folder's namespace and
its rules -- ``latest``, rollback, pruning, what is never touched -- are ``checkpoint_folder``'s)::

    dir/step_{N}/           DCP files (.metadata + __{rank}_{i}.distcp shards) of
                              model.<fqn>               BF16 logical weights (param dtype), persistent buffers
                              optim.<fqn>.master        FP32 master shard
                              optim.<fqn>.exp_avg       FP32
                              optim.<fqn>.exp_avg_sq    FP32
                              optim.<fqn>.step          FP32 scalar
    dir/step_{N}/te_npu.json  {"step": N, "world_size": W, "lineage": id, "parent": M or null, "saved": time,
                               + the caller's ``meta`` (the trainer's "low_precision": {"format", "scale_alg"})}
    dir/step_{N}/extra_rank{r}.pt   the caller's ``extra`` of rank r (torch.save, weights_only-loadable)
    dir/step_{N}/manifest.json      every file above with its size and CRC-32, written last
    dir/latest              "step_{N}" of the newest published save
    dir/te_npu.lock         held by the job writing here (``checkpoint_lock``; the Trainer takes it)

Quantized parameters are saved as ``master.to(param.dtype)`` -- plain DTensors/tensors, never
the 8-bit wrapper (DCP would pickle it, and weights_only loading refuses it); no 8-bit data
or scale is saved: both are rebuilt from the masters on load. Keys are the model's own
parameter names, so DCP reshards on load (saved with 2 ranks, loadable with 1).

Atomicity: the ranks first agree that the folder has room for the step (``disk_space``: a save
that cannot fit fails before writing, naming the folder and the bytes), then every rank writes
into ``step_{N}.tmp``; after a barrier each rank hashes the files it wrote, rank 0 writes the
manifest (last), moves ``latest`` to ``step_{N}`` (the publication point), renames the directory
and prunes. A save that dies before publication leaves the previous ``latest`` and its step
untouched; one that dies after it is completed by the next job on the folder
(``checkpoint_folder.finish_interrupted_save``). A full disk mid-save is a ``DiskFullError`` in
one line, whatever layer noticed it. An existing ``step_{N}`` of this run (a redone step) is
set aside into ``abandoned/``, never replaced; another run's is never touched.

Complete or nothing: ``load`` verifies the step against its manifest first (sizes always,
CRC-32 with ``checksums``; ranks split the files), so a missing ``extra_rank{r}.pt``, a
truncated or corrupted shard fails naming the file and the previous complete step.

Nothing runs from a checkpoint: ``.metadata`` (a pickle) is read only through
``checkpoint_metadata.SafeFileSystemReader``, which resolves DCP's own metadata classes and
nothing else, and DCP loads tensor bytes with ``weights_only=True``; ``extra`` too.

Lineage and history: each save records the run it belongs to (``lineage``, kept across
resumes) and its ``parent``, the step its run resumed from or saved before it. ``keep_last``
walks that chain back from the step just written and deletes only complete steps on it beyond
the newest ``keep_last``: never a step newer than the one just written, never a branch the run
abandoned (steps past the one it resumed from), never another lineage's step. A save never
replaces a step directory of another lineage either: a folder shared with an older run keeps
that run's checkpoints.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from te_npu.compat import local_tensor, non_persistent_buffer_names
from te_npu.errors import ConfigError
from te_npu.distributed.storage import folder
from te_npu.distributed.storage.folder import (
    latest_checkpoint,
    list_steps,
    new_lineage,
    previous_complete_step,
    step_info,
)
from te_npu.distributed.storage.manifest import (
    ManifestError,
    hash_files,
    read_manifest,
    verify_files,
    write_manifest,
)
from te_npu.distributed.storage.metadata import SafeFileSystemReader, read_metadata_safely
from te_npu.distributed.storage.disk_space import DiskFullError, format_bytes, free_bytes, raise_if_disk_full
from te_npu.distributed.optim import MasterWeightOptimizer, refresh_low_precision_weights
from te_npu.tensor import QuantizedWeightTensor
from te_npu.distributed import process_group

__all__ = [
    "save",
    "load",
    "latest_checkpoint",
    "list_steps",
    "step_info",
    "verify_step",
    "previous_complete_step",
    "new_lineage",
    "persistent_buffers",
    "read_metadata",
    "DiskFullError",
]

_DCP_SHARD = re.compile(r"__(\d+)_\d+\.distcp")
_EXTRA = re.compile(r"extra_rank(\d+)\.pt")
_PER_TENSOR_BYTES = 4096  # DCP's per-item framing (a torch.save record per tensor), generously
_SPACE_MARGIN = 1.05, 64 << 20  # the estimate x 1.05 + 64 MiB must be free before a save starts


def save(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: MasterWeightOptimizer,
    step: int,
    extra: Any = None,
    *,
    keep_last: int | None = None,
    lineage: str | None = None,
    parent: int | None = None,
    meta: Mapping[str, Any] | None = None,
) -> str:
    """Save the high-precision view of ``model`` and ``optimizer`` at ``step``; returns the step path.

    extra: anything ``torch.save`` writes and ``torch.load(weights_only=True)`` reads back
    (a JSON-like dict, RNG state tensors); saved per rank. keep_last: keep only the newest
    ``keep_last`` complete steps of this save's history (see the module doc). lineage: the run
    this save belongs to, parent: the step before it in that run's history (defaults for both:
    those of the step ``latest`` names, else a new lineage without parent). meta: more JSON fields
    for the step's ``te_npu.json`` (the trainer's: ``low_precision``, the recipe it trained with).
    """
    directory = os.fspath(directory)
    rank, world = process_group.rank(), process_group.world_size()
    name = folder.step_name(step)
    final, tmp = os.path.join(directory, name), os.path.join(directory, name + ".tmp")
    what = f"checkpoint.save of step {int(step)} to {directory}"
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        if lineage is None:
            lineage, parent = folder.latest_position(directory)
        folder.refuse_foreign(final, lineage)
        shutil.rmtree(tmp, ignore_errors=True)  # an unpublished save that died: never a published step
    state = _state_dict(model, optimizer, for_save=True)
    needed = _check_room(directory, state, what)  # collective: every rank agrees, before anything is written
    if rank == 0:
        os.makedirs(tmp)
    process_group.barrier()
    try:
        dcp.save(state, checkpoint_id=tmp)
        torch.save(extra, os.path.join(tmp, f"extra_rank{rank}.pt"))
        if rank == 0:
            _write_json(os.path.join(tmp, folder.META), {**(meta or {}), "step": int(step), "world_size": world,
                                                   "lineage": lineage, "parent": parent,
                                                   "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    except BaseException as exc:  # a full disk: anything from OSError to "unexpected pos", in DCP's CheckpointException
        raise_if_disk_full(exc, directory, needed, what)
        raise
    del state
    process_group.barrier()
    mine = [n for n in os.listdir(tmp) if _writer_rank(n, world) == rank]
    entries = _gather_dicts(hash_files(tmp, mine))
    if rank == 0:
        missing = sorted(set(os.listdir(tmp)) - set(entries))
        if missing:
            raise RuntimeError(f"checkpoint.save: {tmp}: files {missing} appeared while hashing")
        try:
            write_manifest(tmp, step, entries)  # last file of the step: its presence means complete
            if os.path.exists(final):  # this run's own step_N (refuse_foreign passed): a redone step
                folder.set_aside(directory, [name], folder.ABANDONED)
            folder.publish(directory, name)  # latest -> step_N, then the rename
        except BaseException as exc:  # noqa: BLE001 - re-raised as it is unless the disk is full
            raise_if_disk_full(exc, directory, needed, what)
            raise
        if keep_last is not None:
            folder.prune(directory, keep_last, lineage, int(step))  # the history chain from step_{step}
    process_group.barrier()
    return final


def prune(directory: str | os.PathLike, keep_last: int, lineage: str, newest: int) -> None:
    """Rank 0: delete the steps of ``newest``'s history beyond the newest ``keep_last``
    (``checkpoint_folder.prune``); a no-op on the other ranks and for ``keep_last`` 0."""
    if process_group.rank() == 0 and keep_last:
        folder.prune(os.fspath(directory), keep_last, lineage, int(newest))


def load(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: MasterWeightOptimizer | None,
    *,
    verify: bool = True,
    checksums: bool = True,
) -> tuple[int, Any]:
    """Restore ``latest`` (or ``directory`` itself if it is a step dir); returns ``(step, extra)``.

    With an optimizer: masters, moments and step are restored and every 8-bit shard is rebuilt
    from its master (high-precision params copied from theirs). Without: the BF16 weights are
    loaded and the 8-bit shards quantized from them. ``verify``: check the step against its
    manifest first (``verify_step``; collective when distributed). ``extra`` is this rank's
    (rank 0's when the world size changed since the save).
    """
    path = latest_checkpoint(directory)
    if verify:
        verify_step(path, checksums=checksums)
    info = step_info(path)
    rank = process_group.rank()
    extra_path = os.path.join(path, f"extra_rank{rank if info.get('world_size') == process_group.world_size() else 0}.pt")
    if not os.path.isfile(extra_path):
        raise ConfigError(f"checkpoint {path}: {os.path.basename(extra_path)} is missing: the data position, "
                          "skipped count and RNG state of the run are in it; refusing a partial resume")
    state = _state_dict(model, optimizer, for_save=False)
    buffers = _saved_buffers(model, path)
    if optimizer is not None:  # the masters are authoritative: weights are rebuilt from them
        state["model"] = {fqn: t for fqn, t in state["model"].items() if fqn in buffers}
    else:
        all_buffers = persistent_buffers(model)
        state["model"] = {fqn: t for fqn, t in state["model"].items() if fqn in buffers or fqn not in all_buffers}
    dcp.load(state, storage_reader=SafeFileSystemReader(path))
    if optimizer is not None:
        optimizer.rebuild_weights_from_masters()
    else:
        _weights_from_model_view(model, state["model"])
    extra = torch.load(extra_path, weights_only=True)
    return int(info["step"]), extra


def verify_step(step_dir: str | os.PathLike, *, checksums: bool = True) -> None:
    """Check every file of ``step_dir`` against its manifest (sizes; CRC-32 with ``checksums``).

    Collective when a process group exists: rank r checks manifest entries r, r + W, ...
    and every rank raises the same ``ConfigError``, naming the bad file(s) and the previous
    step of the folder whose manifest and sizes check out.
    """
    step_dir = os.fspath(step_dir)
    try:
        files = read_manifest(step_dir)
    except ManifestError as exc:
        problems = [str(exc)]
    else:
        names = sorted(files)
        problems = verify_files(step_dir, files, names[process_group.rank()::process_group.world_size()], checksums=checksums)
        problems = sorted(p for rank_problems in _gather_lists(problems) for p in rank_problems)
    if problems:
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:4])})" if len(problems) > 1 else ""
        raise ConfigError(f"checkpoint {step_dir} is incomplete or corrupt: {problems[0]}{more}; "
                          f"{_previous_hint(step_dir)}")
    read_metadata(step_dir)  # its pickle, read safely: a crafted one is refused here, before any build


def read_metadata(step_dir: str | os.PathLike):
    """The step's DCP ``Metadata``, read without running code (``checkpoint_metadata``)."""
    return read_metadata_safely(os.path.join(os.fspath(step_dir), folder.DCP_METADATA))


# ---- state dicts -------------------------------------------------------------------------------


def _state_dict(model: nn.Module, optimizer: MasterWeightOptimizer | None, *, for_save: bool) -> dict:
    model_view: dict[str, torch.Tensor] = {}
    for fqn, param in model.named_parameters():
        quantized = isinstance(local_tensor(param), QuantizedWeightTensor)
        if quantized and optimizer is not None and fqn in optimizer.masters:
            master = optimizer.masters[fqn]
            model_view[fqn] = master.detach().to(param.dtype) if for_save else torch.zeros_like(master, dtype=param.dtype)
        elif quantized:
            if for_save:
                raise ValueError(f"checkpoint.save: quantized parameter {fqn!r} has no master; pass the optimizer")
            model_view[fqn] = _high_precision_like(param)
        else:
            model_view[fqn] = param.detach()
    model_view.update(persistent_buffers(model))  # persistent buffers (a router's selection bias) are model state too
    state: dict[str, Any] = {"model": model_view}
    if optimizer is not None:
        state["optim"] = {fqn: optimizer.state_for(fqn) for fqn in optimizer.masters}
    return state


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers of ``model`` by FQN (live tensors: DCP loads into them)."""
    return {
        f"{prefix}.{name}" if prefix else name: buffer
        for prefix, module in model.named_modules()
        for name, buffer in module.named_buffers(recurse=False)
        if buffer is not None and name not in non_persistent_buffer_names(module)
    }


def _saved_buffers(model: nn.Module, path: str) -> set[str]:
    """Buffers of ``model`` that the checkpoint holds (checkpoints before buffers were saved hold none)."""
    saved = read_metadata(path).state_dict_metadata
    return {fqn for fqn in persistent_buffers(model) if f"model.{fqn}" in saved}


def _high_precision_like(param: torch.Tensor) -> torch.Tensor:
    """A zero BF16 (logical dtype) tensor laid out like ``param``, to load the model view into."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        shard = local_tensor(param)
        local = torch.zeros(shard.shape, dtype=param.dtype, device=shard.device)
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    return torch.zeros(param.shape, dtype=param.dtype, device=param.device)


@torch.no_grad()
def _weights_from_model_view(model: nn.Module, view: dict[str, torch.Tensor]) -> None:
    quantized = [(fqn, p) for fqn, p in model.named_parameters() if isinstance(local_tensor(p), QuantizedWeightTensor)]
    refresh_low_precision_weights([p for _, p in quantized], [view[fqn] for fqn, _ in quantized])
    for fqn, param in model.named_parameters():
        if not isinstance(local_tensor(param), QuantizedWeightTensor) and view[fqn] is not param:
            local_tensor(param).copy_(local_tensor(view[fqn]))



# ---- files -------------------------------------------------------------------------------------


def _gather_lists(items: list) -> list[list]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [items]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return out


def _gather_dicts(entries: dict) -> dict:
    merged: dict = {}
    for part in _gather_lists([entries]):
        merged.update(part[0])
    return merged


def _writer_rank(name: str, world: int) -> int:
    """The rank that wrote ``name`` (so it hashes it from its own page cache); rank 0 for the rest."""
    m = _DCP_SHARD.fullmatch(name) or _EXTRA.fullmatch(name)
    rank = int(m.group(1)) if m else 0
    return rank if rank < world else 0


def _check_room(directory: str, state: dict, what: str) -> int:
    """Bytes the step needs (every rank's shards, estimated); ``DiskFullError`` on every rank,
    before anything is written, when rank 0 sees less free space in ``directory`` than that
    plus the headroom."""
    tensors = [t for part in state.values() for t in _tensors(part)]
    local = sum(_local_nbytes(t) // _copies(t) for t in tensors) + _PER_TENSOR_BYTES * len(tensors) + (1 << 20)
    free = free_bytes(directory) if process_group.rank() == 0 else 0
    parts = _gather_lists([local, free])
    total, free = sum(p[0] for p in parts), parts[0][1]
    if free < int(total * _SPACE_MARGIN[0]) + _SPACE_MARGIN[1]:
        raise DiskFullError(f"{what}: {directory} has {format_bytes(free)} free, the step needs about "
                            f"{format_bytes(total)} ({len(parts)} rank(s)' shards) plus 5% and 64 MiB of headroom; "
                            "nothing was written and 'latest' is unchanged: free space there or point checkpoint.dir "
                            "at a larger disk")
    return total


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return []


def _copies(t: torch.Tensor) -> int:
    """Ranks holding the same bytes as this one's ``t``, of which DCP writes one: a DTensor's
    replicated mesh dims (HSDP's replicas), every rank for a plain (replicated) tensor."""
    if isinstance(t, DTensor):
        return math.prod(t.device_mesh.size(d) for d, p in enumerate(t.placements) if p.is_replicate())
    return process_group.world_size()


def _local_nbytes(t: torch.Tensor) -> int:
    local = local_tensor(t)
    return local.numel() * local.element_size()


def _previous_hint(step_dir: str) -> str:
    parent, name = os.path.split(os.path.normpath(step_dir))
    step = folder.step_of(name)
    previous = previous_complete_step(parent, step) if step is not None else None
    if previous is None:
        return "no earlier complete step in the folder"
    return (f"the previous complete step is step_{previous} in {parent} (manifest and sizes check out): "
            f"resume from it with checkpoint.load_step={previous}")


def _write_json(path: str, record: dict) -> None:
    with open(path, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
