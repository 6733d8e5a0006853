"""FP32 master weights, AdamW, and the refresh of 8-bit weight shards.

Training state per parameter:

    FP32 master shard          the authoritative weight; AdamW updates it
    FP32 exp_avg / exp_avg_sq  torch.optim.AdamW state over the masters
    param (shard)              8-bit MXFP8Tensor / HiF8Tensor for TE weights, else BF16/FP32;
                               derived from the master after every successful step

Hand-over of the high-precision initial values (a master is never built from 8-bit data):

    model = build()                                        # BF16, initialised
    init = finalize_low_precision_weights(model, recipe)   # fqn -> BF16 [N, K] / [E, N, K]
    shard_model(model, mesh, ...)                          # FSDP2 (params become DTensors)
    opt = MasterWeightOptimizer(model, init, lr=...)       # shards ``init`` like each param
    del init                                               # the only full copies are dropped

The optimizer shards each initial value with the parameter's own mesh and placements
(``distribute_tensor(..., src_data_rank=None)``: every rank slices its own identical copy, no
communication) and keeps only the local FP32 shard.

Shard first (the trainer's order: nothing full-size on any rank, no random values that a load
would overwrite):

    with torch.device("meta"): model = build()
    quantize_weights_(model, recipe)                        # meta 8-bit weights, no values
    shard_model(model, mesh, ...); model.to_empty(device=d) # each rank allocates its shards only
    opt = MasterWeightOptimizer.for_sharded_init(model, lr=...)   # masters allocated, not written
    opt.initialize_masters_(value_of)                       # value_of(fqn): the full initial value;
                                                            # each rank keeps its region, refreshes
    # or: checkpoint.load(...) / hf_checkpoint loads write the masters, then rebuild

Step: FSDP reduce-scatter -> ``param.grad`` (BF16 shard) -> global grad norm from those shards
in FP32 (one all-reduce) -> non-finite anywhere: skip (nothing updated, nothing refreshed) ->
AdamW on the masters in bounded chunks: each chunk's gradients cast to FP32 ``master.grad``
(and clipped) only while its update runs, at most the largest parameter's FP32 gradient at a
time -> refresh every 8-bit shard once (``refresh_low_precision_weights``) and copy
high-precision params from their masters. The update is the one AdamW step over all
parameters would make, bit for bit (AdamW updates each tensor on its own).
``zero_grad``, micro-batches and activation recompute never refresh.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from te_npu import events
from te_npu.compat import local_shape_and_global_offset, local_tensor
from te_npu.distributed.mesh import dtensor_shard_group
from te_npu.quantize_weights import quantize_weights_
from te_npu.tensor import QuantizedWeightTensor

__all__ = [
    "StepResult",
    "MasterWeightOptimizer",
    "finalize_low_precision_weights",
    "refresh_low_precision_weights",
    "global_grad_norm",
]

@dataclass(frozen=True)
class StepResult:
    """Outcome of ``MasterWeightOptimizer.step``: ``updated`` is False for a skipped step."""

    updated: bool
    grad_norm: float

    @property
    def skipped(self) -> bool:
        return not self.updated

    def __bool__(self) -> bool:
        return self.updated


def finalize_low_precision_weights(model: nn.Module, recipe) -> dict[str, torch.Tensor]:
    """Quantize every TE weight (``te_npu.quantize_weights_``); return ``{fqn: w}``, the BF16 values.

    Call after initialisation and before ``shard_model``; keep the returned dict only until
    ``MasterWeightOptimizer`` is built from it (it is the masters' only legitimate source).
    """
    before: dict[str, torch.Tensor] = {}
    for fqn, param in model.named_parameters():
        if isinstance(param, QuantizedWeightTensor):
            raise ValueError(f"finalize_low_precision_weights: {fqn} is already quantized")
        before[fqn] = param.detach()
    quantize_weights_(model, recipe)
    # the values of exactly the parameters that became 8-bit (the TE weights)
    return {fqn: before[fqn] for fqn, param in model.named_parameters() if isinstance(param, QuantizedWeightTensor)}


def refresh_low_precision_weights(
    params: Iterable[torch.Tensor],
    master_params: Iterable[torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    on_refresh: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """Re-quantize each 8-bit weight shard in place from its FP32 master shard.

    params: ``QuantizedWeightTensor`` parameters (or DTensors over them); master_params: the
    matching FP32 shards, same shapes. Each weight refreshes itself
    (``QuantizedWeightTensor.refresh_from_master``). A format whose scale spans the whole weight
    (HiF8 dense: every rank quantizes its rows with the full weight's scale -- identical to
    quantizing the full weight) gives its shard's part (``shared_scale_amax``); those amaxes are
    MAX-reduced over ``group`` (default: each parameter's FSDP shard group -- under HSDP the
    replicas hold identical masters, so their max is the shard group's; none for an unsharded
    parameter) in one all-reduce per group, stacked in ``params`` order (which must be the same
    on every rank); MXFP8 blocks and HiF8 per-expert scales stay local.

    Route (both backends compute the same numbers by construction): the FP32 master is
    quantized as FP32, never rounded to BF16 first. On the NPU that means the kernels that take
    FP32 -- MXFP8: two single-axis ``npu_dynamic_mx_quant`` calls (the dual-axis kernel takes
    FP16 / BF16 only); HiF8: an FP32 amax (torch) and one ``npu_quantize`` with an FP32 scale
    (``[E]`` along axis 0 for experts: no per-expert loop; ``npu_dynamic_quant`` takes FP16 /
    BF16 only). The emulation quantizes the same FP32 values with the same arithmetic.
    """
    pairs = []
    for param, master in zip(params, master_params, strict=True):
        shard, master_shard = local_tensor(param), local_tensor(master)
        if not isinstance(shard, QuantizedWeightTensor):
            raise TypeError(f"refresh_low_precision_weights: expected a quantized weight, got {type(shard).__name__}")
        pairs.append((param, shard, master_shard))
    shared = _shared_amaxes(pairs, group)
    for i, (param, shard, master_shard) in enumerate(pairs):
        shard.refresh_from_master(master_shard, amax=shared.get(i))
        if on_refresh is not None:
            on_refresh(param)


def _shared_amaxes(pairs, group) -> dict[int, torch.Tensor]:
    """Index -> the whole weight's amax, for each shard with a shared scale on a group of more
    than one rank: one stacked MAX all-reduce per group (a single one under FSDP2's one mesh)."""
    by_group: dict = {}
    for i, (param, shard, master_shard) in enumerate(pairs):
        amax_group = group if group is not None else _mesh_group(param)
        if amax_group is None or dist.get_world_size(amax_group) == 1:
            continue
        local = shard.shared_scale_amax(master_shard)
        if local is not None:
            by_group.setdefault(amax_group, []).append((i, local))
    out = {}
    for amax_group, items in by_group.items():
        stacked = torch.stack([local.reshape(()) for _, local in items])
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=amax_group)
        out.update({i: stacked[k] for k, (i, _) in enumerate(items)})
    return out


def global_grad_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """FP32 L2 norm over all gradients and all ranks (DTensor-aware; NaN/Inf propagate).

    Sharded DTensor gradients contribute their local squares, summed over their shard group
    with one all-reduce (HSDP: every replica holds the same reduced shards, so each shard counts
    once and every rank gets the same norm); replicated and plain tensors (already equal on every
    rank) count once.
    """
    sharded, replicated, group = torch.zeros((), dtype=torch.float32), torch.zeros((), dtype=torch.float32), None
    for grad in grads:
        local = local_tensor(grad).float()
        squares = local.pow(2).sum().cpu()
        if isinstance(grad, DTensor) and any(isinstance(p, Shard) for p in grad.placements):
            sharded += squares
            group = dtensor_shard_group(grad)
        else:
            replicated += squares
    if group is not None and dist.get_world_size(group) > 1:
        device = _collective_device(group)
        sharded = sharded.to(device)
        dist.all_reduce(sharded, group=group)
        sharded = sharded.cpu()
    return (sharded + replicated).sqrt()


class MasterWeightOptimizer:
    """AdamW over FP32 master shards of a model's parameters, refreshing 8-bit weights after each step.

    model: the (optionally FSDP2-sharded) model; initial_weights: ``{fqn: high-precision
    full weight}`` for every quantized parameter (from ``finalize_low_precision_weights``);
    max_grad_norm: clip by global norm when given. ``refresh_counts[fqn]`` counts refreshes.
    Reports to ``te_npu.events``: a ``WeightRefreshEvent(fqn)`` per refresh and an
    ``OptimizerStepEvent(updated, grad_norm)`` per ``step`` (skipped steps included).

    Weight decay, as in Megatron-LM, applies to matrices only: parameters with fewer than two
    (logical) dims -- biases, norm weights -- are in a second param group with decay 0.
    ``no_decay`` lists their FQNs.
    """

    def __init__(
        self,
        model: nn.Module,
        initial_weights: Mapping[str, torch.Tensor] | None = None,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        max_grad_norm: float | None = None,
        _unwritten: bool = False,
    ) -> None:
        initial_weights = initial_weights or {}
        self.max_grad_norm = max_grad_norm
        self.params: dict[str, torch.Tensor] = {
            fqn: p for fqn, p in model.named_parameters() if p.requires_grad
        }
        make = _empty_master if _unwritten else _make_master
        self.masters: dict[str, torch.Tensor] = {
            fqn: make(fqn, p, initial_weights.get(fqn)) for fqn, p in self.params.items()
        }
        self._masters_written = not _unwritten
        self.no_decay: tuple[str, ...] = tuple(fqn for fqn, p in self.params.items() if p.dim() < 2)
        groups = [
            {"params": [m for fqn, m in self.masters.items() if fqn not in self.no_decay], "weight_decay": weight_decay},
            {"params": [self.masters[fqn] for fqn in self.no_decay], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps, foreach=False
        )
        for master in self.masters.values():  # eager state: DCP loads into existing tensors
            self.optimizer.state[master].update(
                step=torch.zeros((), dtype=torch.float32),
                exp_avg=torch.zeros_like(master),
                exp_avg_sq=torch.zeros_like(master),
            )
        self.refresh_counts: Counter[str] = Counter()
        self._fqn_of = {id(p): fqn for fqn, p in self.params.items()}

    @classmethod
    def for_sharded_init(cls, model: nn.Module, **hyperparameters) -> "MasterWeightOptimizer":
        """An optimizer whose FP32 masters are allocated like each parameter's local shard but
        not written (moments zero): for a model built on meta, sharded and ``to_empty``-ed, whose
        values come next from :meth:`initialize_masters_` or a checkpoint load (DCP resume, HF
        initial load), which then rebuild the 8-bit shards. ``step`` refuses until then."""
        return cls(model, None, _unwritten=True, **hyperparameters)

    @torch.no_grad()
    def initialize_masters_(self, value_of: Callable[[str], torch.Tensor]) -> None:
        """Write every master from ``value_of(fqn)``: the parameter's full initial value (any
        device, FP32 or the parameter's dtype; rounded to the parameter's dtype first, as a
        parameter initialised in place would be), of which each rank keeps only its own region.
        Then refresh every 8-bit shard and copy every high-precision parameter from its master.

        The result does not depend on the world size: every rank cuts its region out of the same
        full value (one parameter's full value in memory at a time)."""
        for fqn, master in self.masters.items():
            full = value_of(fqn)
            param = self.params[fqn]
            if list(full.shape) != list(param.shape):
                raise ValueError(f"initialize_masters_: value of {fqn!r} has shape {list(full.shape)}, param "
                                 f"{list(param.shape)}")
            region = _local_region(full, master)
            local_tensor(master).copy_(region.to(param.dtype))
            del full, region
        self.rebuild_weights_from_masters()

    # ---- public ---------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Drop the parameters' gradients (never touches weights)."""
        for param in self.params.values():
            param.grad = None

    def step(self) -> StepResult:
        """One update from the accumulated gradients; skipped (nothing changes) if any is non-finite.

        Peak memory: the FP32 gradients of one chunk of masters at a time (consecutive masters
        whose FP32 gradients together fit the largest one's), not a second copy of every gradient.
        """
        if not self._masters_written:
            raise RuntimeError("MasterWeightOptimizer.step: the masters were never written (an optimizer from "
                               "for_sharded_init needs initialize_masters_ or a checkpoint load first)")
        present = [(fqn, self.params[fqn].grad) for fqn in self.masters if self.params[fqn].grad is not None]
        norm = global_grad_norm(grad for _, grad in present)
        if not bool(torch.isfinite(norm)):
            self._drop_master_grads()
            return self._result(updated=False, grad_norm=float(norm))
        coef = None if self.max_grad_norm is None else torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        for chunk in _bounded_chunks(present, self._fp32_grad_budget()):
            for fqn, grad in chunk:
                master_grad = grad.detach().to(torch.float32)
                if coef is not None:
                    master_grad.mul_(coef.to(local_tensor(master_grad).device))
                self.masters[fqn].grad = master_grad
            self.optimizer.step()  # AdamW updates only the masters holding a gradient
            self._drop_master_grads()
        self.rebuild_weights_from_masters()
        return self._result(updated=True, grad_norm=float(norm))

    def _fp32_grad_budget(self) -> int:
        """Bytes of the largest master's local FP32 gradient: the most one chunk of ``step`` casts."""
        return max((local_tensor(m).numel() * 4 for m in self.masters.values()), default=0)

    @torch.no_grad()
    def rebuild_weights_from_masters(self) -> None:
        """Refresh every 8-bit shard once and copy high-precision params from their masters (call
        after writing every master, e.g. a checkpoint load: the masters count as written)."""
        self._masters_written = True
        quantized = [fqn for fqn, p in self.params.items() if isinstance(local_tensor(p), QuantizedWeightTensor)]
        refresh_low_precision_weights(
            [self.params[f] for f in quantized], [self.masters[f] for f in quantized], on_refresh=self._count
        )
        for fqn, param in self.params.items():
            if fqn not in quantized:
                local_tensor(param).copy_(local_tensor(self.masters[fqn]).to(param.dtype))

    def state_for(self, fqn: str) -> dict[str, torch.Tensor]:
        """``{master, exp_avg, exp_avg_sq, step}`` of one parameter (live tensors)."""
        master = self.masters[fqn]
        state = self.optimizer.state[master]
        return {"master": master, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"], "step": state["step"]}

    # ---- internals ------------------------------------------------------------------------------

    def _count(self, param: torch.Tensor) -> None:
        fqn = self._fqn_of[id(param)]
        self.refresh_counts[fqn] += 1
        if events.has_subscribers(events.WeightRefreshEvent):
            events.emit(events.WeightRefreshEvent(fqn))

    @staticmethod
    def _result(*, updated: bool, grad_norm: float) -> StepResult:
        if events.has_subscribers(events.OptimizerStepEvent):
            events.emit(events.OptimizerStepEvent(updated, grad_norm))
        return StepResult(updated=updated, grad_norm=grad_norm)

    def _drop_master_grads(self) -> None:
        for master in self.masters.values():
            master.grad = None


def _make_master(fqn: str, param: torch.Tensor, initial: torch.Tensor | None) -> torch.Tensor:
    """FP32 master shard laid out like ``param`` (DTensor with its placements, or plain)."""
    if not isinstance(local_tensor(param), QuantizedWeightTensor):
        return param.detach().to(torch.float32, copy=True)
    if initial is None:
        raise ValueError(
            f"MasterWeightOptimizer: no high-precision initial value for quantized parameter {fqn!r}; pass the "
            "dict returned by finalize_low_precision_weights (a master is never built from 8-bit data)"
        )
    if list(initial.shape) != list(param.shape):
        raise ValueError(f"MasterWeightOptimizer: initial value of {fqn!r} has shape {list(initial.shape)}, param {list(param.shape)}")
    full = initial.detach().to(device=local_tensor(param).device, dtype=torch.float32)
    if not isinstance(param, DTensor):
        return full.clone()
    sharded = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return DTensor.from_local(
        sharded.to_local().clone(), param.device_mesh, param.placements, run_check=False,
        shape=param.shape, stride=param.stride(),
    )


def _empty_master(fqn: str, param: torch.Tensor, initial: torch.Tensor | None) -> torch.Tensor:
    """An unwritten FP32 tensor laid out like ``param``'s local shard (DTensor with its
    placements, or plain); ``initial`` must be None (values come later)."""
    if initial is not None:
        raise ValueError(f"MasterWeightOptimizer.for_sharded_init: {fqn!r} got an initial value; use the constructor")
    shard = local_tensor(param)
    local = torch.empty(shard.shape, dtype=torch.float32, device=shard.device)
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _local_region(full: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """The part of the full tensor ``full`` that ``master``'s local shard holds, on its device."""
    shard = local_tensor(master)
    if isinstance(master, DTensor):
        shape, offset = local_shape_and_global_offset(master.shape, master.device_mesh, master.placements)
        for dim, (start, length) in enumerate(zip(offset, shape)):
            full = full.narrow(dim, start, length)
    return full.to(shard.device)


def _bounded_chunks(items: list, budget_bytes: int):
    """Consecutive runs of ``(fqn, grad)`` whose FP32 sizes sum to at most ``budget_bytes``
    (a single larger one alone)."""
    chunk, size = [], 0
    for fqn, grad in items:
        nbytes = local_tensor(grad).numel() * 4
        if chunk and size + nbytes > budget_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((fqn, grad))
        size += nbytes
    if chunk:
        yield chunk


def _mesh_group(param: torch.Tensor):
    return dtensor_shard_group(param) if isinstance(param, DTensor) else None


def _collective_device(group) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cpu") if backend == "gloo" else torch.device(torch.accelerator.current_accelerator() or "cpu")
