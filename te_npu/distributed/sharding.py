"""Sharding plan: validate shard constraints, then apply FSDP2 by units (docs/fsdp2.md).

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

Placement, decided per parameter on every rank *before* ``fully_shard`` (with an extension,
an uneven shard fails on one rank and hangs the other, so nothing may be left to FSDP), from
shapes alone (a meta-built model plans before anything is allocated):

- dim 0 first: divisible by the world size (no padding); a grouped weight ``[E, ...]`` is so
  split between whole experts (HiF8: never split an expert); a quantized weight also keeps its
  class's ``shard_alignment`` (``MXFP8Tensor``: local flattened rows, ``N / W`` for ``[N, K]`` or
  ``E / W * D1`` for ``[E, D1, D2]``, a multiple of 64);
- else dim 1 of a 2D parameter (FSDP2 ``Shard(1)``, over K), where its class allows it
  (``shard_alignment.cols``: MXFP8 ``K / W`` a multiple of 64) and its gather schema can gather
  it (``GatherSchema.shard_dims``): e.g. ``kv_a_proj_with_mqa [3136, 2048]`` at W = 8, whose
  392 local rows break MXFP8's 64-row pairs while 256 local columns keep them;
- else no placement keeps the format: ``ConfigError`` naming FQN, shape, world size, each dim's
  reason and the world sizes that would shard it, or with ``fallback_to_unsharded=True`` the
  parameter stays replicated: it is passed to its unit's ``fully_shard`` as an ignored
  parameter (so FSDP never touches it; its GEMMs stay 8-bit) and gets a post-accumulate-grad
  hook that averages its gradient over every rank, like FSDP's reduce-scatter averages the
  sharded ones (``average_replicated_gradients``: after ``to_empty`` for a model sharded on
  meta, whose parameters ``to_empty`` replaces).

``ShardPlan.describe()`` is the one-paragraph summary the trainer logs: how many parameters and
elements on each dim, the FQNs off dim 0 (layer indices folded), what stays replicated and its
bytes per rank.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from te_npu.compat import local_tensor
from te_npu.distributed.fsdp import gather_schema_of
from te_npu.distributed.mesh import mesh_groups, replicate_size, shard_size
from te_npu.errors import ConfigError
from te_npu.modules import TEModule
from te_npu.tensor import QuantizedWeightTensor

__all__ = [
    "FSDPUnit",
    "ShardPlan",
    "validate_parallel_config",
    "shard_dim",
    "shard_violation",
    "plan_shards",
    "te_module_units",
    "layer_units",
    "shard_model",
    "average_replicated_gradients",
]


@dataclass(frozen=True)
class FSDPUnit:
    """Modules sharded by one ``fully_shard`` call; ``reshard_after_forward`` None: the plan's setting."""

    modules: tuple[nn.Module, ...]
    reshard_after_forward: bool | None = None


