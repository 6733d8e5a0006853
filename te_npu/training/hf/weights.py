"""The Trainer's Hugging Face path: start a run from HF weights, export HF weights at its end.

Where the HF values enter the build order (FP32 masters come from the loaded
high-precision values, never from 8-bit weights)::

    setup: ... -> [open + check the directory and config.json]        before anything is built
           meta build -> validate -> [check every key and shape]      before any memory is allocated
           8-bit weights on meta -> shard plan -> FSDP2 on meta -> local shards -> optimizer
           -> [HF values -> FP32 master shards + buffers]             each rank reads its shards only
           -> [8-bit shards quantized from the masters]               the refresh route of every step

The masters are DTensors sharded like their parameters, so DCP's HF reader fills each rank's
master shard straight from the safetensors slices it needs (a BF16 file lands exactly in FP32);
the 8-bit shards, allocated but never written until then, are derived from those masters by
``MasterWeightOptimizer.rebuild_weights_from_masters`` -- the same route as a DCP resume -- so
no random init runs, no 8-bit value ever feeds a master, and no rank holds the whole
checkpoint. (A run with its own ``latest`` resumes from it and never reads the HF directory.)

A ``TrainTask`` offers HF support through ``hf_adapter(cfg)`` returning an ``HFAdapter``; the
model family's key mapping stays declarative on its side (te_npu never imports ``models/``).

An export of a run that started from an HF directory (``checkpoint.initial_load_path``) carries
that directory's ``config.json`` fields (token ids, ``max_position_embeddings``, ``use_cache`` ...,
once ``check_config`` confirms it still describes the model; the architecture fields are the
model's either way) and a copy of its tokenizer files and ``generation_config.json``
(``SIDE_FILES``), so the export is a drop-in replacement of its source. It writes a
``te_npu_export.json`` (the run's lineage and step): the only kind of existing directory an
export replaces (``te_npu.training.guards.preflight.check_export_dir`` refuses any other before training).
"""
from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from te_npu.distributed.storage.dcp import persistent_buffers
from te_npu.distributed.storage.hf_checkpoint import (
    HFCheckpoint,
    HFReadReport,
    HFWriteReport,
    load_hf_weights,
    open_hf_checkpoint,
    save_hf_weights,
)
from te_npu.distributed.storage.hf_layout import HFKeyMap, plan_hf_read
from te_npu.distributed.storage.hf_layout import left_out_note as left_out_note_of
from te_npu.distributed.optim import MasterWeightOptimizer
from te_npu.errors import ConfigError

__all__ = [
    "HFAdapter",
    "EXPORT_DTYPES",
    "hf_adapter_of",
    "open_initial_checkpoint",
    "check_initial_keys",
    "training_tensors",
    "left_out_note",
    "load_initial_weights",
    "export_weights",
    "export_config",
    "SIDE_FILES",
]

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_INITIAL = "checkpoint.initial_load_path"
SIDE_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
              "chat_template*", "generation_config.json")
"""Files of a source HF directory that an export copies as they are (patterns)."""


class HFAdapter(Protocol):
    """A model family's Hugging Face side: its declarative key map and its ``config.json``."""

    key_map: HFKeyMap

    def config_json(self, dtype: torch.dtype) -> dict[str, Any]:
        """The ``config.json`` of an export whose tensors are ``dtype``."""

    def check_config(self, hf_config: Mapping[str, Any]) -> None:
        """Raise ``ConfigError`` naming each field where ``hf_config`` is not the model's."""

    # Optional: ``export_fields: frozenset[str]``: config.json fields an export always takes from
    # ``config_json`` even where the source's config.json says otherwise (fields that may differ
    # from the source without changing the main model, but that describe the exported tensors).


def hf_adapter_of(task: Any, cfg: Any, *, where: str) -> HFAdapter:
    """``task.hf_adapter(cfg)``; ``ConfigError`` naming ``where`` if the task has none."""
    make = getattr(task, "hf_adapter", None)
    if make is None:
        raise ConfigError(f"{where}: {type(task).__name__} has no hf_adapter(cfg); it cannot read or write "
                          "Hugging Face checkpoints")
    return make(cfg)


def open_initial_checkpoint(path: str, adapter: HFAdapter) -> HFCheckpoint:
    """Check the HF directory and that its ``config.json`` describes the model (no tensor read)."""
    checkpoint = open_hf_checkpoint(path, where=_INITIAL)
    try:
        adapter.check_config(checkpoint.config)
    except ConfigError as exc:
        raise ConfigError(f"{_INITIAL}: {os.path.join(path, 'config.json')}: {exc}") from None
    return checkpoint


