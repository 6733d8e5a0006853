"""Hugging Face safetensors directories in and out of a sharded model, through DCP's HF storage.

Reading (``open_hf_checkpoint`` then ``load_hf_weights``): the directory is checked first
(a directory, ``config.json``, ``*.safetensors`` that agree with ``model.safetensors.index.json``),
then every key and shape against the model (``hf_layout.plan_hf_read``), and only then does
``torch.distributed.checkpoint.load`` run with ``HuggingFaceStorageReader``. Each target is
either one of the model's tensors itself (a DTensor shard or a plain tensor, any dtype: values
are cast on copy, so a BF16 file lands exactly in FP32 masters) or, for per-expert keys, a view
into the rank's own local experts. DCP's planner then asks safetensors for exactly the slices
each rank holds (``get_slice``: only those bytes are read); ``HFReadReport`` records what each
rank read.

Writing (``save_hf_weights``): every rank writes its own shards with
``HuggingFaceStorageWriter(save_distributed=True)`` into ``<dir>.tmp/sharded`` (per-expert keys:
the rank's local experts only; replicated tensors are deduplicated by DCP), then the ranks
consolidate the output files between them (file ``i`` on rank ``(i - 1) % world``, torch's
``_consolidate_hf_safetensors``, one tensor in memory at a time), rank 0 writes
``model.safetensors.index.json`` and ``config.json`` and renames ``<dir>.tmp`` to ``<dir>``:
no rank gathers the model, and a save that dies leaves no half-written ``<dir>``.

What an export may replace: ``<dir>`` absent or empty, or, with ``owner``, a directory whose
``te_npu_export.json`` (written into every export with ``owner``'s record and the list of files
the export wrote) names the same lineage: an earlier export of the same run. Anything else is
refused before any tensor is written unless ``overwrite``. The export writes and deletes only
its own files: in an earlier export, the files its record does not list (a tokenizer a user
added, notes) are moved into the new export as they are and named in ``HFWriteReport.kept``; one
whose name the new export writes too is refused before anything is written, naming it (the
export would overwrite it). The earlier export's own files go to ``<dir>.replaced`` while the new
one takes its name, and are deleted after. A ``<dir>.tmp`` left by an export that died (only
export files in it) is removed and the export written again (``HFWriteReport.completed``).
Rank 0 checks the free space first (the staging files and the consolidated ones coexist: twice
the export's bytes). ``extra_files`` are copied in as they are (the source checkpoint's tokenizer
files, ``generation_config.json``). ``export_state`` says whether a directory holds a complete
export of a given run and step.

Every file read is named in the error it causes: a ``config.json`` or index that is not JSON, a
safetensors file whose header does not parse or that is shorter than its header says.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.tensor import DTensor

from te_npu.compat import consolidate_safetensors_files, local_shape_and_global_offset
from te_npu.distributed.storage.disk_space import DiskFullError, format_bytes, free_bytes, raise_if_disk_full
from te_npu.distributed.storage.hf_layout import HFKeyMap, HFPiece, HFStoredTensor, plan_hf_read, plan_hf_write
from te_npu.distributed.storage.progress import ProgressBar
from te_npu.errors import ConfigError
from te_npu.distributed import process_group

__all__ = [
    "HFCheckpoint",
    "HFRead",
    "HFReadReport",
    "HFWriteReport",
    "open_hf_checkpoint",
    "load_hf_weights",
    "save_hf_weights",
    "hf_file_names",
    "export_owner",
    "export_state",
    "EXPORT_RECORD",
]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
EXPORT_RECORD = "te_npu_export.json"
"""Written into every export made with an ``owner``: which run (lineage) and step it holds."""
_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class HFCheckpoint:
    """A checked HF checkpoint directory: its ``config.json`` and every stored tensor's header."""

    path: str
    config: Mapping[str, Any]
    files: tuple[str, ...]
    stored: Mapping[str, HFStoredTensor]

    @property
    def total_bytes(self) -> int:
        return sum(_numel(t.shape) * t.dtype.itemsize for t in self.stored.values())


@dataclass(frozen=True)
class HFRead:
    """One slice DCP's planner asked the reader for: ``key[offsets : offsets + lengths]``."""

    key: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    nbytes: int


@dataclass
class HFReadReport:
    """What this rank read: every slice (``reads``) and their bytes, next to the checkpoint's size."""

    rank: int
    reads: list[HFRead] = field(default_factory=list)
    checkpoint_bytes: int = 0

    @property
    def bytes_read(self) -> int:
        return sum(r.nbytes for r in self.reads)


