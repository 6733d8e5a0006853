"""Capacity estimate: the real ``Trainer.setup`` and one optimizer step on fake tensors, per rank.

As torchtitan's memory estimation does, the run happens here, on the CPU, with
``FakeTensorMode`` (tensors with shapes, dtypes and devices but no memory) and torch's fake
process group (this process plays rank 0 of ``world_size``; collectives move nothing), so a
16B recipe for 8 NPUs sets up in a minute on a laptop and allocates nothing. Everything is the
production code: the config checks, the meta build, the shard plan and FSDP2 units, the 8-bit
weights, the masters and moments, the initial values, then ``forward_backward`` for each
micro-batch (the recipe's micro batch, sequence length and accumulation, or ``micro_batches``)
and ``optimizer_step``. ``te_npu.training.capacity.memory_tracker.MemoryTracker`` counts the bytes of
every storage by stage and category.

What runs differently, and why:

- the device is the CPU (the recipe's ``npu`` needs torch_npu); the quantizations and GEMMs
  run te_npu's emulation, each call marked as one kernel: its decoded operands and
  intermediates are the emulation's, so only what a call returns counts (what a vendor
  kernel allocates); the emulation's own peak is reported beside it;
- the data is this interpreter's standard library (``data.kind: stdlib``; only token ids
  enter the model, so the corpus does not change a byte);
- checkpoints, logs, plots and TensorBoard go to a scratch folder, nothing is resumed or loaded;
- routing is balanced (``te_npu.moe.permute`` on tensors without data), a host read of a flag
  answers True (finite gradients, equal scales) and of a number 1.0.

Not modelled: allocator fragmentation and caching, HCCL / communication buffers and
workspaces, kernel workspaces, routing imbalance (a hot expert's rows), the CANN runtime and
framework reserve; these are why the fit verdict keeps a margin (``FIT_MARGIN``).

``measure=True`` runs the same sequence on real CPU tensors (still rank 0 of a fake group:
collectives move nothing, so every all-gather repeats this rank's shard) and reads the
process's peak RSS per stage from Linux (``/proc/self/status`` ``VmHWM``, reset per stage
through ``/proc/self/clear_refs``): an independent measurement of what the estimate's
emulation account says this CPU run holds.

The capacity room of ``te_npu.training``: the estimate (this module, the package's entry, which
``scripts/estimate_memory.py`` runs) and the memory tracker it counts with (``memory_tracker``).
It sits above the Trainer it runs.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from te_npu import compat, events
from te_npu.compat import local_tensor
from te_npu.errors import ConfigError
from te_npu.ops import emulation, force_backend
from te_npu.tensor import QuantizedWeightTensor
from te_npu.training.config import TrainConfig
from te_npu.training.metrics.host_rss import reset_peak_rss, status_bytes
from te_npu.training.capacity.memory_tracker import CATEGORIES, MemoryTracker, StageMemory

__all__ = ["ASCEND_950DT_HBM_GB", "A5_Q3_HBM_BYTES", "default_hbm_bytes", "FIT_MARGIN", "CapacityReport", "estimation_overrides", "estimate"]

ASCEND_950DT_HBM_GB = 144
"""HBM of one Ascend 950DT (HiZQ 2.0, 144 GB, 4 TB/s): Eric Xu's keynote at Huawei Connect 2025,
Shanghai, 2025-09-18 ("Groundbreaking SuperPoD Interconnect"), the 950 series roadmap slide
(950PR: 128 GB HiBL 1.0 at 1.6 TB/s). Read as 144 * 10**9 bytes, the smaller reading."""

A5_Q3_HBM_BYTES = 96 * 2**30
"""HBM per card of the acceptance machine (docs/a5.md: one node of 8 Ascend A5, 96 GiB each):
the default verdict of ``scripts/estimate_memory.py`` away from an NPU."""


def default_hbm_bytes() -> tuple[int, str]:
    """(HBM bytes per device, where the figure came from): the visible NPU's total memory
    (``torch.npu.get_device_properties(i).total_memory``) when torch_npu and a device are present,
    else the acceptance machine's A5 (:data:`A5_Q3_HBM_BYTES`). Imports torch_npu only when called."""
    try:
        importlib.import_module("torch_npu")
        npu = torch.npu
        if npu.device_count() > 0:
            props = npu.get_device_properties(npu.current_device())
            return int(props.total_memory), f"this NPU ({props.name}: total_memory)"
    except Exception:  # noqa: BLE001 - no torch_npu / no device: the acceptance machine's figure
        pass
    return A5_Q3_HBM_BYTES, "the acceptance machine's Ascend A5, 96 GiB per card (docs/a5.md)"