def check_initial_keys(checkpoint: HFCheckpoint, model: nn.Module, adapter: HFAdapter) -> None:
    """Every key and shape of ``checkpoint`` against ``model`` (meta is fine); ``ConfigError`` lists the misfits."""
    shapes = {fqn: tuple(t.shape) for fqn, t in {**dict(model.named_parameters()), **persistent_buffers(model)}.items()}
    plan_hf_read(shapes, checkpoint.stored, adapter.key_map, where=f"{_INITIAL} {checkpoint.path!r}")


def left_out_note(checkpoint: HFCheckpoint, adapter: HFAdapter) -> str | None:
    """One line naming the checkpoint's tensors the model does not read (``HFKeyMap.left_out``,
    e.g. DeepSeek-V3's MTP layers) and why; None when the adapter leaves nothing out."""
    return left_out_note_of(checkpoint.stored, adapter.key_map, where=f"{_INITIAL} {checkpoint.path!r}")


def training_tensors(model: nn.Module, optimizer: MasterWeightOptimizer) -> dict[str, torch.Tensor]:
    """The high-precision truth of a training run by FQN: each parameter's FP32 master shard
    (the parameter itself if it has none) and the persistent buffers (live tensors)."""
    tensors = {fqn: optimizer.masters.get(fqn, param) for fqn, param in model.named_parameters()}
    tensors.update(persistent_buffers(model))
    return tensors


def load_initial_weights(checkpoint: HFCheckpoint, model: nn.Module, optimizer: MasterWeightOptimizer,
                         adapter: HFAdapter, *, progress: bool) -> HFReadReport:
    """HF values into the FP32 masters and buffers (each rank its shards), then every weight
    (8-bit shards by the refresh route, high-precision params by a cast) from its master."""
    report = load_hf_weights(checkpoint, training_tensors(model, optimizer), adapter.key_map,
                             where=f"{_INITIAL} {checkpoint.path!r}", progress=progress)
    optimizer.rebuild_weights_from_masters()
    return report


def export_weights(directory: str, model: nn.Module, optimizer: MasterWeightOptimizer, adapter: HFAdapter, *,
                   dtype: str, max_shard_mb: int, progress: bool, owner: Mapping[str, Any] | None = None,
                   source: str | None = None) -> HFWriteReport:
    """Write the masters (cast to ``dtype``) and buffers as an HF directory. owner: the run's
    record (``lineage``, ``step``): an earlier export of the same lineage is replaced, anything
    else refused; source: the HF directory the run started from (``export_config``)."""
    torch_dtype = EXPORT_DTYPES[dtype]
    config, extra_files = export_config(adapter, torch_dtype, source)
    return save_hf_weights(directory, training_tensors(model, optimizer), adapter.key_map, config, dtype=torch_dtype,
                           max_shard_bytes=max_shard_mb * 2**20, owner=owner, extra_files=extra_files,
                           progress=progress)


def export_config(adapter: HFAdapter, dtype: torch.dtype, source: str | None) -> tuple[dict[str, Any], dict[str, str]]:
    """``(config.json, {file: source path})`` of an export: the model's ``config_json`` under the
    fields of ``source``'s ``config.json`` when it still describes the model, plus ``source``'s
    ``SIDE_FILES``. Without a readable source: the model's own config and no files."""
    config = dict(adapter.config_json(dtype))
    if not source or not os.path.isdir(source):
        return config, {}
    try:
        with open(os.path.join(source, "config.json"), encoding="utf-8") as f:
            theirs = json.load(f)
        adapter.check_config(theirs)
    except (OSError, ValueError):  # ConfigError is a ValueError: it describes another model now
        theirs = None
    if isinstance(theirs, dict):
        config = {**config, **theirs, **{k: config[k] for k in getattr(adapter, "export_fields", ()) if k in config}}
        name = str(dtype).removeprefix("torch.")
        config["dtype"] = name
        if "torch_dtype" in config:
            config["torch_dtype"] = name
    files = {n: os.path.join(source, n) for n in sorted(os.listdir(source))
             if any(fnmatch.fnmatch(n, p) for p in SIDE_FILES) and os.path.isfile(os.path.join(source, n))}
    return config, files
