"""Offline conversion between a run's DCP checkpoints and Hugging Face directories, on any ranks.

``dcp_to_hf``: a te_npu DCP step (the FP32 masters, or the logical weights where a parameter
has none, and the persistent buffers) -> an HF safetensors directory in the asked dtype.
``hf_to_dcp``: an HF directory -> a te_npu DCP checkpoint at step 0 (masters = the HF values,
AdamW moments zero), which ``checkpoint.resume: true`` with ``checkpoint.dir`` pointing at it
continues exactly like ``checkpoint.initial_load_path`` would start. It starts a lineage of its
own and refuses an output folder that already holds a run's steps or ``latest`` (its ``step_0``
would become that run's ``latest``, and ``resume: auto`` would restart from the HF weights); it
holds the folder's lock while it writes, so it cannot meet a job writing there.

Both run under torchrun (every rank holds and reads 1/world of each tensor whose dim 0 divides
evenly, the rest whole) or in one process, on CPU: no 8-bit weights and no accelerator are
involved. ``scripts/convert_checkpoint.py`` is the command line; the model comes from the run's
YAML config through its ``TrainTask`` (``build`` on meta, ``hf_adapter``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from te_npu.compat import non_persistent_buffer_names
from te_npu.distributed.storage import dcp
from te_npu.distributed.storage import folder as checkpoint_folder
from te_npu.distributed.storage.dcp import persistent_buffers
from te_npu.distributed.storage.lock import acquire_folder_lock
from te_npu.distributed.storage.metadata import SafeFileSystemReader
from te_npu.distributed.storage.hf_checkpoint import HFWriteReport, save_hf_weights
from te_npu.distributed.optim import MasterWeightOptimizer
from te_npu.distributed.storage.progress import ProgressBar
from te_npu.errors import ConfigError
from te_npu.training.hf import weights as hf_weights
from te_npu.training.config import TrainConfig
from te_npu.distributed import process_group

__all__ = ["dcp_to_hf", "hf_to_dcp"]

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_LOAD_BATCH = 64  # tensors per torch_dcp.load call: the unit of the progress bar


def dcp_to_hf(cfg: TrainConfig, task, checkpoint_dir: str, out: str, *, dtype: str = "bf16",
              max_shard_mb: int = 5000, per_expert: bool = True, overwrite: bool = False,
              progress: bool = True) -> HFWriteReport:
    """Export the DCP step ``checkpoint_dir`` refers to (``latest`` or a step directory) to ``out``."""
    cfg = cfg.with_model_section(task.model_section)
    path = dcp.latest_checkpoint(checkpoint_dir)
    adapter = hf_weights.hf_adapter_of(task, cfg, where="model")
    with torch.device("meta"):
        model = task.build(cfg, _DTYPES[cfg.training.param_dtype])
    dcp.verify_step(path, checksums=False)  # manifest sizes and a safely read .metadata, before any tensor
    saved = dcp.read_metadata(path).state_dict_metadata
    params, buffers = dict(model.named_parameters()), persistent_buffers(model)
    keys = {fqn: f"optim.{fqn}.master" if f"optim.{fqn}.master" in saved else f"model.{fqn}" for fqn in params}
    keys.update({fqn: f"model.{fqn}" for fqn in buffers})
    missing = sorted(k for k in keys.values() if k not in saved)
    shapes = {fqn: tuple(t.shape) for fqn, t in {**params, **buffers}.items()}
    wrong = [f"{keys[f]}: checkpoint {list(saved[keys[f]].size)}, model {list(s)}"
             for f, s in shapes.items() if keys[f] in saved and tuple(saved[keys[f]].size) != s]
    if missing or wrong:
        raise ConfigError(f"{path}: the DCP checkpoint does not match the model of the config: missing {missing}, "
                          f"mis-shaped {wrong}")
    mesh = _mesh()
    tensors = {fqn: _sharded_zeros(shape, torch.float32, mesh) for fqn, shape in shapes.items()}
    items = list(tensors.items())
    batches = [items[i: i + _LOAD_BATCH] for i in range(0, len(items), _LOAD_BATCH)]
    with ProgressBar(len(items), "reading DCP tensors", enabled=progress and process_group.rank() == 0, unit="tensor") as bar:
        for batch in batches:
            torch_dcp.load({keys[fqn]: t for fqn, t in batch}, storage_reader=SafeFileSystemReader(path),
                     no_dist=not dist.is_initialized())
            bar.update(len(batch))
    torch_dtype = hf_weights.EXPORT_DTYPES[dtype]
    config, extra_files = hf_weights.export_config(adapter, torch_dtype, cfg.checkpoint.initial_load_path)
    info = dcp.step_info(path)  # the export is that run's: a rerun of it sees its step exported
    owner = {"lineage": info.get("lineage"), "step": int(info["step"])} if info.get("lineage") else None
    return save_hf_weights(out, tensors, adapter.key_map, config, dtype=torch_dtype,
                           max_shard_bytes=max_shard_mb * 2**20, per_expert=per_expert, overwrite=overwrite,
                           owner=owner, extra_files=extra_files, progress=progress and process_group.rank() == 0)


FRESH_START_EXTRA = {"data": None, "skipped_iterations": 0, "rng": None}
"""Per-rank extra state of a converted step 0: weights only, no training position (the run that
resumes from it reads its data from the start and keeps its seeded RNG)."""


def hf_to_dcp(cfg: TrainConfig, task, hf_dir: str, out: str, *, progress: bool = True) -> str:
    """Write the HF directory ``hf_dir`` as a te_npu DCP checkpoint at step 0 in ``out``; returns its path."""
    cfg = cfg.with_model_section(task.model_section)
    adapter = hf_weights.hf_adapter_of(task, cfg, where="model")
    hf = hf_weights.open_initial_checkpoint(hf_dir, adapter)
    param_dtype = _DTYPES[cfg.training.param_dtype]
    with torch.device("meta"):
        model = task.build(cfg, param_dtype)
    hf_weights.check_initial_keys(hf, model, adapter)
    note = hf_weights.left_out_note(hf, adapter)
    if note and process_group.rank() == 0:
        print(f"note: {note}", flush=True)
    _materialize_sharded_(model, _mesh())
    optimizer = MasterWeightOptimizer(model, lr=cfg.training.lr)  # no 8-bit weights: masters from the params
    lock = _claim_output(out)  # before any tensor is read: a refused folder fails in seconds
    saved = False
    try:
        hf_weights.load_initial_weights(hf, model, optimizer, adapter, progress=progress and process_group.rank() == 0)
        path = dcp.save(out, model, optimizer, 0, extra=FRESH_START_EXTRA, lineage=dcp.new_lineage())
        saved = True
        return path
    finally:
        if lock is not None:
            lock.release(discard=not saved)  # a refused load leaves no lock file (nor a folder it created)


def _claim_output(out: str):
    """Rank 0 locks ``out`` and refuses a folder holding a run's steps or ``latest``; every rank
    raises the same ``ConfigError``. Returns rank 0's lock (None elsewhere)."""
    lock, error = None, None
    if process_group.rank() == 0:
        try:
            lock = acquire_folder_lock(out, key="--out")
            held = checkpoint_folder.held_checkpoints(out)
            if held:
                lock.release(discard=True)
                lock = None
                raise ConfigError(f"--out: {out!r} already holds a run's checkpoints ({', '.join(held)}); a step_0 "
                                  "there would become that run's 'latest' (resume: auto would restart from the HF "
                                  "weights): write the conversion to a new or empty folder")
        except ConfigError as exc:
            error = str(exc)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ConfigError(error)
    return lock


def _materialize_sharded_(model: nn.Module, mesh) -> None:
    """Allocate a meta-built model's parameters as zero dim-0 shards (DTensors; whole where dim 0
    does not divide) and its buffers whole, in each tensor's own dtype."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(_sharded_zeros(tuple(param.shape), param.dtype, mesh)))
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None:
                persistent = name not in non_persistent_buffer_names(module)
                module.register_buffer(name, torch.zeros(buffer.shape, dtype=buffer.dtype), persistent=persistent)


def _sharded_zeros(shape: tuple[int, ...], dtype: torch.dtype, mesh) -> torch.Tensor:
    if mesh is None or not shape or shape[0] % mesh.size():
        return torch.zeros(shape, dtype=dtype)
    local = torch.zeros((shape[0] // mesh.size(), *shape[1:]), dtype=dtype)
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)


def _mesh():
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