FIT_MARGIN = 0.90
"""A recipe fits when its peak is at most this share of the HBM: the rest is for what the
estimate does not model (module doc)."""


@dataclass
class CapacityReport:
    """Per-rank bytes of one estimated run (rank 0 of ``world_size``; HSDP: ``replicate_size``
    replicas of a ``world_size // replicate_size``-rank shard group)."""

    config: str
    world_size: int
    micro_batches: int
    tokens_per_micro_batch: int
    hbm_bytes: int
    stages: list[StageMemory]
    resting_bytes: int
    resting_by_category: dict[str, int]
    replicated_params: dict[str, str]
    replicated_bytes: int
    plan: str
    setup_stage_names: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)
    measured_rss_bytes: dict[str, int] | None = None  # measure=True: stage -> peak RSS above the start
    replicate_size: int = 1
    # (a micro-batch's forward and backward are one reading, under the backward stage's name)

    @property
    def setup_peak_bytes(self) -> int:
        return max((s.peak_bytes for s in self.stages if s.name in self.setup_stage_names), default=0)

    @property
    def step_peak_bytes(self) -> int:
        return max((s.peak_bytes for s in self.stages if s.name not in self.setup_stage_names), default=0)

    @property
    def peak_bytes(self) -> int:
        return max(self.setup_peak_bytes, self.step_peak_bytes)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= FIT_MARGIN * self.hbm_bytes

    def as_dict(self) -> dict:
        """The JSON report (``scripts/estimate_memory.py --json``)."""
        return {
            "config": self.config,
            "world_size": self.world_size,
            "replicate_size": self.replicate_size,
            "micro_batches": self.micro_batches,
            "tokens_per_micro_batch": self.tokens_per_micro_batch,
            "hbm_bytes": self.hbm_bytes,
            "fit_margin": FIT_MARGIN,
            "fits": self.fits,
            "setup_peak_bytes": self.setup_peak_bytes,
            "step_peak_bytes": self.step_peak_bytes,
            "resting_bytes": self.resting_bytes,
            "resting_by_category": {c: self.resting_by_category.get(c, 0) for c in CATEGORIES},
            "replicated_params": self.replicated_params,
            "replicated_bytes": self.replicated_bytes,
            "plan": self.plan,
            "stages": [s.as_dict() for s in self.stages],
            "notes": self.notes,
            "measured_rss_bytes": self.measured_rss_bytes,
        }

    def render(self) -> str:
        """The table ``scripts/estimate_memory.py`` prints (GiB per rank; MiB below 1 GiB)."""
        gib, unit = (2 ** 30, "GiB") if self.peak_bytes >= 2 ** 30 else (2 ** 20, "MiB")
        layout = (f" (dp_shard_size {self.world_size // self.replicate_size} x dp_replicate_size "
                  f"{self.replicate_size})" if self.replicate_size > 1 else "")
        lines = [f"{self.config}: rank 0 of {self.world_size}{layout}, {self.micro_batches} micro-batch(es) of "
                 f"{self.tokens_per_micro_batch} tokens", self.plan, ""]
        header = (f"{'stage':<34}{'peak ' + unit:>10}{'end ' + unit:>10}{'emul. ' + unit:>11}"
                  "  largest categories at the peak")
        lines.append(header)
        lines.append("-" * len(header))
        for s in self.stages[1:]:
            top = sorted(s.peak_by_category.items(), key=lambda kv: -kv[1])[:3]
            cats = ", ".join(f"{c} {b / gib:.2f}" for c, b in top if b > 0)
            measured = ""
            if self.measured_rss_bytes is not None and s.name in self.measured_rss_bytes:
                measured = f"  [measured RSS {self.measured_rss_bytes[s.name] / gib:.2f}]"
            lines.append(f"{s.name:<34}{s.peak_bytes / gib:>10.2f}{s.end_bytes / gib:>10.2f}"
                         f"{s.emulation_peak_bytes / gib:>11.2f}  {cats}{measured}")
        lines.append("")
        lines.append(f"resting after setup ({unit}): " + ", ".join(
            f"{c} {self.resting_by_category.get(c, 0) / gib:.2f}" for c in CATEGORIES if self.resting_by_category.get(c)))
        hbm = self.hbm_bytes / 1e9
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"setup peak {self.setup_peak_bytes / gib:.2f} {unit}, step peak {self.step_peak_bytes / gib:.2f} "
                     f"{unit}, resting {self.resting_bytes / gib:.2f} {unit}; HBM {self.hbm_bytes / 2**30:.1f} GiB "
                     f"({hbm:.0f} GB): {verdict} "
                     f"(peak {self.peak_bytes / self.hbm_bytes:.1%} of HBM, limit {FIT_MARGIN:.0%})")
        if self.replicated_params:
            lines.append(f"replicated: {len(self.replicated_params)} parameter(s), "
                         f"{self.replicated_bytes / gib:.2f} {unit} on every rank")
        lines.extend(self.notes)
        return "\n".join(lines)


