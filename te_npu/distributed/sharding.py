"""Sharding plan: validate shard constraints, then apply FSDP2 by units (spec sections 9.1-9.2, 12, 15).

An FSDP2 *unit* is the modules one ``fully_shard`` call groups: their parameters are
all-gathered together before the unit runs and their gradients reduce-scattered together
after its backward (one all-gather per phase and one reduce-scatter per unit and micro-batch).
The 8-bit weights' gather extension works in any unit: it reads each parameter's own FSDP2
state (``te_npu.distributed.fsdp``), so TE weights are gathered inside their layer's group.

Plans (``shard_model(units=...)``):

- ``layer_units(model, layer_types)`` -- torchtitan's plan, the trainer's: one unit per decoder
  layer (its TE modules, norms, router), each module the plan must keep apart (FP32 parameters
  in a BF16 model: FSDP2 needs one parameter dtype per unit) inside it, the modules before the
  first layer one unit each (the embedding), those after the last layer one unit (final norm +
  lm_head) that stays unsharded between forward and backward, and the root.
- ``te_module_units(model)`` -- every TE module its own unit (the default; a model with no
  layer structure, e.g. a test's few TE modules under one root).

Constraints, checked per parameter on every rank *before* ``fully_shard`` (with an extension,
an uneven dim-0 shard fails on one rank and hangs the other, so nothing may be left to FSDP):

- every sharded parameter: dim 0 divisible by the world size (no padding); a grouped weight
  ``[E, ...]`` is so split between whole experts (HiF8: never split an expert);
- a quantized weight: its class's ``shard_alignment`` (``MXFP8Tensor``: local flattened rows,
  ``N / W`` for ``[N, K]`` or ``E / W * D1`` for ``[E, D1, D2]``, a multiple of 64).

A violation raises ``ConfigError`` naming FQN, shape and world size, or with
``fallback_to_unsharded=True`` keeps that parameter replicated: it is passed to its unit's
``fully_shard`` as an ignored parameter (so FSDP never touches it; its GEMMs stay 8-bit) and
gets a post-accumulate-grad hook that averages its gradient over the group, like FSDP's
reduce-scatter averages the sharded ones.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from te_npu.compat import local_tensor
from te_npu.errors import ConfigError
from te_npu.modules import TEModule
from te_npu.tensor import QuantizedWeightTensor

__all__ = [
    "FSDPUnit",
    "ShardPlan",
    "validate_parallel_config",
    "shard_violation",
    "plan_shards",
    "te_module_units",
    "layer_units",
    "shard_model",
]


@dataclass(frozen=True)
class FSDPUnit:
    """Modules sharded by one ``fully_shard`` call; ``reshard_after_forward`` None: the plan's setting."""

    modules: tuple[nn.Module, ...]
    reshard_after_forward: bool | None = None


@dataclass(frozen=True)
class ShardPlan:
    """``sharded``: FQNs FSDP will shard; ``replicated``: FQN -> why it stays replicated;
    ``units``: the FQNs of each unit's modules, in ``fully_shard`` order (the root last, ``""``)."""

    sharded: tuple[str, ...]
    replicated: dict[str, str]
    units: tuple[tuple[str, ...], ...] = ()


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
    local = local_tensor(param)
    shape = list(param.shape)
    where = f"parameter {fqn!r} shape {shape} over FSDP world size {world_size}"
    if world_size == 1:
        return None
    if not shape or shape[0] % world_size:
        return f"{where}: dim 0 is not divisible by the world size (uneven shards need padding, unsupported)"
    if not isinstance(local, QuantizedWeightTensor):
        return None
    alignment = local.shard_alignment
    rows_local = shape[0] // world_size
    flat_rows = rows_local * math.prod(shape[1:-1])
    if flat_rows % alignment.rows:
        what = f"(E_local={rows_local}) * D1={shape[1]}" if len(shape) == 3 else f"N_local={rows_local}"
        return (f"{where}: {type(local).__name__} local rows {what} = {flat_rows} is not a multiple of "
                f"{alignment.rows} ({alignment.reason})")
    return None


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


def te_module_units(model: nn.Module) -> list[FSDPUnit]:
    """Every TE module (``te_npu.TEModule``) below the root as its own unit."""
    return [FSDPUnit((m,)) for m in model.modules() if isinstance(m, TEModule) and m is not model]


