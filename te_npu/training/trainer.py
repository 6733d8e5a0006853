"""Trainer: builds a model shard-first (the order below) and runs Megatron-style steps.

Model-agnostic: a ``TrainTask`` says how to build, validate, initialise and score one model
family (DeepSeek-V3's is ``models/deepseek_v3/pretrain.py``). Build order of ``setup``
(torchtitan's: shard before anything is allocated, then initialise each rank's shards only):

    preflight (device, writable dirs, the checkpoint folder's lock, which step to resume)
    -> process group -> data (headers, token ids vs the model's vocab) -> resume check (the
    step verified against its manifest, the data position mapped onto this world size)
    -> capability gate -> meta build -> spec validation (+ HF keys) -> 8-bit weights on meta
    -> quantization kernel (chosen once, logged) -> shard plan from the meta shapes (refused
    before any allocation, logged once) -> FSDP2 units on meta -> allocate the local shards
    (``to_empty``) -> activation checkpointing -> FP32-master optimizer (masters allocated)
    -> initial values, exactly one of: DCP resume, HF initial load, random init of each shard
    (every rank cuts its region from the same full value: no dependence on the world size)
    -> 8-bit shards refreshed from the masters

Everything before the meta build needs only the config, the data headers and the filesystem,
so a bad input fails in seconds with a ``ConfigError``. No rank ever holds a full copy of the
model: the setup peak is the resting state plus one parameter's full initial value. The error path (one report, every rank
out fast) belongs to the entry point: ``te_npu.training.job.run_job``; ``close`` is the success
path only (it ends with a barrier), ``abandon`` the error path's local cleanup.

One optimizer step = ``gradient_accumulation_steps`` calls of ``forward_backward`` (FSDP2
reduce-scatters each micro-batch's gradients; weights are never re-quantized between them),
then ``optimizer_step`` (global grad norm, skip when non-finite, clip, AdamW on FP32
masters, refresh every 8-bit shard once).

Read ``Trainer.setup`` (the build order, one named call per step) and ``Trainer.train`` (the
step loop). The on-disk side -- the folder's lock, the resume check, DCP saves and loads, the HF
start and export, the run's save history and what a divergence does to it -- is the
``Checkpointer`` the Trainer holds (``te_npu.training.checkpointer``), handed the state to save.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol

import torch
import torch.distributed as dist
from torch import nn

import te_npu
from te_npu import events
from te_npu.recipe import describe_recipe
from te_npu.distributed import MasterWeightOptimizer, StepResult, layer_units, shard_model
from te_npu.distributed.sharding import average_replicated_gradients
from te_npu.distributed.mesh import dp_mesh
from te_npu.compat import default_store, local_tensor, set_process_group_timeout
from te_npu.errors import ConfigError
from te_npu.modules import TEModule, assign_fqns
from te_npu.observer import PrecisionObserver, StepFigures, quantized_weights
from te_npu.ops import require_low_precision, use_quant_kernel
from te_npu.ops.capability import capability_waived
from te_npu.ops.kernels import KernelChoice, QuantKernelUnavailable, choose_quant_kernel
from te_npu.training import mapped_files
from te_npu.training.checkpointer import Checkpointer, agree
from te_npu.training.config import TrainConfig
from te_npu.training.data import build_splits
from te_npu.training.guards import preflight
from te_npu.training.guards.divergence import DivergenceGuard, TrainingDiverged
from te_npu.training.guards.stall import StallWatch
from te_npu.training.metrics.log import MetricsLogger, peak_memory_mb
from te_npu.training.metrics.throughput import default_peak_tflops, step_throughput
from te_npu.training.recompute import apply_activation_checkpointing
from te_npu.training.runtime import StopRequest, launch_env
from te_npu.training.schedule import lr_at
from te_npu.training.task_step import LossParts, StepEnd, StepReport, as_loss_parts

__all__ = ["TrainTask", "Trainer", "StepRecord"]

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class TrainTask(Protocol):
    """How to build and score one model family."""

    model_section: type
    """Schema of the config's ``model`` section: a frozen dataclass built by
    ``te_npu.training.schema`` (types, ranges, unknown keys), whose ``__post_init__`` checks the
    model's own rules. ``load_config(..., model_section=...)`` applies it at load; otherwise
    ``Trainer.setup`` does, before anything else (``TrainConfig.with_model_section``)."""

    def build(self, cfg: TrainConfig, dtype: torch.dtype) -> nn.Module:
        """Construct the model; called under ``torch.device("meta")`` (must allocate nothing)."""

    def validate(self, model: nn.Module, cfg: TrainConfig) -> None:
        """Check the built structure against the requested spec (raise ``ConfigError``)."""

    def initial_value(self, model: nn.Module, fqn: str, *, seed: int) -> torch.Tensor:
        """The full initial value of parameter or buffer ``fqn`` (its global shape; FP32 or its
        dtype; any device), deterministic in ``seed`` and ``fqn`` alone (never in the world size
        or in which tensors were initialised before): each rank keeps its own region of it."""

    def vocab_size(self, cfg: TrainConfig) -> int:
        """Token ids the model embeds (ids must be ``< vocab_size``); read from the config, no build."""

    def layer_types(self) -> tuple[type[nn.Module], ...]:
        """Module types that are FSDP2 units and activation-recompute units (decoder layers)."""

    def low_precision_scope(self, model: nn.Module) -> list[str]:
        """FQNs of the model's TE modules."""

    def loss(self, model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | LossParts:
        """Training loss of one micro-batch: a scalar, or ``LossParts`` (the total to backpropagate,
        the language-model loss that ``lm loss`` and the divergence rules read, named extras;
        ``te_npu.training.task_step``). Also called under ``torch.no_grad()`` for validation."""

    # Optional: ``step_begin(model, step)`` is called before each optimizer step's micro-batches
    # with its 1-based number (also the first step of a resumed run: a schedule a task keeps
    # by step starts right). ``step_end(model, StepEnd) -> StepReport | None`` is called once per optimizer
    # step, after its micro-batches and the optimizer step (skipped steps included; see
    # ``te_npu.training.task_step``): the place for state a task updates once a step (e.g. an MoE
    # router's expert bias) and for what it reports (metrics, a step-line summary, warnings).
    # Optional: ``hf_adapter(cfg) -> te_npu.training.hf.weights.HFAdapter`` lets the run start
    # from (``checkpoint.initial_load_path``) and export to (``last_save_format: hf``) Hugging Face;
    # ``flops_per_token(cfg) -> te_npu.training.metrics.throughput.ModelFlops`` lets the step line report
    # TFLOP/s per device and MFU.


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step produced (the same numbers the log line prints)."""

    step: int
    lm_loss: float
    grad_norm: float
    lr: float
    updated: bool
    elapsed_ms: float
    tokens_per_s: float
    loss_extras: dict[str, float] = dataclasses.field(default_factory=dict)
    """The task's named loss parts (``LossParts.extras``), averaged like ``lm_loss``."""
    report: StepReport | None = None
    """What the task's ``step_end`` reported for this step (None: no such hook)."""
    precision: StepFigures | None = None
    """The precision observer's figures of this step (None: not observed; ``te_npu.observer``)."""


class Trainer:
    """Set up with ``setup(cfg)``, then ``train()`` (or drive ``train_step`` / the pieces yourself)."""

    def __init__(self, task: TrainTask, *, print_fn=print, stop: StopRequest | None = None,
                 subscribers: Iterable[Callable[[object], None]] = (),
                 allocation_context: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        """``stop``: the job's ``StopRequest`` (signal handlers set it; ``te_npu.training.runtime``).

        ``allocation_context``: entered around every step of ``setup`` that creates the model's
        tensors (meta build through initial values); the capacity estimator
        (``te_npu.training.capacity``) passes fake tensors there, so the real setup runs and
        allocates nothing. Default: none.

        ``subscribers``: ``te_npu.events`` callbacks (a metrics sink, a test probe, ...), subscribed
        from the start of ``setup`` until ``close`` / ``abandon``: they see everything the run
        reports (setup's weight quantization, each step's GEMMs, gathers and refreshes, the
        ``StepBeginEvent`` that starts each step, checkpoint loads), in this process.
        """
        self.task = task
        self.subscribers = tuple(subscribers)
        self._subscriptions: list[events.Subscription] = []
        self._print = print_fn
        self.stop = stop
        self.global_step = 0
        self._observer: PrecisionObserver | None = None  # set by _open_metrics when precision_observer is on
        self.skipped_iterations = 0
        self.grad_norm: float | None = None
        self._owns_process_group = False
        self.checkpointer: Checkpointer | None = None  # the on-disk side, built by _preflight
        self._stop_agreed = False
        self._allocation_context = allocation_context or contextlib.nullcontext
        self._watch = stop.watch if stop is not None else StallWatch()  # phases are marked; it runs under run_job
        self._warmed: set[str] = set()  # "step", "evaluation": run once by this process (warm-up over)

    # ---- build: setup's steps, in order ------------------------------------------------------
    def setup(self, cfg: TrainConfig) -> Trainer:
        """Build everything in the build order; resume from the latest DCP checkpoint if asked.
        The steps, top to bottom, are the build order of the module docstring: checks that need no
        model (config, device, folders, data, the resume step), then meta build -> shard plan ->
        FSDP2 units on meta -> allocate the local shards -> optimizer masters -> initial values
        (DCP resume, HF load or random init), the 8-bit shards refreshed from the masters.
        If setup fails, the checkpoint folder's lock is released before the error propagates, and
        a lock file (or folder) that this setup created is removed: a refused start leaves nothing."""
        try:
            cfg = self._configure(cfg)  # the task's model rules, before anything else; subscriptions
            self._preflight()  # device, the resume step: checks every rank makes alike, before any process group
            for note in getattr(cfg.model, "notes", tuple)():  # what the task's model section says once
                self._print_rank0(f" note: {note}")
            hf_start = self.checkpointer.open_hf_start()  # the HF checkpoint to start from (checked), or None
            self._init_distributed()
            self._claim_folders()  # rank 0: logging.dir writable, checkpoint.dir locked; every rank agrees
            self._setup_data()  # data headers, token ids vs the model's vocab, the sampler
            self._check_resume()  # the resume step's manifest, data position and world size: before the build
            self._check_capability()  # the low-precision gate on this device (torch_npu only on npu)
            torch.manual_seed(cfg.training.seed)
            with self._allocation_context():
                model = self._build_on_meta(cfg, hf_start)  # meta build, spec and HF-key checks, 8-bit weights (meta)
                # after every config check, so a bad input fails in seconds, before any native build
                self.quant_kernel = self._choose_quant_kernel()
                self._print_rank0(f" low precision: {describe_recipe(self.recipe)}")
                self.shard_plan = self._shard_on_meta(model)  # plan from meta shapes, refused before any allocation
                self._allocate(model)  # each rank its own shards only (to_empty); activation checkpointing
                self._build_optimizer()  # FP32 masters and moments of the local shards
                self._initialize(hf_start)  # DCP resume, HF initial load or random init; then the 8-bit refresh
            self._open_metrics()  # the metrics log, the step line's FLOPs and peak
        except BaseException:
            if self.checkpointer is not None:
                self.checkpointer.release(discard=True)
            self.abandon()
            raise
        return self

    def _configure(self, cfg: TrainConfig) -> TrainConfig:
        """The config with the task's model section applied; subscriptions, recipe and dtype set."""
        cfg = cfg.with_model_section(self.task.model_section)  # the task's model rules, before anything else
        if not self._subscriptions:
            self._subscriptions = [events.subscribe(callback) for callback in self.subscribers]
        self.cfg = cfg
        self.recipe = cfg.low_precision.recipe
        self.dtype = _DTYPES[cfg.training.param_dtype]
        return cfg

    def _preflight(self) -> None:
        """Checks on the config, filesystem and device that give the same answer on every rank."""
        cfg, env = self.cfg, launch_env()
        self.rank = dist.get_rank() if dist.is_initialized() else env.rank
        self.world_size = dist.get_world_size() if dist.is_initialized() else env.world_size
        f = cfg.fsdp_config
        if f.dp_shard_size * f.dp_replicate_size != self.world_size:
            raise ConfigError(
                f"fsdp_config.dp_shard_size x fsdp_config.dp_replicate_size: {f.dp_shard_size} x "
                f"{f.dp_replicate_size} = {f.dp_shard_size * f.dp_replicate_size} does not match the "
                f"{self.world_size} launched rank(s) (the world size)"
            )
        preflight.check_device(cfg.training.device, env.local_rank, env.local_world_size)
        # the rank and world size the process group will have (the launcher's): the checkpointer's for the run
        self.checkpointer = Checkpointer(cfg, self.task, resume_path=preflight.resume_target(cfg.checkpoint),
                                         rank=self.rank, world_size=self.world_size, print_fn=self._print,
                                         watch=self._watch)

    def _init_distributed(self) -> None:
        t, env = self.cfg.training, launch_env()
        device_type = t.device  # torch_npu was imported by the preflight device check
        if not dist.is_initialized() and env.world_size > 1:
            # setup and the first step are warm-up: the process group's timeout drops to
            # collective_timeout_s once the first step is done (_warm_up)
            dist.init_process_group(backend=t.resolved_backend,
                                    timeout=datetime.timedelta(seconds=self._warm_up_s()))
            self._owns_process_group = True
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        # a stalled peer ends the job in one line (te_npu.training.guards.stall); a fake process group
        # (the capacity estimate: one process playing one rank) has no peers to watch
        if self.world_size > 1 and dist.get_backend() != "fake":
            self._watch.start(t.collective_timeout_s, store=default_store(), rank=self.rank, world=self.world_size,
                              node=env.node_rank)
        local_rank = env.local_rank
        if device_type == "cpu":
            self.device = torch.device("cpu")
        else:
            getattr(torch, device_type).set_device(local_rank)
            self.device = torch.device(device_type, local_rank)
        # the data-parallel mesh (process-group state, made before any model tensor): every rank
        # one FSDP group, or HSDP's dp_replicate x dp_shard (te_npu.distributed.mesh)
        f = self.cfg.fsdp_config
        self.mesh = dp_mesh(self.device.type, replicate=f.dp_replicate_size,
                            shard=f.dp_shard_size) if self.world_size > 1 else None

    def _claim_folders(self) -> None:
        """Rank 0 (the only writer of logs and of the folder's top level) proves ``logging.dir``
        writable, locks ``checkpoint.dir`` and completes a save that died after it was published
        (``Checkpointer.claim_folder``); its ``ConfigError`` is raised on every rank."""
        error = None
        if self.rank == 0:
            try:
                preflight.check_writable(self.cfg.logging.dir, "logging.dir")
                self.checkpointer.claim_folder()
            except ConfigError as exc:
                error = str(exc)
        agree(error, self.world_size)

    def _check_resume(self) -> None:
        """The step to resume verified against its manifest, its data position mapped onto this
        run, the folder's history settled and the planned saves and export checked
        (``Checkpointer.check_resume``)."""
        self.checkpointer.check_resume(self.batcher.position_for, self.recipe)

    def _setup_data(self) -> None:
        """The data kind's splits (rank 0 builds a cache first), their token ids against the model's
        vocabulary, the sampler; every problem a one-line ``ConfigError`` naming its ``data.*`` key."""
        t, d = self.cfg.training, self.cfg.data
        self.vocab_size = self.task.vocab_size(self.cfg)
        splits = build_splits(d, self.vocab_size, rank=self.rank, barrier=self._barrier)  # a cache: rank 0 first
        self.train_data, self.val_data = splits.train, splits.val
        for dataset, key in ((splits.train, splits.train_key), (splits.val, splits.val_key)):
            note = dataset.check_token_ids(self.vocab_size, key)
            if note:
                self._print_rank0(f" note: {note}")
        mapped_files.record(launch_env().mapped_files_dir, self.rank)  # the launcher's SIGBUS diagnosis
        run_samples = t.train_steps * t.micro_batch_size * t.gradient_accumulation_steps * self.world_size

        try:  # a split that writes files (Megatron's indices) writes them on rank 0 first
            self.batcher = self.train_data.batcher(
                t.micro_batch_size, t.seq_len, seed=t.seed, rank=self.rank, world_size=self.world_size,
                shuffle=d.shuffle, vocab_size=self.vocab_size, run_samples=run_samples, start_sample=d.start_sample,
                train_samples=d.train_samples, barrier=self._barrier)
        except ConfigError:
            raise  # already one line naming its data (a stale index cache that cannot be rebuilt)
        except ValueError as exc:
            raise ConfigError(f"{splits.train_key} / training.seq_len / training.micro_batch_size: {exc}") from None
        for note in getattr(self.batcher, "notes", ()):
            self._print_rank0(f" note: {note}")

    def _check_capability(self) -> None:
        """The low-precision capability gate on this device (none for a BF16 run)."""
        if self.recipe is not None:
            # only touches torch_npu on npu; capability_check: warn warns once here, then waives the gate
            require_low_precision(self.recipe.format, self.device,
                                  capability_check=self.cfg.low_precision.capability_check)

    def _setup_step(self, name: str) -> None:
        """Announce the next named step of ``setup`` (``SetupStepEvent``: a memory tracker's stages)."""
        if events.has_subscribers(events.SetupStepEvent):
            events.emit(events.SetupStepEvent(name))

    def _build_on_meta(self, cfg: TrainConfig, hf_start) -> nn.Module:
        """The model on the meta device, checked against its spec (and the HF checkpoint's keys),
        with its TE weights turned into 8-bit weights that hold no values yet."""
        self._setup_step("build on meta")
        with torch.device("meta"):
            model = self.task.build(cfg, self.dtype)
        self.task.validate(model, cfg)
        if hf_start is not None:
            self.checkpointer.check_hf_start_keys(hf_start, model)  # before any memory is allocated
        if self.recipe is not None:
            te_npu.quantize_weights_(model, self.recipe)
        assign_fqns(model)
        return model

    def _choose_quant_kernel(self) -> KernelChoice:
        """Resolve ``training.quant_kernel`` once for the run (building the native kernels if they
        are picked) and log the choice on rank 0; a named kernel that cannot run is a ``ConfigError``."""
        try:
            choice = choose_quant_kernel(self.cfg.training.quant_kernel, self.device.type,
                                         quantizes=self.recipe is not None)
        except QuantKernelUnavailable as exc:
            raise ConfigError(f"training.quant_kernel: {exc}; 'auto' falls back to eager, saying why") from None
        self._print_rank0(f" quantization kernel: {choice}")
        return choice

    def _shard_on_meta(self, model: nn.Module):
        """FSDP2 units on the meta model: every parameter's shard dim planned from its shape and
        format (``ConfigError`` naming what no dim can shard, before any allocation); the plan is
        logged once. None on one rank."""
        if self.world_size == 1:
            return None
        self._setup_step("shard on meta")
        cfg, mesh = self.cfg, self.mesh
        # torchtitan's units: one per decoder layer (its 8-bit weights gathered in the layer's
        # group), FP32 modules of a BF16 model apart, the embedding, final norm + lm_head
        plan = shard_model(
            model,
            mesh,
            units=layer_units(model, self.task.layer_types(), apart=_other_dtype_modules(model, self.dtype)),
            reshard_after_forward=cfg.fsdp_config.reshard_after_forward,
            fallback_to_unsharded=cfg.fsdp_config.fallback_to_unsharded,
            comm_fusion=cfg.fsdp_config.comm_fusion,
        )
        self._print_rank0(" " + plan.describe().replace("\n", "\n "))
        return plan

    def _allocate(self, model: nn.Module) -> None:
        """Each rank allocates its own shards only (``to_empty``); HSDP's replicated parameters get
        their gradient averaging; full activation checkpointing wraps the layers."""
        self._setup_step("allocate shards")
        model.to_empty(device=self.device)  # each rank allocates its own shards only
        if self.shard_plan is not None and self.shard_plan.replicated:  # to_empty made new parameters
            average_replicated_gradients(model, self.shard_plan, self.mesh)
        if self.cfg.activation_checkpoint.mode == "full":
            apply_activation_checkpointing(model, self.task.layer_types())
        self.model = model

    def _build_optimizer(self) -> None:
        """The FP32-master optimizer over the sharded model (masters allocated, not yet written)."""
        t = self.cfg.training
        self._setup_step("optimizer state")
        self.optimizer = MasterWeightOptimizer.for_sharded_init(
            self.model, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay,
            max_grad_norm=t.clip_grad or None,
        )

    def _initialize(self, hf_start) -> None:
        """Write every master (and buffer) exactly once, then refresh the 8-bit shards from the
        masters: from the DCP step to resume, else the HF checkpoint, else the task's random init
        (each rank its own region of every full initial value). Buffers are set from the task's
        init first (a checkpoint without them keeps those)."""
        self._setup_step("initial values")
        seed, model = self.cfg.training.seed, self.model
        with torch.no_grad():
            for fqn, buffer in model.named_buffers():
                buffer.copy_(self.task.initial_value(model, fqn, seed=seed))
        if self.checkpointer.resume_path is not None:
            self.load_dcp(self.checkpointer.resume_path, verified=True)
        elif hf_start is not None:
            with self._kernels():  # re-quantizes the 8-bit weights from the loaded masters
                self.hf_read_report = self.checkpointer.load_hf_start(hf_start, self.model, self.optimizer)
        else:
            with self._kernels():
                self.optimizer.initialize_masters_(lambda fqn: self.task.initial_value(model, fqn, seed=seed))

    def _open_metrics(self) -> None:
        """The metrics log (a fresh run starts a clean ``metrics.jsonl``), the model FLOPs and peak
        the step line's throughput and MFU divide by; a graceful SIGTERM if the config asks."""
        cfg, t = self.cfg, self.cfg.training
        self.logger = MetricsLogger(
            cfg.logging.dir,
            train_steps=t.train_steps,
            rank=self.rank,
            jsonl_name=cfg.logging.metrics_jsonl,
            tensorboard=cfg.logging.tensorboard,
            print_fn=self._print,
            fresh=self.checkpointer.resume_step is None,  # a fresh run in a used logging.dir starts a clean metrics.jsonl
        )
        self.logger.log_config(cfg.to_dict())
        flops_of = getattr(self.task, "flops_per_token", None)
        self.model_flops = flops_of(cfg) if flops_of is not None else None
        self.peak_tflops = t.peak_tflops or default_peak_tflops(
            self.recipe.format.value if self.recipe is not None else None, self.device.type)
        if self.stop is not None and cfg.checkpoint.save_on_sigterm:
            self.stop.graceful = True
        # the precision observer (te_npu.observer): None when off, so the step path is untouched
        self._observer = PrecisionObserver(cfg.precision_observer, self.model) if cfg.precision_observer.enabled else None

    # ---- one step ----------------------------------------------------------------------------
    def forward_backward(self, batch: tuple[torch.Tensor, torch.Tensor], loss_scale: float = 1.0) -> LossParts:
        """Losses of one micro-batch (detached), the gradient of their total (times ``loss_scale``)
        accumulated."""
        input_ids, labels = (x.to(self.device, non_blocking=True) for x in batch)
        with self._kernels(), te_npu.autocast(enabled=self.recipe is not None, recipe=self.recipe):
            parts = as_loss_parts(self.task.loss(self.model, input_ids, labels))
            (parts.total * loss_scale).backward()
        return parts.detached()

    def optimizer_step(self) -> StepResult:
        """Clip, update the FP32 masters and refresh 8-bit weights; skip if gradients are non-finite."""
        with self._kernels():
            result = self.optimizer.step()
        self.optimizer.zero_grad()
        self.grad_norm = result.grad_norm
        if not result.updated:
            self.skipped_iterations += 1
            self._print_rank0(
                f" [skipped] iteration {self.global_step + 1}: non-finite gradients (grad norm {result.grad_norm}); "
                "no master update, no weight refresh"
            )
        return result

    def set_lr(self, step: int) -> float:
        t = self.cfg.training
        lr = lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, total_steps=t.train_steps,
                   schedule=t.lr_schedule)
        for group in self.optimizer.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> StepRecord:
        """One optimizer step over ``micro_batches`` (default: the next ones from the data)."""
        t = self.cfg.training
        if micro_batches is None:
            micro_batches = [next(self.batcher) for _ in range(t.gradient_accumulation_steps)]
        step = self.global_step
        if events.has_subscribers(events.StepBeginEvent):
            events.emit(events.StepBeginEvent(step))
        lr = self.set_lr(step)
        begin = getattr(self.task, "step_begin", None)
        if begin is not None:  # the task's once-per-step hook before the micro-batches
            begin(self.model, step + 1)
        self._synchronize()
        start = time.perf_counter()
        with self._warm_up("step") as limit:  # each piece bounded by collective_timeout_s (warm-up: its own)
            observing = self._observer is not None and self._observer.begin_step(
                step + 1, weights=quantized_weights(self.optimizer))  # the weights this step's GEMMs read
            with self._watch.phase("forward/backward", step + 1, limit_s=limit):
                parts = [self.forward_backward(b, 1.0 / len(micro_batches)) for b in micro_batches]
            if observing:
                with self._watch.phase("precision observer", step + 1, limit_s=limit):
                    precision = self._observer.end_step()  # one collective
            with self._watch.phase("optimizer step", step + 1, limit_s=limit):
                result = self.optimizer_step()
            with self._watch.phase("task step end", step + 1, limit_s=limit):
                report = self._task_step_end(step + 1, result.updated)
            with self._watch.phase("loss all-reduce", step + 1, limit_s=limit):
                losses, self._stop_agreed = self._losses_and_stop(parts)
                self._synchronize()
        elapsed = time.perf_counter() - start
        self.global_step += 1
        tokens = sum(b[0].numel() for b in micro_batches) * self.world_size
        lm_loss = losses.pop("lm_loss")
        return StepRecord(step + 1, lm_loss, result.grad_norm, lr, result.updated, elapsed * 1e3, tokens / elapsed,
                          loss_extras=losses, report=report, precision=precision if observing else None)

    def _task_step_end(self, step: int, updated: bool) -> StepReport | None:
        """The task's once-per-step hook (``TrainTask.step_end``), if it has one."""
        hook = getattr(self.task, "step_end", None)
        if hook is None:
            return None
        return hook(self.model, StepEnd(step=step, updated=updated, world_size=self.world_size,
                                        all_reduce_sum=self._all_reduce_sum))

    def _all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over every rank (a new tensor on ``value``'s device)."""
        if self.world_size == 1:
            return value.clone()
        total = value.to(self._collective_device(), copy=True)
        dist.all_reduce(total)
        return total.to(value.device)

    def evaluate(self) -> float:
        """Mean validation language-model loss over ``training.eval_steps`` fixed batches (all ranks)."""
        return self.evaluate_losses()["lm_loss"]

    @torch.no_grad()
    def evaluate_losses(self) -> dict[str, float]:
        """Mean validation losses over ``training.eval_steps`` fixed batches (all ranks):
        ``lm_loss`` and the task's named extras (``LossParts.extras``), one all-reduce."""
        t = self.cfg.training
        parts = []
        batches = self.val_data.validation_batches(
            t.micro_batch_size, t.seq_len, num_batches=t.eval_steps, rank=self.rank,
            world_size=self.world_size, vocab_size=self.vocab_size, seed=t.seed,
        )
        with self._warm_up("evaluation") as limit, self._watch.phase("evaluation", self.global_step, limit_s=limit), \
                self._kernels(), te_npu.autocast(enabled=self.recipe is not None, recipe=self.recipe):
            self.model.eval()  # evaluation mode: a model's training-only state (e.g. router counts) stays as is
            try:
                for input_ids, labels in batches:
                    loss = self.task.loss(self.model, input_ids.to(self.device), labels.to(self.device))
                    parts.append(as_loss_parts(loss).detached())
            finally:
                self.model.train()
            names, values = _stack_parts(parts)
            return dict(zip(names, self._all_reduce_sum(values).div(self.world_size).tolist()))

    def _warm_up_s(self) -> float:
        t = self.cfg.training
        return max(t.first_step_timeout_s, t.collective_timeout_s)

    @contextlib.contextmanager
    def _warm_up(self, kind: str):
        """The first ``kind`` ("step", "evaluation") of this process is warm-up (a compile, graph
        capture, communicator setup): yields its limit, ``training.first_step_timeout_s``, with
        the process group's timeout at it; then ``collective_timeout_s`` again. Yields None after."""
        if kind in self._warmed:
            yield None
            return
        t = self.cfg.training
        multi = self.world_size > 1 and dist.is_initialized() and dist.get_backend() != "fake"
        if multi and kind != "step":  # setup through the first step already run at the warm-up timeout
            set_process_group_timeout(self._warm_up_s())
        try:
            yield self._warm_up_s()
        finally:
            self._warmed.add(kind)
            if multi:
                set_process_group_timeout(t.collective_timeout_s)

    # ---- saves and loads: the state handed to the checkpointer ---------------------------------
    def save_dcp(self, directory: str | None = None, *, prune: bool = True) -> str:
        """Atomic DCP save of this step (``Checkpointer.save``: weights, masters, moments, data
        position, skipped count, RNG, recipe); returns the step path.

        Refuses (``TrainingDiverged``) to save non-finite masters over the good checkpoints.
        ``prune``: apply ``checkpoint.keep_last`` now; ``train`` passes False and prunes once a
        later healthy loss vouches for the saved weights.
        """
        self._require_finite_masters()
        return self.checkpointer.save(self.model, self.optimizer, self.global_step, data=self.batcher.state_dict(),
                                      skipped_iterations=self.skipped_iterations, recipe=self.recipe,
                                      directory=directory, prune=prune)

    def load_dcp(self, directory: str | None = None, *, verified: bool = False) -> int:
        """Restore the latest checkpoint (or a step dir): masters, moments, step, data position,
        skipped count, RNG; rebuild 8-bit shards. ``verified``: the manifest was checked already."""
        with self._kernels():  # rebuilds the 8-bit shards from the loaded masters
            loaded = self.checkpointer.load(self.model, self.optimizer, directory, verified=verified)
        self.global_step = loaded.step
        if loaded.data is not None:  # None: a converted step 0 (weights only): data and RNG as a fresh run
            self.batcher.load_state_dict(loaded.data)
        self.skipped_iterations = loaded.skipped_iterations
        self._print_rank0(f" resumed from checkpoint at iteration {self.global_step} ({loaded.path}, consumed samples "
                          f"{self.batcher.consumed_samples})")
        return self.global_step

    def save_hf(self, directory: str | None = None) -> str:
        """Export this step's FP32 masters as a Hugging Face directory (``Checkpointer.save_hf``;
        default ``checkpoint.export_dir`` or ``<checkpoint.dir>/hf/step_<N>``)."""
        return self.checkpointer.save_hf(self.model, self.optimizer, self.global_step, directory)

    def _require_finite_masters(self) -> None:
        bad = [fqn for fqn, m in self.optimizer.masters.items() if not bool(torch.isfinite(local_tensor(m)).all())]
        count = torch.tensor(float(len(bad)))
        if self.world_size > 1:
            count = count.to(self._collective_device())
            dist.all_reduce(count)
        if count.item():
            example = f" (e.g. {bad[0]})" if bad else ""
            raise TrainingDiverged(
                f"iteration {self.global_step}: {int(count.item())} FP32 master shard(s) hold NaN/Inf{example}; "
                f"refusing to save them over the good checkpoints ({self.checkpointer.latest_note()})"
            )

    # ---- loop --------------------------------------------------------------------------------
    def train(self) -> list[StepRecord]:
        """Run until ``training.train_steps``; log, evaluate, checkpoint and plot on the way.

        A divergence rule (``te_npu.training.guards.divergence``) raises ``TrainingDiverged`` before
        anything is saved; a graceful SIGTERM (``checkpoint.save_on_sigterm``) saves and returns.
        An interval save that falls while a streak rule is counting (skipped steps, a collapsed
        model) waits for the next healthy step, and a save's older steps are pruned only once a
        healthy loss has vouched for the saved weights (the loss of step ``s + 1`` is the first
        computed with the weights of step ``s``): a run that dies never writes, or prunes for,
        checkpoints of the dead model, and a step saved after the divergence began is moved to
        ``<checkpoint.dir>/diverged/`` with ``latest`` pointed back at the last good step.
        A resumed run first moves the metrics of the steps it redoes out of ``metrics.jsonl``.
        """
        t, c = self.cfg.training, self.cfg.checkpoint
        guard = DivergenceGuard(max_consecutive_skipped_steps=t.max_consecutive_skipped_steps,
                                stop_on_nonfinite_loss=t.stop_on_nonfinite_loss, loss_spike_factor=t.loss_spike_factor,
                                max_loss_factor=t.max_loss_factor, collapse_steps=t.collapse_steps,
                                vocab_size=self.vocab_size)
        records, save_due = [], False
        if self.checkpointer.resume_step is not None:  # resumed: the steps after it are redone, each logged once
            self.logger.resume_at(self.global_step)
        if self.global_step >= t.train_steps:
            unfinished = self.checkpointer.unfinished_export(self.global_step)
            if unfinished is None:
                self._print_rank0(f" training already complete at iteration {self.global_step}; nothing to do")
            else:  # the export is part of finishing the run: a run that died in it finishes it now
                self._print_rank0(f" training already complete at iteration {self.global_step}, its HF export is not "
                                  f"({unfinished}): exporting it now")
                self.save_hf()
        global_batch = t.micro_batch_size * t.gradient_accumulation_steps * self.world_size
        while self.global_step < t.train_steps:
            record = self.train_step()
            records.append(record)
            step = record.step
            report = record.report or StepReport()
            for warning in report.warnings:
                self._print_rank0(f" warning: {warning}")
            if step % t.log_interval == 0 or step == t.train_steps or record.precision is not None:
                extra, summary = _with_precision(record.precision, dict(report.metrics), report.summary)
                self.logger.log_step(
                    step, lm_loss=record.lm_loss, lr=record.lr, grad_norm=record.grad_norm,
                    elapsed_ms=record.elapsed_ms, global_batch_size=global_batch,
                    consumed_samples=self.batcher.consumed_samples, tokens_per_s=record.tokens_per_s,
                    skipped_iterations=self.skipped_iterations, peak_mem_mb=peak_memory_mb(self.device),
                    **self._throughput(record), losses=record.loss_extras, extra=extra, summary=summary,
                )
            try:
                guard.check(step, record.lm_loss, record.updated, record.grad_norm)
            except TrainingDiverged as exc:
                raise self.checkpointer.diverged(exc) from None
            if not guard.suspect:
                self.checkpointer.confirm_saves()  # this healthy loss vouches for every weight saved before it
            if self._stop_agreed:  # SIGTERM on some rank, combined over ranks with this step's loss
                self.save_dcp(prune=False)
                self._print_rank0(f" stopped on SIGTERM after iteration {step} (checkpoint saved)")
                return records
            if t.eval_interval and (step % t.eval_interval == 0 or step == t.train_steps):
                losses = self.evaluate_losses()
                self.logger.log_validation(step, lm_loss=losses.pop("lm_loss"), losses=losses)
            save_due = save_due or bool(c.interval and step % c.interval == 0)
            if save_due and step != t.train_steps:
                if guard.suspect:
                    if c.interval and step % c.interval == 0:
                        why = "it was skipped" if guard.skipped_in_a_row else "the model looks collapsed"
                        self._print_rank0(f" not saving at iteration {step}: {why}; the save follows the next "
                                          "healthy step")
                else:
                    self.save_dcp(prune=False)
                    save_due = False
        if records:
            self.save_dcp()
            self.checkpointer.end_of_run()
            if c.last_save_format == "hf":
                self.save_hf()
        if self.cfg.logging.plot and self.rank == 0:
            self._plot()
        return records

    # ---- end ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Success path: close logs, release the checkpoint folder, end the subscriptions, and tear
        down the process group if this trainer created it (after a barrier: every rank got here;
        the stall watch runs until then)."""
        self._release()
        if self._owns_process_group and dist.is_initialized():
            dist.barrier()
            self._watch.stop()
            dist.destroy_process_group()
        self._watch.stop()

    def abandon(self) -> None:
        """Error path: close logs, release the checkpoint folder's lock, end the subscriptions and
        the stall watch, no collective."""
        self._release()
        self._watch.stop()

    def _release(self) -> None:
        for subscription in self._subscriptions:
            subscription.close()
        self._subscriptions = []
        if hasattr(self, "logger"):
            self.logger.close()
        if self.checkpointer is not None:
            self.checkpointer.release()

    # ---- helpers -----------------------------------------------------------------------------
    def _throughput(self, record: StepRecord) -> dict:
        """``tflops`` (model TFLOP/s per device) and ``mfu`` of one step, {} without model FLOPs."""
        if self.model_flops is None:
            return {}
        speed = step_throughput(self.model_flops, record.tokens_per_s, self.world_size, self.peak_tflops)
        return {"tflops": speed["tflops"], "mfu": speed["mfu"]}

    def _kernels(self) -> contextlib.AbstractContextManager:
        """The run's kernel variant, active for one of the Trainer's computations (every
        quantization and decode of setup, steps, evaluation and loads runs inside one)."""
        stack = contextlib.ExitStack()
        stack.enter_context(use_quant_kernel(self.quant_kernel.name))
        if self.recipe is not None and self.cfg.low_precision.capability_check == "warn":
            stack.enter_context(capability_waived(self.recipe.format))  # warned at setup
        return stack

    def _plot(self) -> None:
        from te_npu.training.metrics.plots import plot_families, plot_precision, plot_runs, read_run

        log_dir = Path(self.cfg.logging.dir)
        records = read_run(log_dir, self.cfg.logging.metrics_jsonl)
        out = [plot_runs([(log_dir.name, records)], log_dir / "curves.png"), *plot_families(records, log_dir, log_dir.name)]
        if self._observer is not None:
            out.append(plot_precision(records, log_dir / "precision.png"))
        self._print_rank0(f" wrote {', '.join(str(p) for p in out if p is not None)}")

    def _losses_and_stop(self, parts: list[LossParts]) -> tuple[dict[str, float], bool]:
        """Each loss part's mean over the micro-batches and ranks (``lm_loss`` and the extras), and
        whether any rank asked to stop: one all-reduce for all of them."""
        names, values = _stack_parts(parts)
        stop = float(self.stop is not None and self.stop.signum is not None)
        summed = self._all_reduce_sum(torch.cat([values, torch.tensor([stop], device=values.device)]))
        means = summed[:-1].div(self.world_size).tolist()
        return dict(zip(names, means)), bool(summed[-1] > 0)

    def _collective_device(self) -> torch.device:
        return torch.device("cpu") if dist.get_backend() == "gloo" else self.device

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def _synchronize(self) -> None:
        if self.device.type != "cpu":
            getattr(torch, self.device.type).synchronize()

    def _print_rank0(self, line: str) -> None:
        if self.rank == 0:
            self._print(line)


def _stack_parts(parts: list[LossParts]) -> tuple[list[str], torch.Tensor]:
    """(names, FP32 ``[len(names)]``): each part's mean over ``parts``, ``lm_loss`` first, then the
    extras in sorted order (the same order on every rank)."""
    names = ["lm_loss", *sorted(parts[0].extras)]
    columns = [torch.stack([p.lm_loss for p in parts])]
    columns += [torch.stack([p.extras[name] for p in parts]) for name in names[1:]]
    return names, torch.stack([c.float().mean() for c in columns])


def _other_dtype_modules(model: nn.Module, dtype: torch.dtype) -> list[nn.Module]:
    """Modules (not TE modules) owning a parameter not in ``dtype`` (e.g. the FP32 router of a
    BF16 model). FSDP2 needs one original dtype per parameter group, so each is its own unit."""
    return [
        m for m in model.modules()
        if m is not model and not isinstance(m, TEModule) and any(p.dtype != dtype for p in m.parameters(recurse=False))
    ]



def _with_precision(figures: StepFigures | None, extra: dict, summary: str | None) -> tuple[dict, str | None]:
    """The step line's extras and summary with the precision observer's figures added (observed steps)."""
    if figures is None:
        return extra, summary
    return {**extra, **figures.metrics()}, " | ".join(s for s in (summary, figures.summary()) if s)