def estimation_overrides(world_size: int, workdir: str, replicate_size: int = 1) -> list[str]:
    """Dotted config overrides that make a recipe run here on fake tensors (module doc): the CPU,
    the stdlib corpus, scratch outputs, nothing resumed or loaded, the eager quantization kernels
    (the native ones have no fake-tensor implementation), FSDP2 over ``world_size`` ranks (HSDP:
    ``replicate_size`` replicas of ``world_size // replicate_size``-rank shard groups; a
    ``ConfigError`` naming both keys when it does not divide)."""
    if replicate_size < 1 or world_size % replicate_size:
        raise ConfigError(f"fsdp_config.dp_replicate_size: {replicate_size} does not divide the world size "
                          f"{world_size} (fsdp_config.dp_shard_size x fsdp_config.dp_replicate_size = world size)")
    return [
        "training.device=cpu", "training.backend=gloo", "training.quant_kernel=eager",
        f"fsdp_config.dp_shard_size={world_size // replicate_size}", f"fsdp_config.dp_replicate_size={replicate_size}",
        "data.kind=stdlib", "data.path=null", "data.val_path=null",
        f"logging.dir={workdir}/logs", "logging.tensorboard=false", "logging.plot=false",
        f"checkpoint.dir={workdir}/checkpoints", "checkpoint.resume=false", "checkpoint.initial_load_path=null",
        "checkpoint.last_save_format=dcp",
    ]


class _KernelAccountedEmulation:
    """The emulation backend with every call marked as one kernel for the tracker (module doc)."""

    def __init__(self, tracker: MemoryTracker) -> None:
        self._tracker = tracker
        self.NAME, self.SCALE_LAYOUT = emulation.NAME, emulation.SCALE_LAYOUT

    def __getattr__(self, name: str):
        function = getattr(emulation, name)
        if not callable(function):
            return function

        def call(*args, **kwargs):
            with self._tracker.kernel():
                return function(*args, **kwargs)

        return call