_CANDIDATE_WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class ShardPlan:
    """``sharded``: FQNs FSDP will shard; ``replicated``: FQN -> why it stays replicated;
    ``units``: the FQNs of each unit's modules, in ``fully_shard`` order (the root last, ``""``);
    ``dims``: FQN -> the dim FSDP shards it on (0, or 1: ``Shard(1)`` over K); ``shapes`` /
    ``nbytes``: each planned parameter's global shape and its bytes (all inner tensors of a
    quantized weight); ``world_size``: the FSDP group size the plan is for (the shard group's
    under HSDP); ``replicate_size``: how many copies of each shard the mesh holds (HSDP; 1 flat)."""

    sharded: tuple[str, ...]
    replicated: dict[str, str]
    units: tuple[tuple[str, ...], ...] = ()
    dims: Mapping[str, int] = field(default_factory=dict)
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    nbytes: Mapping[str, int] = field(default_factory=dict)
    world_size: int = 1
    replicate_size: int = 1

    def replicated_bytes_per_rank(self) -> int:
        """Bytes every rank holds for the replicated parameters (their full size, on each rank)."""
        return sum(self.nbytes.get(fqn, 0) for fqn in self.replicated)

    def describe(self) -> str:
        """The plan in a few lines: parameters and elements per shard dim, the FQNs off dim 0
        (layer indices folded to ``*``), and the replicated ones with their bytes per rank."""
        by_dim: dict[int, list[str]] = defaultdict(list)
        for fqn in self.sharded:
            by_dim[self.dims.get(fqn, 0)].append(fqn)
        parts = [f"{len(fqns)} on dim {dim} ({sum(math.prod(self.shapes.get(f, ())) for f in fqns):,} elements)"
                 for dim, fqns in sorted(by_dim.items())]
        over = (f"HSDP plan over {self.world_size * self.replicate_size} ranks ({self.replicate_size} replicas x "
                f"{self.world_size}-rank shard groups)" if self.replicate_size > 1 else
                f"FSDP2 plan over {self.world_size} ranks")
        lines = [f"{over}: {len(self.sharded)} parameters sharded: " + ", ".join(parts)
                 + f"; {len(self.replicated)} replicated"]
        for dim, fqns in sorted(by_dim.items()):
            if dim != 0:
                lines.append(f"  Shard({dim}): " + _folded(fqns, self.shapes))
        if self.replicated:
            lines.append(f"  replicated (+{self.replicated_bytes_per_rank() / 2**30:.2f} GiB per rank): "
                         + _folded(list(self.replicated), self.shapes))
        return "\n".join(lines)


def _folded(fqns: Sequence[str], shapes: Mapping[str, tuple[int, ...]]) -> str:
    """``model.layers.*.x.weight [3136, 2048] x28, ...``: FQNs with their layer indices folded."""
    groups: dict[tuple[str, tuple[int, ...]], int] = defaultdict(int)
    for fqn in fqns:
        groups[(_fold(fqn), tuple(shapes.get(fqn, ())))] += 1
    return ", ".join(f"{name} {list(shape)}" + (f" x{n}" if n > 1 else "") for (name, shape), n in groups.items())


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


def _dim_violation(param: torch.Tensor, dim: int, world_size: int) -> str | None:
    """Why ``param`` cannot be split into ``world_size`` equal FSDP2 shards along ``dim``, or None."""
    shape = tuple(param.shape)
    if dim >= len(shape):
        return f"no dim {dim}"
    if shape[dim] % world_size:
        return f"dim {dim} ({shape[dim]}) is not divisible by the world size (uneven shards need padding, unsupported)"
    local = local_tensor(param)
    if not isinstance(local, QuantizedWeightTensor):
        return None
    if dim not in gather_schema_of(type(local)).shard_dims(len(shape)):
        return f"{type(local).__name__}'s FSDP2 gather has no Shard({dim}) for a {len(shape)}D weight"
    reason = local.shard_alignment.violation(shape, dim, world_size)
    return None if reason is None else f"{type(local).__name__} {reason}"


def shard_dim(param: torch.Tensor, world_size: int) -> tuple[int | None, list[str]]:
    """The dim FSDP2 shards ``param`` on over ``world_size`` ranks (0 first, then dim 1 of a 2D
    parameter), or None with each candidate dim's reason."""
    if world_size == 1:
        return 0, []
    reasons = []
    for dim in (0, 1) if param.dim() == 2 else (0,):
        reason = _dim_violation(param, dim, world_size)
        if reason is None:
            return dim, reasons
        reasons.append(f"Shard({dim}): {reason}")
    return None, reasons


def shard_violation(fqn: str, param: torch.Tensor, world_size: int) -> str | None:
    """Why ``param`` cannot be sharded over ``world_size`` ranks on any dim, or None."""
    reasons = _violation_reasons(param, world_size)
    if reasons is None:
        return None
    return f"parameter {fqn!r} shape {list(param.shape)} over FSDP world size {world_size}: {reasons}"