@dataclass(frozen=True)
class HFWriteReport:
    """An export: its directory, files, tensor count and bytes (the index's ``total_size``)."""

    directory: str
    files: tuple[str, ...]
    num_tensors: int
    total_bytes: int
    kept: tuple[str, ...] = ()
    """Files of the earlier export this one replaced that it did not write: moved in, untouched."""
    completed: bool = False
    """A ``<dir>.tmp`` of an export that died was found and this export replaced it."""


# ---- reading ------------------------------------------------------------------------------------


def open_hf_checkpoint(path: str | os.PathLike, *, where: str) -> HFCheckpoint:
    """Check an HF checkpoint directory and read its headers (no tensor data).

    ``where`` (e.g. ``"checkpoint.initial_load_path"``) prefixes every ``ConfigError``: not a
    directory, no ``config.json``, no ``*.safetensors``, an index naming absent files or keys,
    files or keys the index does not list, a key stored twice.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ConfigError(f"{where}: {path!r} does not exist")
    if not os.path.isdir(path):
        raise ConfigError(f"{where}: {path!r} is not a directory (a Hugging Face checkpoint is a directory "
                          f"holding {CONFIG_FILE} and *{_SUFFIX} files)")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ConfigError(f"{where}: {path!r} has no {CONFIG_FILE}")
    config = _read_json(config_path, where)
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: {config_path}: not a JSON object")
    files = sorted(n for n in os.listdir(path) if n.endswith(_SUFFIX))
    if not files:
        raise ConfigError(f"{where}: {path!r} has no *{_SUFFIX} file")
    for name in files:
        _check_safetensors_header(os.path.join(path, name), where)
    metadata = HuggingFaceStorageReader(path).read_metadata().state_dict_metadata
    twice = sorted(k for k, m in metadata.items() if len(m.chunks) > 1)
    if twice:
        raise ConfigError(f"{where}: {path!r}: keys stored in more than one file: {twice[:20]}")
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
        index = _read_json(index_path, where)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{where}: {index_path}: no 'weight_map' object in it")
        absent = sorted(set(weight_map.values()) - set(files))
        unlisted = sorted(set(files) - set(weight_map.values()))
        if absent or unlisted:
            raise ConfigError(f"{where}: {INDEX_FILE} in {path!r} does not match the files: listed but absent "
                              f"{absent}, present but not listed {unlisted} (every *{_SUFFIX} file is read)")
        if set(weight_map) != set(metadata):
            raise ConfigError(f"{where}: {INDEX_FILE} in {path!r} does not match the files' keys: indexed but not "
                              f"stored {sorted(set(weight_map) - set(metadata))[:20]}, stored but not indexed "
                              f"{sorted(set(metadata) - set(weight_map))[:20]}")
    elif len(files) > 1:
        raise ConfigError(f"{where}: {path!r} holds {len(files)} *{_SUFFIX} files but no {INDEX_FILE}")
    stored = {k: HFStoredTensor(tuple(m.size), m.properties.dtype) for k, m in metadata.items()}
    return HFCheckpoint(path, config, tuple(files), stored)


def load_hf_weights(
    checkpoint: HFCheckpoint,
    targets: Mapping[str, torch.Tensor],
    key_map: HFKeyMap,
    *,
    where: str,
    progress: bool = False,
    threads: int = 1,
) -> HFReadReport:
    """Fill ``targets`` ({our FQN: tensor}, DTensor shards or plain tensors, in place) from
    ``checkpoint``; every rank calls it and reads only the slices of its own shards.

    Raises ``ConfigError`` listing every missing / unexpected / mis-shaped key before reading,
    and if a rank's shard would split a per-expert HF tensor (experts must be whole per rank).
    """
    plan = plan_hf_read({fqn: tuple(t.shape) for fqn, t in targets.items()}, checkpoint.stored, key_map, where=where)
    state: dict[str, torch.Tensor] = {}
    for fqn, pieces in plan.items():
        target = targets[fqn]
        if pieces is None:
            state[fqn] = target
            continue
        local, offsets = _local_region(target)
        for piece in pieces:
            view = _local_piece(local, offsets, tuple(target.shape), piece, where)
            if view is not None:
                state[piece.key] = view
    report = HFReadReport(process_group.rank(), checkpoint_bytes=checkpoint.total_bytes)
    reader = _RecordingReader(checkpoint.path, report, progress=progress, threads=threads)
    with torch.no_grad():
        dcp.load(state, storage_reader=reader, no_dist=not dist.is_initialized())
    reader.close()
    return report


class _RecordingReader(HuggingFaceStorageReader):
    """``HuggingFaceStorageReader`` that records the slices DCP's plan asks for and ticks a bar."""

    def __init__(self, path: str, report: HFReadReport, *, progress: bool, threads: int) -> None:
        super().__init__(path, thread_count=threads)
        self._report, self._progress, self._bar = report, progress, None

    def read_data(self, plan, planner):
        for item in plan.items:
            dtype = self.storage_data[item.storage_index].dtype
            self._report.reads.append(HFRead(item.storage_index.fqn, tuple(item.storage_offsets), tuple(item.lengths),
                                             _numel(item.lengths) * dtype.itemsize))
        self._bar = ProgressBar(len(plan.items), "reading HF tensors", enabled=self._progress, unit="tensor")
        return super().read_data(plan, planner)

    def _process_read_request(self, f, req, planner) -> None:
        super()._process_read_request(f, req, planner)
        self._bar.update()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _local_region(target: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The local tensor of ``target`` and its offset in the global tensor, per dim."""
    if not isinstance(target, DTensor):
        return target, (0,) * target.dim()
    _, offsets = local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return target.to_local(), offsets


def _local_piece(local: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...], piece: HFPiece,
                 where: str) -> torch.Tensor | None:
    """The view of ``local`` that holds ``piece`` (None if this rank holds none of it)."""
    lo = (piece.expert, piece.rows[0], *([0] * (len(shape) - 2)))
    hi = (piece.expert + 1, piece.rows[1], *shape[2:])
    local_hi = tuple(o + s for o, s in zip(offsets, local.shape))
    if any(h <= o or l >= lh for l, h, o, lh in zip(lo, hi, offsets, local_hi)):
        return None
    if any(l < o or h > lh for l, h, o, lh in zip(lo, hi, offsets, local_hi)):
        raise ConfigError(f"{where}: {piece.key}: this rank's shard of {piece.fqn} {list(shape)} (offsets "
                          f"{list(offsets)}, local {list(local.shape)}) splits it; per-expert keys need whole "
                          "experts on each rank")
    view = local[piece.expert - offsets[0], piece.rows[0] - offsets[1]: piece.rows[1] - offsets[1]]
    return view[(slice(None),) + tuple(slice(l - o, h - o) for l, h, o in zip(lo[2:], hi[2:], offsets[2:]))]


# ---- writing ------------------------------------------------------------------------------------


def hf_file_names(num_files: int) -> dict[int, str]:
    """Output file of each 1-based index: ``model.safetensors`` alone, else HF's sharded names."""
    if num_files == 1:
        return {1: SINGLE_FILE}
    return {i: f"model-{i:05d}-of-{num_files:05d}{_SUFFIX}" for i in range(1, num_files + 1)}


def save_hf_weights(
    directory: str | os.PathLike,
    sources: Mapping[str, torch.Tensor],
    key_map: HFKeyMap,
    config: Mapping[str, Any],
    *,
    dtype: torch.dtype,
    max_shard_bytes: int = 5 * 2**30,
    per_expert: bool = True,
    overwrite: bool = False,
    owner: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, str] | None = None,
    progress: bool = False,
    threads: int = 1,
) -> HFWriteReport:
    """Write ``sources`` ({our FQN: tensor}, DTensor shards or plain tensors) as an HF directory.

    dtype: the tensors' dtype on disk (``key_map.keep_fp32`` FQNs stay FP32); config: the
    ``config.json`` to write (its ``dtype`` is set to ``dtype``); per_expert: split expert
    stacks into per-expert keys (``save_pretrained``'s layout). Every rank calls it. What an
    existing ``directory`` may be (see the module doc): empty, an earlier export of ``owner``'s
    lineage, or anything with ``overwrite``. owner: the record written as ``te_npu_export.json``
    (``lineage``, ``step``); extra_files: ``{name in the export: source path}`` copied in.
    """
    final = os.path.abspath(os.fspath(directory))
    tmp = final + ".tmp"
    staging = os.path.join(tmp, "sharded")
    entries = plan_hf_write({fqn: tuple(t.shape) for fqn, t in sources.items()}, key_map, dtype=dtype,
                            max_shard_bytes=max_shard_bytes, per_expert=per_expert)
    names = hf_file_names(max(e.file_index for e in entries))
    rank, world = process_group.rank(), process_group.world_size()
    total = sum(_numel(e.shape) * e.dtype.itemsize for e in entries)
    what = f"HF export to {final}"
    written = sorted({*names.values(), CONFIG_FILE, *(extra_files or {}), *([INDEX_FILE] if len(names) > 1 else []),
                      *([EXPORT_RECORD] if owner is not None else [])})
    problem, completed = None, False
    if rank == 0:
        refused = _replace_problem(final, owner, overwrite) or _foreign_clash(final, written, overwrite)
        refused = refused or _staging_problem(tmp)
        needed = 2 * total + (64 << 20)  # the sharded staging files and the consolidated ones coexist
        if refused is None and os.path.isdir(tmp):
            shutil.rmtree(tmp)  # export files of an export that died (checked by _staging_problem)
            completed = True
        if refused is not None:
            problem = ("config", refused)
        elif (free := free_bytes(os.path.dirname(final))) < needed:
            problem = ("space", f"{what}: {os.path.dirname(final)} has {format_bytes(free)} free, the export needs "
                                f"about {format_bytes(needed)} while it is written; nothing was written")
        else:
            os.makedirs(staging)
    problem, completed = _rank0_decision((problem, completed))
    if problem is not None:
        kind, message = problem
        raise ConfigError(message) if kind == "config" else DiskFullError(message)

    try:
        _write_shards(staging, sources, entries, threads)
        process_group.barrier()
        mine = [i for i in names if (i - 1) % world == rank]
        with ProgressBar(len(mine), f"writing HF files (rank {rank}'s {len(mine)} of {len(names)})",
                         enabled=progress, unit="file") as bar:
            for index in mine:
                mapping = {e.key: names[index] for e in entries if e.file_index == index}
                consolidate_safetensors_files(staging, tmp, mapping, num_threads=1)
                bar.update()
        process_group.barrier()
        if rank == 0:
            if len(names) > 1:
                weight_map = {e.key: names[e.file_index] for e in entries}
                _write_json(os.path.join(tmp, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})
            _write_json(os.path.join(tmp, CONFIG_FILE), {**config, "dtype": str(dtype).removeprefix("torch.")})
            for name, source in sorted((extra_files or {}).items()):
                shutil.copyfile(source, os.path.join(tmp, name))
            if owner is not None:
                _write_json(os.path.join(tmp, EXPORT_RECORD), {**owner, "files": written})
            shutil.rmtree(staging)
            kept = _replace_dir(tmp, final, overwrite)
    except BaseException as exc:  # a full disk: anything from OSError to "unexpected pos", in DCP's CheckpointException
        raise_if_disk_full(exc, os.path.dirname(final), 2 * total, what)
        raise
    kept = _rank0_decision(kept if rank == 0 else None)
    process_group.barrier()
    return HFWriteReport(final, tuple(names.values()), len(entries), total, tuple(kept), completed)