def estimate(cfg: TrainConfig, task, *, world_size: int, micro_batches: int | None = None,
             hbm_bytes: int = ASCEND_950DT_HBM_GB * 10**9, config_name: str = "", measure: bool = False,
             print_fn: Callable[[str], None] = lambda line: None) -> CapacityReport:
    """Set up ``cfg`` (already carrying ``estimation_overrides``) on fake tensors as rank 0 of
    ``world_size`` and run one optimizer step of ``micro_batches`` micro-batches (default: the
    recipe's accumulation); returns the per-rank bytes. ``measure``: real CPU tensors instead,
    with each stage's peak RSS read from Linux (module doc). Initialises the fake process group
    (and destroys it at the end)."""
    from te_npu.training.trainer import Trainer

    if dist.is_initialized():
        raise RuntimeError("capacity.estimate: a process group exists already; the estimate plays rank 0 on a fake one")
    t = cfg.training
    micro_batches = micro_batches or t.gradient_accumulation_steps
    tracker = MemoryTracker()
    fake = contextlib.nullcontext() if measure else compat.fake_tensor_mode()
    backend = _KernelAccountedEmulation(tracker)
    setup_stages: list[str] = []
    rss = _StageRss() if measure else None
    trainer = None

    @contextlib.contextmanager
    def fake_tensors():
        with fake, tracker, force_backend(backend), _quiet_fake_tensor_log():
            yield

    def start_stage(name: str, rss_name: str | None = None, **kwargs) -> None:
        if rss is not None:
            rss.start(rss_name or name)
        tracker.start_stage(name, **kwargs)

    def on_event(event) -> None:
        if isinstance(event, events.SetupStepEvent):
            if trainer is not None:
                _label_state(tracker, trainer)
            start_stage(f"setup: {event.name}", exact=True)
            setup_stages.append(f"setup: {event.name}")

    compat.init_fake_process_group(0, world_size)
    try:
        trainer = Trainer(task, print_fn=print_fn, subscribers=[on_event], allocation_context=fake_tensors)
        trainer.setup(cfg)
        _label_state(tracker, trainer)
        resting, resting_by_category = tracker.device_bytes, {c: tracker.totals.get(c, 0) for c in CATEGORIES}
        tokens = t.micro_batch_size * t.seq_len
        with fake_tensors():
            for i in range(micro_batches):
                # forward and backward are one call: the tracker opens the backward stage itself
                # when autograd starts, so the RSS of a micro-batch is read for the whole of it
                start_stage(f"micro-batch {i + 1} forward", f"micro-batch {i + 1} backward", step=True,
                            backward=f"micro-batch {i + 1} backward")
                trainer.forward_backward(next(trainer.batcher), 1.0 / micro_batches)
                tracker.label([p.grad for p in trainer.model.parameters()], "gradients")
            start_stage("optimizer step")
            trainer.optimizer_step()
            start_stage("after the step")
        if rss is not None:
            rss.finish()
        plan = trainer.shard_plan
        report = CapacityReport(
            config=config_name, world_size=world_size, micro_batches=micro_batches, tokens_per_micro_batch=tokens,
            hbm_bytes=hbm_bytes, stages=tracker.stages, resting_bytes=resting, resting_by_category=resting_by_category,
            replicated_params=dict(plan.replicated) if plan else {},
            replicated_bytes=plan.replicated_bytes_per_rank() if plan else 0,
            plan=plan.describe() if plan else "one rank: nothing sharded", setup_stage_names=tuple(setup_stages),
            measured_rss_bytes=rss.peaks if rss is not None else None,
            replicate_size=cfg.fsdp_config.dp_replicate_size,
        )
        trainer.abandon()
        return report
    finally:
        if trainer is not None:
            trainer.abandon()
        dist.destroy_process_group()


class _StageRss:
    """Peak RSS of this process per stage, above its RSS when the first stage began (Linux:
    ``VmHWM`` of ``/proc/self/status``, reset at each stage by writing 5 to ``/proc/self/clear_refs``)."""

    def __init__(self) -> None:
        if not os.path.exists("/proc/self/clear_refs"):
            raise RuntimeError("capacity.estimate(measure=True) reads peak RSS from Linux's /proc; not available here")
        self.base = _required("VmRSS")
        self.peaks: dict[str, int] = {}
        self._stage: str | None = None

    def start(self, name: str) -> None:
        self._close()
        if not reset_peak_rss():
            raise RuntimeError("capacity.estimate(measure=True): /proc/self/clear_refs cannot be written here")
        self._stage = name

    def finish(self) -> None:
        self._close()
        self._stage = None

    def _close(self) -> None:
        if self._stage is not None:
            self.peaks[self._stage] = _required("VmHWM") - self.base


def _required(field: str) -> int:
    value = status_bytes(field)
    if value is None:
        raise RuntimeError(f"capacity.estimate(measure=True): /proc/self/status has no {field}")
    return value


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """FakeTensorMode logs (at ERROR) every op its meta kernel refuses before the caller's
    fallback runs, e.g. the emulation's fused grouped GEMM on FP32 operands, whose per-group
    loop then runs: expected here, so not printed."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _label_state(tracker: MemoryTracker, trainer) -> None:
    """File the model's weights and buffers, and the optimizer's masters and moments, so far."""
    model = getattr(trainer, "model", None)
    if model is not None:
        quantized, plain = [], []
        for param in model.parameters():
            (quantized if isinstance(local_tensor(param), QuantizedWeightTensor) else plain).append(local_tensor(param))
        tracker.label(quantized, "8-bit weights")
        tracker.label(plain + list(model.buffers()), "high-precision weights")
    optimizer = getattr(trainer, "optimizer", None)
    if optimizer is not None:
        tracker.label([local_tensor(m) for m in optimizer.masters.values()], "FP32 masters")
        tracker.label([local_tensor(v) for m in optimizer.masters.values()
                       for v in optimizer.optimizer.state[m].values() if isinstance(v, torch.Tensor)], "AdamW moments")
