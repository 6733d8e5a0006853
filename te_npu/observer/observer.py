"""``PrecisionObserver``: per-GEMM quantization statistics of a real run, step by step.

    observer = PrecisionObserver(ObserverConfig(enabled=True, freq=10), model)
    for step in range(1, steps + 1):
        with observer.step(step, weights=quantized_weights(optimizer)) as observed:
            with te_npu.autocast(recipe=recipe):
                for micro_batch in batches:
                    model(micro_batch).sum().backward()
        optimizer.step()
        if observed.figures:                       # an observed step
            print(observed.figures.summary())      # worst tensor by SQNR and by underflow
            log(observed.figures.metrics())        # {"precision/<gemm>/<role>.<gemm kind>/<stat>": value}

What it reads. During an observed step it subscribes to ``te_npu.events.OperandEvent``: every
8-bit operand a TE GEMM quantizes (activations, output gradients, high-precision weights) arrives
with the operand the GEMM consumes and its high-precision source (``te_npu.observer.stats``).
A quantized weight (``quantize_weights_`` / ``quantized_model_init``) is read once per observed
step from the stored shards the GEMMs gather, against their FP32 masters
(``weights=quantized_weights(optimizer)``, before the optimizer step): the 8-bit all-gather moves
codes and scales unchanged, so the shards' statistics summed over ranks are the gathered weight's.

Cost. Off, or on a step it does not select, the observer subscribes to nothing: producers pay
``events.has_subscribers`` as always. On a selected step each selected operand costs a decode and
a few reductions on its device (no host sync); layers outside ``layers`` cost one cached pattern
test per event.

Accumulation and reduction. Micro-batches (and a recompute's replayed forward) add into the step.
At ``end_step`` the ranks reduce with ONE collective: an ``all_gather_single`` of one FP64
vector holding every slot's fields (sums and maxima combined on each rank afterwards), then one
host copy. The slots must be the same on every rank, so with more than one rank the observer
needs the model (``attach``): its slots are the model's TE GEMMs that ``layers`` selects, times
the roles, whether or not a rank saw them this step (a MoE layer with no tokens on one rank).
"""
from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from te_npu import events
from te_npu.compat import local_tensor
from te_npu.modules import TEModule
from te_npu.observer.config import ROLE_GEMMS, ROLE_OF, ObserverConfig
from te_npu.observer.stats import SUM_FIELDS, OperandFigures, combine, figures, identity, operand_stats
from te_npu.tensor import QuantizedWeightTensor

__all__ = ["PrecisionObserver", "StepFigures", "ObservedStep", "quantized_weights", "gemm_names"]

_NUM_SUMS = len(SUM_FIELDS)


def gemm_names(model: torch.nn.Module) -> list[str]:
    """The names every TE GEMM of ``model`` reports in its events (after ``assign_fqns``)."""
    names = []
    for module in model.modules():
        if isinstance(module, TEModule):
            weights = module._weight_names
            names += [module.te_name] if weights == ("weight",) else [f"{module.te_name}.{w}" for w in weights]
    return names


def quantized_weights(optimizer) -> Iterator[tuple[str, QuantizedWeightTensor, torch.Tensor]]:
    """``(fqn, local 8-bit shard, local FP32 master shard)`` of every quantized weight a
    ``te_npu.distributed.MasterWeightOptimizer`` keeps (its ``params`` / ``masters``)."""
    for fqn, param in optimizer.params.items():
        shard = local_tensor(param)
        if isinstance(shard, QuantizedWeightTensor):
            yield fqn, shard, local_tensor(optimizer.masters[fqn])


@dataclass(frozen=True)
class StepFigures:
    """One observed step: ``tensors`` maps ``<gemm name>/<role>.<gemm>`` to its figures."""

    step: int
    tensors: Mapping[str, OperandFigures]
    stats: tuple[str, ...]

    def metrics(self, prefix: str = "precision/") -> dict[str, float | None]:
        """Flat ``{prefix<key>/<statistic>: value}`` (an infinite or NaN value is None: JSON-safe)."""
        out = {}
        for key, figs in self.tensors.items():
            for stat, value in figs.as_dict(self.stats).items():
                out[f"{prefix}{key}/{stat}"] = value if math.isfinite(value) else None
        return out

    def worst(self) -> tuple[str | None, str | None]:
        """(key with the lowest SQNR, key with the highest underflow fraction); None when none."""
        finite = {k: f for k, f in self.tensors.items() if not math.isnan(f.sqnr_db)}
        by_sqnr = min(finite, key=lambda k: finite[k].sqnr_db, default=None)
        by_underflow = max(self.tensors, key=lambda k: self.tensors[k].underflow, default=None)
        return by_sqnr, by_underflow

    def summary(self) -> str:
        """One line: ``precision: min SQNR 21.3 dB <key> | max underflow 0.41% <key>``."""
        by_sqnr, by_underflow = self.worst()
        if by_sqnr is None and by_underflow is None:
            return "precision: no operand observed"
        parts = []
        if by_sqnr is not None:
            parts.append(f"min SQNR {self.tensors[by_sqnr].sqnr_db:.1f} dB {by_sqnr}")
        if by_underflow is not None:
            parts.append(f"max underflow {100 * self.tensors[by_underflow].underflow:.2f}% {by_underflow}")
        return "precision: " + " | ".join(parts)


@dataclass
class ObservedStep:
    """What ``PrecisionObserver.step`` yields: ``figures`` is set when the block ends (None when
    the step is not observed)."""

    observing: bool
    figures: StepFigures | None = field(default=None)