def export_owner(directory: str | os.PathLike) -> dict | None:
    """The ``te_npu_export.json`` record of an export directory (None if it has none or it is unreadable)."""
    try:
        with open(os.path.join(directory, EXPORT_RECORD), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _write_shards(staging: str, sources: Mapping[str, torch.Tensor], entries, threads: int) -> None:
    """Every rank's shards of every entry into ``staging`` (DCP's HF writer, distributed)."""
    state: dict[str, torch.Tensor] = {}
    for entry in entries:
        source = sources[entry.fqn].detach()
        if entry.piece is None:  # a copy (another key than its FQN) gets its own storage, as safetensors needs
            state[entry.key] = source.to(entry.dtype, copy=entry.key != entry.fqn)
            continue
        local, offsets = _local_region(source)
        view = _local_piece(local, offsets, tuple(source.shape), entry.piece, "HF export")
        if view is not None:  # an own copy: safetensors refuses tensors that share storage
            state[entry.key] = view.to(entry.dtype, copy=True)
    writer = HuggingFaceStorageWriter(staging, fqn_to_index_mapping={e.key: e.file_index for e in entries},
                                      save_distributed=True, thread_count=threads)
    dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())


def _replace_problem(final: str, owner: Mapping[str, Any] | None, overwrite: bool) -> str | None:
    """Why ``final`` must not be replaced (None: absent, empty, this run's earlier export, or ``overwrite``)."""
    if not os.path.lexists(final) or overwrite:
        return None
    if not os.path.isdir(final):
        return f"HF export: {final!r} exists and is not a directory"
    held = sorted(os.listdir(final))
    if not held:
        return None
    record = export_owner(final)
    if owner is not None and record is not None and record.get("lineage") == owner.get("lineage"):
        return None
    shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
    return (f"HF export: {final!r} already exists and holds {shown}, which is not an earlier export of this run; "
            "refusing to replace it (choose a new directory, or pass overwrite to replace it)")