def _violation_reasons(param: torch.Tensor, world_size: int) -> str | None:
    """Each candidate dim's reason and the world sizes that would shard ``param``, or None."""
    dim, reasons = shard_dim(param, world_size)
    if dim is not None:
        return None
    fits = [w for w in _CANDIDATE_WORLD_SIZES if w != world_size and shard_dim(param, w)[0] is not None]
    return "; ".join(reasons) + (f"; it shards at world sizes {fits}" if fits else "")


def plan_shards(
    named_params: Iterable[tuple[str, torch.Tensor]], world_size: int, *, fallback_to_unsharded: bool,
    replicate_size: int = 1,
) -> ShardPlan:
    """Pick every parameter's shard dim (module doc) from its shape and class; raise one
    ``ConfigError`` listing what no dim can shard unless falling back to replicas. Reads only
    shapes and classes: a meta-built (and meta-quantized) model plans before any allocation.

    world_size: the ranks each parameter is sharded over (HSDP: the shard group);
    replicate_size: the HSDP replicas (the job runs ``world_size * replicate_size`` ranks). The
    error names the ``dp_shard_size x dp_replicate_size`` layouts of that many ranks that shard
    every refused parameter."""
    sharded, replicated, dims, shapes, nbytes = [], {}, {}, {}, {}
    folded: dict[tuple[str, tuple[int, ...], str], list[str]] = defaultdict(list)  # one line per layer-folded kind
    named_params_list = list(named_params)
    for fqn, param in named_params_list:
        shapes[fqn], nbytes[fqn] = tuple(param.shape), _param_bytes(param)
        dim, _ = shard_dim(param, world_size)
        if dim is None:
            replicated[fqn] = shard_violation(fqn, param, world_size)
            folded[(_fold(fqn), shapes[fqn], _violation_reasons(param, world_size))].append(fqn)
        else:
            sharded.append(fqn)
            dims[fqn] = dim
    plan = ShardPlan(tuple(sharded), replicated, dims=dims, shapes=shapes, nbytes=nbytes, world_size=world_size,
                     replicate_size=replicate_size)
    if replicated and not fallback_to_unsharded:
        lines = [f"parameter {fqns[0]!r} shape {list(shape)}"
                 + (f" (and {len(fqns) - 1} more like it: {name})" if len(fqns) > 1 else "") + f": {reasons}"
                 for (name, shape, reasons), fqns in folded.items()]
        ranks = world_size * replicate_size
        refused = [p for fqn, p in named_params_list if fqn in replicated]
        layouts = [f"dp_shard_size={s} x dp_replicate_size={ranks // s}" for s in _divisors(ranks)
                   if s != world_size and all(shard_dim(p, s)[0] is not None for p in refused)]
        hsdp = (f"; at {ranks} ranks these shard them: {', '.join(layouts)}" if layouts else
                f"; no dp_shard_size x dp_replicate_size layout of {ranks} ranks shards them")
        raise ConfigError(
            f"shard constraints violated over FSDP world size {world_size}"
            + (f" (dp_shard_size={world_size} x dp_replicate_size={replicate_size})" if replicate_size > 1 else "")
            + f": no shard dim keeps these {len(replicated)} parameter(s) (set fsdp_config.fallback_to_unsharded: "
            f"true to keep them replicated, +{plan.replicated_bytes_per_rank() / 2**30:.2f} GiB per rank, or use a "
            f"shard group size that shards them{hsdp}):\n  " + "\n  ".join(lines)
        )
    return plan


def _divisors(n: int) -> list[int]:
    """Shard group sizes of an ``n``-rank job, largest first (1 would replicate everything: left out)."""
    return [s for s in range(n, 1, -1) if n % s == 0]


def _fold(fqn: str) -> str:
    """``model.layers.*.x.weight`` for ``model.layers.7.x.weight``: layer indices folded."""
    return re.sub(r"\.\d+\.", ".*.", fqn)