class PrecisionObserver:
    """Quantization statistics per TE GEMM, tensor role and observed step (module doc)."""

    def __init__(self, config: ObserverConfig, model: torch.nn.Module | None = None) -> None:
        self.config = config
        self._wanted: dict[str, bool] = {}
        self._slots: tuple[str, ...] | None = None
        self._device = torch.device("cpu")
        self._acc: dict[str, torch.Tensor] = {}
        self._subscription: events.Subscription | None = None
        self._step: int | None = None
        if model is not None:
            self.attach(model)

    # ---- what is observed -------------------------------------------------------------------

    def attach(self, model: torch.nn.Module) -> None:
        """Fix the slots to ``model``'s selected TE GEMMs (needed to reduce over ranks) and the
        device of the reduction to its parameters'."""
        names = [n for n in gemm_names(model) if self._wants(n)]
        self._slots = tuple(f"{n}/{role}.{gemm}" for n in names for role in self.config.roles
                            for gemm in ROLE_GEMMS[role])
        param = next(iter(model.parameters()), None)
        if param is not None and param.device.type != "meta":
            self._device = param.device

    def _wants(self, name: str) -> bool:
        hit = self._wanted.get(name)
        if hit is None:
            hit = self._wanted[name] = any(fnmatch.fnmatchcase(name, p) for p in self.config.layers)
        return hit

    @property
    def observing(self) -> bool:
        """Whether a step is being observed now (between ``begin_step`` and ``end_step``)."""
        return self._subscription is not None

    # ---- one step ---------------------------------------------------------------------------

    def begin_step(self, step: int, *,
                   weights: Iterable[tuple[str, QuantizedWeightTensor, torch.Tensor]] | None = None) -> bool:
        """Start observing ``step`` if the config selects it (returns whether it does); ``weights``:
        the quantized weights the step's GEMMs will read, with their masters (:func:`quantized_weights`)."""
        if self._subscription is not None:
            raise RuntimeError(f"PrecisionObserver: step {self._step} is still being observed (end_step first)")
        if not self.config.selects(step):
            return False
        self._step, self._acc = step, {}
        self._subscription = events.subscribe(self._on_operand, events.OperandEvent)
        if weights is not None and "weight" in self.config.roles:
            self._observe_weights(weights)
        return True

    def end_step(self, group: dist.ProcessGroup | None = None) -> StepFigures | None:
        """Stop observing; reduce over ``group``'s ranks (one collective) and return the step's
        figures (None when no step was being observed)."""
        if self._subscription is None:
            return None
        self._subscription.close()
        self._subscription = None
        keys = self._slots if self._slots is not None else tuple(sorted(self._acc))
        unknown = sorted(set(self._acc) - set(keys))
        if unknown:
            raise RuntimeError(f"PrecisionObserver: {unknown[0]} is not a TE GEMM of the attached model")
        device = next(iter(self._acc.values())).device if self._acc else self._device
        stacked = torch.stack([self._acc[k] if k in self._acc else identity(device) for k in keys]) \
            if keys else identity(device)[None]
        stacked = _reduce_over_ranks(stacked, group, attached=self._slots is not None)
        host = stacked.cpu()
        tensors = {k: figures(row) for k, row in zip(keys, host) if row[0] > 0}
        self._acc = {}
        return StepFigures(self._step, tensors, self.config.stats)

    def abort_step(self) -> None:
        """Stop observing without reducing (an exception left the step; no collective is run)."""
        if self._subscription is not None:
            self._subscription.close()
        self._subscription, self._acc = None, {}

    @contextlib.contextmanager
    def step(self, step: int, *, weights=None, group: dist.ProcessGroup | None = None) -> Iterator[ObservedStep]:
        """``begin_step`` / ``end_step`` around a block; the yielded object gets the figures."""
        handle = ObservedStep(self.begin_step(step, weights=weights))
        try:
            yield handle
        except BaseException:
            self.abort_step()
            raise
        handle.figures = self.end_step(group)

    # ---- inputs -----------------------------------------------------------------------------

    def _add(self, key: str, fields: torch.Tensor) -> None:
        have = self._acc.get(key)
        self._acc[key] = fields if have is None else combine(have, fields)

    def _on_operand(self, event: events.OperandEvent) -> None:
        if event.operand is None or event.gemm is None or not self._wants(event.module):
            return
        role = ROLE_OF[event.role]
        if role in self.config.roles:
            self._add(f"{event.module}/{role}.{event.gemm}", operand_stats(event.operand, event.source))

    def _observe_weights(self, weights: Iterable[tuple[str, QuantizedWeightTensor, torch.Tensor]]) -> None:
        for fqn, shard, master in weights:
            name = fqn.removesuffix(".weight")
            if not self._wants(name) or shard.numel() == 0:
                continue
            for orientation, gemm in (("row", "fprop"), ("col", "dgrad")):
                self._add(f"{name}/weight.{gemm}", operand_stats(shard.select(orientation), master))


def _reduce_over_ranks(stacked: torch.Tensor, group, *, attached: bool) -> torch.Tensor:
    """``[slots, fields]`` combined over the ranks of ``group`` with one ``all_gather_single``."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return stacked
    if not attached:
        raise RuntimeError("PrecisionObserver: reducing over ranks needs the same slots on every rank; "
                           "attach(model) first (PrecisionObserver(config, model))")
    world = dist.get_world_size(group)
    gathered = stacked.new_empty((world, stacked.numel()))
    dist.all_gather_single(gathered.view(-1), stacked.reshape(-1).contiguous(), group=group)
    per_rank = gathered.view(world, *stacked.shape)
    return torch.cat([per_rank[..., :_NUM_SUMS].sum(0), per_rank[..., _NUM_SUMS:].amax(0)], dim=-1)

