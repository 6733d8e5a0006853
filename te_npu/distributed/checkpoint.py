"""DCP checkpoints of the high-precision view (spec sections 11, 13.6).

Layout of ``dir`` (one sub-directory per step, written atomically)::

    dir/step_{N}/           DCP files (.metadata + shards) of
                              model.<fqn>               BF16 logical weights (param dtype), persistent buffers
                              optim.<fqn>.master        FP32 master shard
                              optim.<fqn>.exp_avg       FP32
                              optim.<fqn>.exp_avg_sq    FP32
                              optim.<fqn>.step          FP32 scalar
    dir/step_{N}/te_npu.json  {"step": N, "world_size": W}
    dir/step_{N}/extra_rank{r}.pt   the caller's ``extra`` of rank r (torch.save, weights_only-loadable)
    dir/latest              "step_{N}" of the newest complete save

Quantized parameters are saved as ``master.to(param.dtype)`` -- plain DTensors/tensors, never
the 8-bit wrapper (DCP would pickle it, and weights_only loading refuses it); no 8-bit data
or scale is saved: both are rebuilt from the masters on load. Keys are the model's own
parameter names, so DCP reshards on load (saved with 2 ranks, loadable with 1).

Atomicity: every rank writes into ``step_{N}.tmp``; after a barrier rank 0 renames it to
``step_{N}``, then moves ``latest`` (write a temp file + ``os.replace``) and prunes old steps.
A save that dies midway leaves a ``.tmp`` directory and the previous ``latest`` untouched.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from te_npu.errors import ConfigError
from te_npu.distributed.optim import MasterWeightOptimizer, refresh_low_precision_weights
from te_npu.tensor import QuantizedWeightTensor

__all__ = ["save", "load", "latest_checkpoint", "persistent_buffers"]

_LATEST = "latest"
_META = "te_npu.json"


def save(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: MasterWeightOptimizer,
    step: int,
    extra: Any = None,
    *,
    keep_last: int | None = None,
) -> str:
    """Save the high-precision view of ``model`` and ``optimizer`` at ``step``; returns the step path.

    extra: anything ``torch.save`` writes and ``torch.load(weights_only=True)`` reads back
    (a JSON-like dict, RNG state tensors); saved per rank. keep_last: keep only the newest
    ``keep_last`` complete steps.
    """
    directory = os.fspath(directory)
    rank = dist.get_rank() if dist.is_initialized() else 0
    name = f"step_{int(step)}"
    final, tmp = os.path.join(directory, name), os.path.join(directory, name + ".tmp")
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that died
        os.makedirs(tmp)
    _barrier()
    dcp.save(_state_dict(model, optimizer, for_save=True), checkpoint_id=tmp)
    torch.save(extra, os.path.join(tmp, f"extra_rank{rank}.pt"))
    _barrier()
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        with open(os.path.join(tmp, _META), "w") as f:
            json.dump({"step": int(step), "world_size": world}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        _write_latest(directory, name)
        if keep_last is not None:
            _prune(directory, keep_last)
    _barrier()
    return final


def load(
    directory: str | os.PathLike, model: nn.Module, optimizer: MasterWeightOptimizer | None
) -> tuple[int, Any]:
    """Restore ``latest`` (or ``directory`` itself if it is a step dir); returns ``(step, extra)``.

    With an optimizer: masters, moments and step are restored and every 8-bit shard is rebuilt
    from its master (high-precision params copied from theirs). Without: the BF16 weights are
    loaded and the 8-bit shards quantized from them.
    """
    path = latest_checkpoint(directory)
    state = _state_dict(model, optimizer, for_save=False)
    buffers = _saved_buffers(model, path)
    if optimizer is not None:  # the masters are authoritative: weights are rebuilt from them
        state["model"] = {fqn: t for fqn, t in state["model"].items() if fqn in buffers}
    else:
        all_buffers = persistent_buffers(model)
        state["model"] = {fqn: t for fqn, t in state["model"].items() if fqn in buffers or fqn not in all_buffers}
    dcp.load(state, checkpoint_id=path)
    if optimizer is not None:
        optimizer.rebuild_weights_from_masters()
    else:
        _weights_from_model_view(model, state["model"])
    with open(os.path.join(path, _META)) as f:
        step = json.load(f)["step"]
    rank = dist.get_rank() if dist.is_initialized() else 0
    extra_path = os.path.join(path, f"extra_rank{rank}.pt")
    if not os.path.exists(extra_path):
        extra_path = os.path.join(path, "extra_rank0.pt")
    extra = torch.load(extra_path, weights_only=True) if os.path.exists(extra_path) else None
    return step, extra


def latest_checkpoint(directory: str | os.PathLike) -> str:
    """The complete DCP step directory ``directory`` refers to; ``ConfigError`` if there is none."""
    directory = os.fspath(directory)
    if os.path.isfile(directory):
        raise ConfigError(f"checkpoint {directory!r} is a file; only DCP checkpoint directories are supported")
    marker = os.path.join(directory, _LATEST)
    path = directory
    if os.path.isfile(marker):
        with open(marker) as f:
            path = os.path.join(directory, f.read().strip())
    if not os.path.isfile(os.path.join(path, ".metadata")) or not os.path.isfile(os.path.join(path, _META)):
        raise ConfigError(
            f"checkpoint {directory!r} is not a te_npu DCP checkpoint (no 'latest' marker and no DCP "
            f".metadata in {path!r}); only DCP checkpoints written by te_npu.distributed.checkpoint.save load"
        )
    return path


# ---- state dicts -------------------------------------------------------------------------------


def _state_dict(model: nn.Module, optimizer: MasterWeightOptimizer | None, *, for_save: bool) -> dict:
    model_view: dict[str, torch.Tensor] = {}
    for fqn, param in model.named_parameters():
        quantized = isinstance(_local(param), QuantizedWeightTensor)
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
        if buffer is not None and name not in module._non_persistent_buffers_set
    }


def _saved_buffers(model: nn.Module, path: str) -> set[str]:
    """Buffers of ``model`` that the checkpoint holds (checkpoints before buffers were saved hold none)."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {fqn for fqn in persistent_buffers(model) if f"model.{fqn}" in saved}


def _high_precision_like(param: torch.Tensor) -> torch.Tensor:
    """A zero BF16 (logical dtype) tensor laid out like ``param``, to load the model view into."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        local = torch.zeros(param._local_tensor.shape, dtype=param.dtype, device=param._local_tensor.device)
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())
    return torch.zeros(param.shape, dtype=param.dtype, device=param.device)


@torch.no_grad()
def _weights_from_model_view(model: nn.Module, view: dict[str, torch.Tensor]) -> None:
    quantized = [(fqn, p) for fqn, p in model.named_parameters() if isinstance(_local(p), QuantizedWeightTensor)]
    refresh_low_precision_weights([p for _, p in quantized], [view[fqn] for fqn, _ in quantized])
    for fqn, param in model.named_parameters():
        if not isinstance(_local(param), QuantizedWeightTensor) and view[fqn] is not param:
            _local(param).copy_(_local(view[fqn]))


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


# ---- files -------------------------------------------------------------------------------------


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_latest(directory: str, name: str) -> None:
    tmp = os.path.join(directory, _LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, _LATEST))


def _prune(directory: str, keep_last: int) -> None:
    steps = sorted(
        (int(n[len("step_") :]), n)
        for n in os.listdir(directory)
        if n.startswith("step_") and n[len("step_") :].isdigit()
    )
    for _, name in steps[: max(len(steps) - keep_last, 0)]:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