def export_state(directory: str | os.PathLike, owner: Mapping[str, Any]) -> str | None:
    """None if ``directory`` holds a complete export of ``owner`` (its ``lineage`` and ``step``:
    the record names them and every file it lists is there), else what is wrong, in words."""
    directory = os.path.abspath(os.fspath(directory))
    if os.path.isdir(directory + ".tmp"):
        return f"an interrupted export ({directory}.tmp) was never finished"
    record = export_owner(directory)
    if record is None:
        return f"{directory} holds no export" if not os.path.isdir(directory) or not os.listdir(directory) else \
            f"{directory} has no {EXPORT_RECORD}"
    if record.get("lineage") != owner.get("lineage") or record.get("step") != owner.get("step"):
        return f"{directory} holds the export of step {record.get('step')} of run {record.get('lineage')}"
    absent = [n for n in record.get("files", ()) if not os.path.isfile(os.path.join(directory, n))]
    return f"{directory} lacks {', '.join(absent[:5])}" if absent else None


def _own_files(directory: str) -> set[str] | None:
    """The files an earlier export in ``directory`` wrote (its record's list; a record from before
    the list: the files every export writes), None if it is not an export."""
    record = export_owner(directory)
    if record is None:
        return None
    if isinstance(record.get("files"), list):
        return set(record["files"])
    return {n for n in os.listdir(directory)
            if n in (CONFIG_FILE, INDEX_FILE, EXPORT_RECORD) or (n.startswith("model") and n.endswith(_SUFFIX))}


