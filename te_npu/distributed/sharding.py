"""Sharding plan: validate shard constraints, then apply FSDP2 (spec sections 9.1-9.2, 15).

``shard_model`` calls ``fully_shard`` on every TE module (so each quantized weight's
``FSDPParam`` lives in its own module's group and the gather extension can read its phase),
then on each ``layer_types`` module (decoder layers) and the root.

Constraints, checked on every rank *before* ``fully_shard`` (with an extension, an uneven
dim-0 shard fails on one rank and hangs the other, so nothing may be left to FSDP):

- every sharded parameter: dim 0 divisible by the world size (no padding);
- MXFP8 2D ``[N, K]``: ``N / W % 64 == 0``; MXFP8 3D ``[E, D1, D2]``: ``E % W == 0`` and
  ``(E / W * D1) % 64 == 0``;
- HiF8 3D ``[E, N, K]``: ``E % W == 0`` (never split an expert).

A violation raises ``ConfigError`` naming FQN, shape and world size, or with
``fallback_to_unsharded=True`` keeps that parameter replicated: it is passed to
``fully_shard`` as an ignored parameter (so FSDP never touches it; its GEMMs stay 8-bit) and
gets a post-accumulate-grad hook that averages its gradient over the group, like FSDP's
reduce-scatter averages the sharded ones.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from te_npu.errors import ConfigError
from te_npu.formats import Format
from te_npu.modules import TEGroupedLinear, TEGroupedSwiGLUExperts, TELinear
from te_npu.tensor import QuantizedWeightTensor

__all__ = [
    "MXFP8_SHARD_ROWS",
    "TE_MODULE_TYPES",
    "ShardPlan",
    "validate_parallel_config",
    "plan_shards",
    "shard_model",
]

MXFP8_SHARD_ROWS = 64
"""MXFP8 local (flattened) rows must be a multiple of this: two 32-row col-scale tiles."""

TE_MODULE_TYPES: tuple[type[nn.Module], ...] = (TELinear, TEGroupedLinear, TEGroupedSwiGLUExperts)


@dataclass(frozen=True)
class ShardPlan:
    """``sharded``: FQNs FSDP will shard; ``replicated``: FQN -> why it stays replicated."""

    sharded: tuple[str, ...]
    replicated: dict[str, str]


def validate_parallel_config(
    *,
    comm_fusion: bool = False,
    tensor_parallel: int = 1,
    context_parallel: int = 1,
    expert_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> None:
    """Fail fast on what Q3 does not support: FSDP communication fusion and TP/CP/EP/PP > 1."""
    if comm_fusion:
        raise ConfigError(
            "fsdp_config.comm_fusion: true is not supported with quantized-weight all-gather extensions; set it to false"
        )
    sizes = {
        "tensor_parallel": tensor_parallel,
        "context_parallel": context_parallel,
        "expert_parallel": expert_parallel,
        "pipeline_parallel": pipeline_parallel,
    }
    for name, size in sizes.items():
        if size != 1:
            raise ConfigError(f"parallel.{name}_size: {size} is not supported; only FSDP2 data parallelism (size 1) is")


def shard_violation(fqn: str, param: torch.Tensor, world_size: int) -> str | None:
    """Why ``param`` cannot be sharded over ``world_size`` ranks on dim 0, or None."""
    local = param._local_tensor if hasattr(param, "_local_tensor") else param
    shape = list(param.shape)
    where = f"parameter {fqn!r} shape {shape} over FSDP world size {world_size}"
    if world_size == 1:
        return None
    if not shape or shape[0] % world_size:
        return f"{where}: dim 0 is not divisible by the world size (uneven shards need padding, unsupported)"
    if not isinstance(local, QuantizedWeightTensor):
        return None
    rows_local = shape[0] // world_size
    if local.format == Format.MXFP8_E4M3:
        flat_rows = rows_local * (shape[1] if len(shape) == 3 else 1)
        if flat_rows % MXFP8_SHARD_ROWS:
            what = f"(E_local={rows_local}) * D1={shape[1]}" if len(shape) == 3 else f"N_local={rows_local}"
            return f"{where}: MXFP8 local rows {what} = {flat_rows} is not a multiple of {MXFP8_SHARD_ROWS}"
    return None  # HiF8: E % W == 0 (whole experts) is the divisibility check above


def plan_shards(
    named_params: Iterable[tuple[str, torch.Tensor]], world_size: int, *, fallback_to_unsharded: bool
) -> ShardPlan:
    """Check every parameter; raise ``ConfigError`` listing violations unless falling back."""
    sharded, replicated = [], {}
    for fqn, param in named_params:
        reason = shard_violation(fqn, param, world_size)
        if reason is None:
            sharded.append(fqn)
        else:
            replicated[fqn] = reason
    if replicated and not fallback_to_unsharded:
        raise ConfigError(
            "shard constraints violated (set fsdp_config.fallback_to_unsharded: true to keep these replicated):\n  "
            + "\n  ".join(replicated.values())
        )
    return ShardPlan(tuple(sharded), replicated)


def shard_model(
    model: nn.Module,
    mesh,
    *,
    reshard_after_forward: bool = True,
    fallback_to_unsharded: bool = False,
    comm_fusion: bool = False,
    layer_types: tuple[type[nn.Module], ...] = (),
    unit_types: tuple[type[nn.Module], ...] = TE_MODULE_TYPES,
    mp_policy=None,
) -> ShardPlan:
    """Validate, then ``fully_shard`` each ``unit_types`` module, each ``layer_types`` module and the root.

    mesh: a 1D ``DeviceMesh`` (the FSDP group). Returns the ``ShardPlan`` (replicated FQNs
    are kept out of FSDP and get a gradient all-reduce hook).
    """
    validate_parallel_config(comm_fusion=comm_fusion)
    plan = plan_shards(model.named_parameters(), mesh.size(), fallback_to_unsharded=fallback_to_unsharded)
    replicated = {model.get_parameter(fqn) for fqn in plan.replicated}
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    units = [m for m in model.modules() if isinstance(m, unit_types) and m is not model]
    layers = [m for m in model.modules() if isinstance(m, layer_types) and m is not model]
    for module in units + layers:
        owned = set(module.parameters()) - replicated
        if owned:
            fully_shard(module, ignored_params=replicated & set(module.parameters()) or None, **kwargs)
    fully_shard(model, ignored_params=replicated or None, **kwargs)
    group = mesh.get_group()
    for param in replicated:
        param.register_post_accumulate_grad_hook(_average_grad_hook(group))
    return plan


def _average_grad_hook(group):
    def hook(param: torch.Tensor) -> None:
        dist.all_reduce(param.grad, group=group)
        param.grad.div_(dist.get_world_size(group))

    return hook