def _param_bytes(param: torch.Tensor) -> int:
    """Bytes of ``param`` (a quantized weight: all its inner tensors), from metadata only."""
    local = local_tensor(param)
    if isinstance(local, QuantizedWeightTensor):
        return sum(getattr(local, n).numel() * getattr(local, n).element_size() for n in local.inner_field_names())
    return param.numel() * param.element_size()


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

    mesh: a 1D ``DeviceMesh`` (the FSDP group), or the 2-D ``(dp_replicate, dp_shard)`` mesh of
    HSDP (``te_npu.distributed.mesh``): the plan is made for the shard group's size. Returns the
    ``ShardPlan`` (replicated FQNs are kept out of FSDP and get a gradient all-reduce hook over
    every rank of the mesh).
    """
    validate_parallel_config(comm_fusion=comm_fusion)
    plan = plan_shards(model.named_parameters(), shard_size(mesh), fallback_to_unsharded=fallback_to_unsharded,
                       replicate_size=replicate_size(mesh))
    replicated = {model.get_parameter(fqn) for fqn in plan.replicated}
    placement = {id(model.get_parameter(fqn)): Shard(dim) for fqn, dim in plan.dims.items()}
    kwargs = {"mesh": mesh, "shard_placement_fn": lambda param: placement.get(id(param))}
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
        _fully_shard(modules, owned, replicated, reshard, plan.dims, model, kwargs)
        applied.append(tuple(names[id(m)] for m in unit.modules))
    _fully_shard(model, set(model.parameters()), replicated, reshard_after_forward, plan.dims, model, kwargs)
    applied.append(("",))
    plan = ShardPlan(plan.sharded, plan.replicated, tuple(applied), dims=plan.dims, shapes=plan.shapes,
                     nbytes=plan.nbytes, world_size=plan.world_size, replicate_size=plan.replicate_size)
    if not any(p.is_meta for p in replicated):
        average_replicated_gradients(model, plan, mesh)
    return plan


def average_replicated_gradients(model: nn.Module, plan: ShardPlan, mesh) -> None:
    """Give each replicated parameter of ``plan`` a post-accumulate-grad hook averaging its
    gradient over every rank of ``mesh`` (as FSDP2 averages the sharded ones). ``shard_model``
    does it for a materialized model; a model sharded on meta gets new parameter objects from
    ``to_empty`` (the hooks of the meta ones are gone), so call this after ``to_empty``."""
    groups = mesh_groups(mesh)
    for fqn in plan.replicated:
        model.get_parameter(fqn).register_post_accumulate_grad_hook(_average_grad_hook(groups, mesh.size()))


def _fully_shard(modules, owned: set, replicated: set, reshard: bool, dims: Mapping[str, int], model: nn.Module,
                 kwargs: dict) -> None:
    """``fully_shard`` one unit. A unit holding a parameter sharded on dim 1 is built with
    ``reshard_after_forward=False`` and switched to ``True`` after (the same behaviour): with
    ``True`` at construction, torch 2.13's ``FSDPParam`` sizes its unused post-forward shard by
    chunking the whole parameter on dim 0 whatever its placement, which a quantized weight
    whose rows break its blocks (the reason it is sharded on dim 1) cannot do."""
    off_dim0 = {id(model.get_parameter(fqn)) for fqn, dim in dims.items() if dim != 0}
    late_reshard = reshard and any(id(p) in off_dim0 for p in owned - replicated)
    fully_shard(modules, ignored_params=replicated & owned or None, reshard_after_forward=reshard and not late_reshard,
                **kwargs)
    if late_reshard:
        (modules[0] if isinstance(modules, list) else modules).set_reshard_after_forward(True, recurse=False)


def _average_grad_hook(groups: Sequence[dist.ProcessGroup], ranks: int):
    """Average a replicated parameter's gradient over every rank of the mesh (a sum over each mesh
    dim in turn is the sum over the mesh)."""
    def hook(param: torch.Tensor) -> None:
        for group in groups:
            dist.all_reduce(param.grad, group=group)
        param.grad.div_(ranks)

    return hook