def _foreign_clash(final: str, written: list[str], overwrite: bool) -> str | None:
    """Refusal when a file the export did not write in an earlier export bears a name it writes now."""
    own = _own_files(final) if os.path.isdir(final) and not overwrite else None
    if own is None:
        return None
    clash = sorted((set(os.listdir(final)) - own) & set(written))
    if not clash:
        return None
    return (f"HF export: {final!r} holds {', '.join(clash)}, which the earlier export did not write and this one "
            "would overwrite; refusing (move it out of the export, or choose another directory)")


def _staging_problem(tmp: str) -> str | None:
    """Refusal when ``<dir>.tmp`` holds anything an export does not write (it is removed otherwise)."""
    if not os.path.lexists(tmp):
        return None
    if not os.path.isdir(tmp):
        return f"HF export: {tmp!r} exists and is not a directory; refusing to remove it"
    other = sorted(n for n in os.listdir(tmp) if not (n == "sharded" or n.endswith(_SUFFIX) or n.endswith(".json")
                                                      or n.startswith(("tokenizer", "vocab", "merges", "chat_template"))))
    if other:
        return (f"HF export: {tmp!r} (an interrupted export's staging folder) also holds {', '.join(other[:5])}; "
                "refusing to remove it: move those files out")
    return None


def _replace_dir(tmp: str, final: str, overwrite: bool) -> list[str]:
    """``tmp`` becomes ``final``. An earlier export in ``final``: the files it did not write are
    moved into ``tmp`` first (returned), its own are renamed aside and deleted after; with
    ``overwrite``, a non-export ``final`` is replaced whole."""
    aside = final + ".replaced"
    kept: list[str] = []
    if os.path.lexists(final):
        own = _own_files(final) if os.path.isdir(final) else None
        if own is not None:
            kept = sorted(n for n in os.listdir(final) if n not in own)
            for name in kept:
                os.rename(os.path.join(final, name), os.path.join(tmp, name))
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)
    return kept


def _rank0_decision(value: Any) -> Any:
    """Rank 0's ``value``, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---- helpers ------------------------------------------------------------------------------------


def _read_json(path: str, where: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as exc:
        raise ConfigError(f"{where}: {path}: not valid JSON ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"{where}: {path}: cannot read it: {exc.strerror or exc}") from None


def _check_safetensors_header(path: str, where: str) -> None:
    """Parse one safetensors file's header (no tensor data is read): ``ConfigError`` naming the file."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt"):
            pass
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type for every defect
        raise ConfigError(f"{where}: {path}: not a readable safetensors file ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