def layer_units(
    model: nn.Module, layer_types: tuple[type[nn.Module], ...], *, apart: Iterable[nn.Module] = ()
) -> list[FSDPUnit]:
    """torchtitan's plan (module docstring): ``apart`` modules, each ``layer_types`` module, then
    the parameter-holding modules outside the layers (before the first layer: one unit each;
    after the last: one unit, not resharded after forward, as backward needs it at once).

    Units are listed inner first (``fully_shard`` order); ``model``'s own parameters stay with
    the root. Raises ``ValueError`` when ``model`` holds no ``layer_types`` module.
    """
    layers = [m for m in model.modules() if isinstance(m, layer_types) and m is not model]
    if not layers:
        raise ValueError(f"layer_units: {type(model).__name__} holds no {[t.__name__ for t in layer_types]} module")
    units = [FSDPUnit((m,)) for m in apart if m is not model]
    units += [FSDPUnit((m,)) for m in layers]
    taken = {id(m) for u in units for m in u.modules}
    in_layers = {id(sub) for layer in layers for sub in layer.modules()}
    order = {id(m): i for i, m in enumerate(model.modules())}
    first, last = order[id(layers[0])], max(order[id(m)] for m in layers)
    before, after, between = [], [], []
    for module in _outside_subtrees(model, in_layers, taken):
        (before if order[id(module)] < first else after if order[id(module)] > last else between).append(module)
    units += [FSDPUnit((m,)) for m in before + between]
    if after:
        units.append(FSDPUnit(tuple(after), reshard_after_forward=False))
    return units


def _outside_subtrees(model: nn.Module, in_layers: set[int], taken: set[int]) -> list[nn.Module]:
    """The largest submodules holding parameters, no layer and no unit (pre-order)."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in in_layers or id(child) in taken:
                continue
            subtree = list(child.modules())
            if any(id(m) in in_layers or id(m) in taken for m in subtree):
                visit(child)  # holds a layer or unit: look further down
            elif any(True for _ in child.parameters()):
                found.append(child)

    visit(model)
    return found


def shard_model(
    model: nn.Module,
    mesh,
    *,
    units: Sequence[FSDPUnit] | None = None,
    reshard_after_forward: bool = True,
    fallback_to_unsharded: bool = False,
    comm_fusion: bool = False,
    mp_policy=None,
) -> ShardPlan:
    """Validate every parameter, then ``fully_shard`` each unit (default: ``te_module_units``) and the root.

    mesh: a 1D ``DeviceMesh`` (the FSDP group). Returns the ``ShardPlan`` (replicated FQNs
    are kept out of FSDP and get a gradient all-reduce hook).
    """
    validate_parallel_config(comm_fusion=comm_fusion)
    plan = plan_shards(model.named_parameters(), mesh.size(), fallback_to_unsharded=fallback_to_unsharded)
    replicated = {model.get_parameter(fqn) for fqn in plan.replicated}
    kwargs = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    names = {id(m): name for name, m in model.named_modules()}
    applied: list[tuple[str, ...]] = []
    for unit in te_module_units(model) if units is None else units:
        owned = {p for m in unit.modules for p in m.parameters()}
        if not owned - replicated:
            continue  # nothing for FSDP to shard here
        modules = unit.modules[0] if len(unit.modules) == 1 else list(unit.modules)
        reshard = reshard_after_forward if unit.reshard_after_forward is None else unit.reshard_after_forward
        fully_shard(modules, ignored_params=replicated & owned or None, reshard_after_forward=reshard, **kwargs)
        applied.append(tuple(names[id(m)] for m in unit.modules))
    fully_shard(model, ignored_params=replicated or None, reshard_after_forward=reshard_after_forward, **kwargs)
    applied.append(("",))
    group = mesh.get_group()
    for param in replicated:
        param.register_post_accumulate_grad_hook(_average_grad_hook(group))
    return ShardPlan(plan.sharded, plan.replicated, tuple(applied))


def _average_grad_hook(group):
    def hook(param: torch.Tensor) -> None:
        dist.all_reduce(param.grad, group=group)
        param.grad.div_(dist.get_world_size(group))

    return hook
