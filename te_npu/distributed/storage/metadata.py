"""DCP's ``.metadata`` read without running code from it.

DCP writes a step's ``.metadata`` with ``pickle``, and ``FileSystemReader.read_metadata`` loads it
with ``pickle.load``, which calls whatever the file names: a crafted ``.metadata`` runs code on
every rank that loads the step. The manifest's CRC-32 cannot help (whoever can write the folder
can rewrite the manifest too). ``SafeFileSystemReader`` is ``FileSystemReader`` with its
``read_metadata`` replaced by ``read_metadata_safely``:

1. an unpickler that resolves only what DCP metadata is made of: the dataclasses of
   ``torch.distributed.checkpoint.metadata`` (``Metadata``, ``MetadataIndex``, ``StorageMeta``,
   ``TensorStorageMetadata``, ``BytesStorageMetadata``, ``ChunkStorageMetadata``,
   ``TensorProperties``), the filesystem
   reader's ``_StorageInfo``, ``torch.Size``, torch's dtypes / layouts / memory formats (and the
   two private look-ups they pickle through, ``te_npu.compat.DCP_METADATA_PRIVATE_GLOBALS``) and
   ``pathlib`` paths. Any other global (``os.system``, ``builtins.eval``, ...) is refused before
   it is called;
2. a check of the shape of what was built: a ``Metadata`` whose every entry is a tensor
   (``TensorStorageMetadata``: te_npu saves tensors only, and DCP would ``torch.load`` a bytes
   entry with ``weights_only=False``), whose storage entries are ``__R_I.distcp`` files of the step
   itself with no stream transform, and whose planner data is ``{key: (str, ...)}``.

The tensor bytes DCP then reads are loaded with ``torch.load(weights_only=True)`` (DCP's own
code), so with this reader nothing in a step directory can run code. A refusal is a
``ConfigError`` naming the file and the offending global or entry, in one line.
"""
from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from te_npu.compat import dcp_metadata_private_globals
from te_npu.errors import ConfigError

__all__ = ["SafeFileSystemReader", "read_metadata_safely", "ALLOWED_GLOBALS"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_PUBLIC = {
    (_DCP_METADATA, cls.__name__): cls
    for cls in (Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata, ChunkStorageMetadata, TensorProperties,
                BytesStorageMetadata)  # a bytes entry unpickles, then the shape check refuses it, naming its key
}
_PATHS = {("pathlib", cls.__name__): cls for cls in (Path, PosixPath, WindowsPath, PurePosixPath, PureWindowsPath)}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")


def _allowed() -> dict[tuple[str, str], Any]:
    allowed = {**_PUBLIC, **_PATHS, ("torch", "Size"): torch.Size, **dcp_metadata_private_globals()}
    allowed.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, _TORCH_VALUES)})
    return allowed


ALLOWED_GLOBALS: dict[tuple[str, str], Any] = _allowed()
"""``(module, name) -> object``: every global a te_npu step's ``.metadata`` may name."""
_STORAGE_INFO = ALLOWED_GLOBALS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")]


class _Refused(Exception):
    """What the restricted unpickler met that DCP metadata never holds (reported as ``ConfigError``)."""


class _RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only ``ALLOWED_GLOBALS`` and refuses persistent references."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise _Refused(f"it names the global {module}.{name}, which is not part of DCP metadata "
                           "(a crafted or foreign file: loading it with pickle would call it)") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("it holds a persistent reference, which DCP metadata never has")


def read_metadata_safely(path: str | os.PathLike) -> Metadata:
    """Unpickle and check the DCP metadata file ``path`` (see the module doc)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"checkpoint {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        metadata = _RestrictedUnpickler(io.BytesIO(data)).load()
        _check(metadata)
    except _Refused as exc:
        raise ConfigError(f"checkpoint {path}: refused: {exc}; nothing from it was run") from None
    except Exception as exc:  # noqa: BLE001 - truncated or garbled pickles raise all sorts
        raise ConfigError(f"checkpoint {path}: not a readable DCP metadata file ({type(exc).__name__}: {exc})") from None
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``torch.distributed.checkpoint.FileSystemReader`` whose metadata is read by
    ``read_metadata_safely``; everything else is DCP's own reader."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = read_metadata_safely(os.path.join(os.fspath(self.path), name))
        if metadata.storage_meta is None:  # as FileSystemReader.read_metadata
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check(metadata: Any) -> None:
    if type(metadata) is not Metadata:
        raise _Refused(f"it holds a {type(metadata).__name__}, not a DCP Metadata")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise _Refused("its state_dict_metadata is not a dict")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            raise _Refused(f"it has a non-string key {key!r}")
        if type(entry) is not TensorStorageMetadata:
            raise _Refused(f"entry {key!r} is a {type(entry).__name__}, not a tensor: te_npu checkpoints hold "
                           "tensors only (DCP would unpickle a bytes entry's data with weights_only=False)")
        if type(entry.properties) is not TensorProperties or not isinstance(entry.properties.dtype, torch.dtype):
            raise _Refused(f"entry {key!r} has malformed tensor properties")
        if type(entry.size) is not torch.Size or not all(type(c) is ChunkStorageMetadata for c in entry.chunks):
            raise _Refused(f"entry {key!r} has a malformed size or chunk list")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise _Refused("its storage_data is not a dict")
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(info) is not _STORAGE_INFO:
            raise _Refused("its storage_data holds something other than DCP storage entries")
        if not isinstance(info.relative_path, str) or not _SHARD_FILE.fullmatch(info.relative_path):
            raise _Refused(f"storage entry of {index.fqn!r} points at {info.relative_path!r}, not a __R_I.distcp "
                           "file of the step")
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0 and info.length >= 0):
            raise _Refused(f"storage entry of {index.fqn!r} has a malformed offset / length")
        if getattr(info, "transform_descriptors", None):
            raise _Refused(f"storage entry of {index.fqn!r} asks for stream transforms "
                           f"{list(info.transform_descriptors)}, which te_npu never writes")
    planner = metadata.planner_data
    if planner is not None and not (isinstance(planner, dict) and all(
            isinstance(k, str) and isinstance(v, tuple) and all(isinstance(p, (str, int)) for p in v)
            for k, v in planner.items())):
        raise _Refused("its planner_data is not a {key: (str, ...)} mapping")
