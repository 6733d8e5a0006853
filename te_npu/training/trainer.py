"""Trainer: builds a model in the spec's order (section 12.1) and runs Megatron-style steps.

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
"""
from __future__ import annotations

import contextlib
import datetime
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol

import torch
import torch.distributed as dist
from torch import nn

import te_npu
from te_npu import events
from te_npu.recipe import describe_recipe, recipe_change_note, recipe_record
from te_npu.distributed import MasterWeightOptimizer, StepResult, layer_units, shard_model
from te_npu.distributed.storage import folder as checkpoint_folder
from te_npu.distributed.sharding import average_replicated_gradients
from te_npu.distributed.storage import dcp as checkpoint
from te_npu.distributed.storage.lock import FolderLock, acquire_folder_lock, describe_holder
from te_npu.distributed.mesh import dp_mesh
from te_npu.distributed.storage.hf_checkpoint import export_state
from te_npu.compat import default_store, local_tensor, set_process_group_timeout
from te_npu.errors import ConfigError
from te_npu.modules import TEModule, assign_fqns
from te_npu.ops import require_low_precision, use_quant_kernel
from te_npu.ops.capability import capability_waived
from te_npu.ops.kernels import KernelChoice, QuantKernelUnavailable, choose_quant_kernel
from te_npu.training import mapped_files
from te_npu.training.hf import weights as hf_weights
from te_npu.training.guards import preflight
from te_npu.training.config import TrainConfig
from te_npu.training.data import DATA_KINDS, build_splits, check_token_ids, make_batcher, validation_batches
from te_npu.training.guards.divergence import DivergenceGuard, TrainingDiverged
from te_npu.training.job import StopRequest, launch_env
from te_npu.training.guards.stall import StallWatch
from te_npu.training.metrics.log import MetricsLogger, peak_memory_mb
from te_npu.training.recompute import apply_activation_checkpointing
from te_npu.training.schedule import lr_at
from te_npu.training.metrics.throughput import default_peak_tflops, step_throughput

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

    def loss(self, model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Scalar training loss of one micro-batch."""

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


class Trainer:
    """Set up with ``setup(cfg)``, then ``train()`` (or drive ``train_step`` / the pieces yourself)."""

    def __init__(self, task: TrainTask, *, print_fn=print, stop: StopRequest | None = None,
                 subscribers: Iterable[Callable[[object], None]] = (),
                 allocation_context: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        """``stop``: the job's ``StopRequest`` (signal handlers set it; see ``te_npu.training.job``).

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
        self.skipped_iterations = 0
        self.grad_norm: float | None = None
        self.lineage: str | None = None  # the run the checkpoints belong to (kept across resumes)
        self._parent_step: int | None = None  # the step this run resumed from or last saved (its history)
        self._owns_process_group = False
        self._lock: FolderLock | None = None
        self._resume_path: str | None = None
        self._stop_agreed = False
        self._allocation_context = allocation_context or contextlib.nullcontext
        self._watch = stop.watch if stop is not None else StallWatch()  # phases are marked; it runs under run_job
        self._unconfirmed: list[int] = []  # steps this run saved whose weights no later loss has vouched for yet
        self._saved: list[int] = []  # every step this run saved, in order
        self._resume_step: int | None = None  # the step this run resumed from
        self._warmed: set[str] = set()  # "step", "evaluation": run once by this process (warm-up over)

    # ---- build -------------------------------------------------------------------------------
    def setup(self, cfg: TrainConfig) -> Trainer:
        """Build everything in the spec's order; resume from the latest DCP checkpoint if asked.
        If setup fails, the checkpoint folder's lock is released before the error propagates, and
        a lock file (or folder) that this setup created is removed: a refused start leaves nothing."""
        try:
            return self._setup(cfg)
        except BaseException:
            if self._lock is not None:
                self._lock.release(discard=True)
                self._lock = None
            self.abandon()
            raise

    def _setup(self, cfg: TrainConfig) -> Trainer:
        cfg = cfg.with_model_section(self.task.model_section)  # the task's model rules, before anything else
        if not self._subscriptions:
            self._subscriptions = [events.subscribe(callback) for callback in self.subscribers]
        self.cfg, t = cfg, cfg.training
        self.recipe = cfg.low_precision.recipe
        self._preflight()  # device, the resume step: checks every rank makes alike, before any process group
        c = cfg.checkpoint
        hf_start = self._open_initial_hf(cfg) if c.initial_load_path and self._resume_path is None else None
        if c.last_save_format == "hf":  # an export the task cannot write fails now, not after training
            hf_weights.hf_adapter_of(self.task, cfg, where="checkpoint.last_save_format: hf")
        self._init_distributed()
        self._claim_folders()  # rank 0: logging.dir writable, checkpoint.dir locked; every rank agrees
        self._setup_data()  # data headers, token ids vs the model's vocab, the sampler
        self._check_resume()  # the resume step's manifest, data position and world size: before the build
        if self.recipe is not None:
            # only touches torch_npu on npu; capability_check: warn warns once here, then waives the gate
            require_low_precision(self.recipe.format, self.device, capability_check=cfg.low_precision.capability_check)
        self.dtype = _DTYPES[t.param_dtype]
        torch.manual_seed(t.seed)
        with self._allocation_context():
            model = self._build_on_meta(cfg, hf_start)  # meta build, spec and HF-key checks, 8-bit weights (meta)
            # after every config check, so a bad input fails in seconds, before any native build
            self.quant_kernel = self._choose_quant_kernel()
            self._print_rank0(f" low precision: {describe_recipe(self.recipe)}")
            self.shard_plan = self._shard_on_meta(model)  # plan from meta shapes, refused before any allocation
            self._setup_step("allocate shards")
            model.to_empty(device=self.device)  # each rank allocates its own shards only
            if self.shard_plan is not None and self.shard_plan.replicated:  # to_empty made new parameters
                average_replicated_gradients(model, self.shard_plan, self.mesh)
            if cfg.activation_checkpoint.mode == "full":
                apply_activation_checkpointing(model, self.task.layer_types())
            self.model = model
            self._setup_step("optimizer state")
            self.optimizer = MasterWeightOptimizer.for_sharded_init(
                model, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay,
                max_grad_norm=t.clip_grad or None,
            )
            self._setup_step("initial values")
            self._initialize(hf_start)  # DCP resume, HF initial load or random init; then the 8-bit refresh

        self.logger = MetricsLogger(
            cfg.logging.dir,
            train_steps=t.train_steps,
            rank=self.rank,
            jsonl_name=cfg.logging.metrics_jsonl,
            tensorboard=cfg.logging.tensorboard,
            print_fn=self._print,
            fresh=self._resume_step is None,  # a fresh run in a used logging.dir starts a clean metrics.jsonl
        )
        self.logger.log_config(cfg.to_dict())
        flops_of = getattr(self.task, "flops_per_token", None)
        self.model_flops = flops_of(cfg) if flops_of is not None else None
        self.peak_tflops = t.peak_tflops or default_peak_tflops(
            self.recipe.format.value if self.recipe is not None else None, self.device.type)
        if self.stop is not None and cfg.checkpoint.save_on_sigterm:
            self.stop.graceful = True
        return self

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
            hf_weights.check_initial_keys(hf_start, model, self._hf_adapter)  # before any memory is allocated
        if self.recipe is not None:
            te_npu.quantize_weights_(model, self.recipe)
        assign_fqns(model)
        return model

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

    def _initialize(self, hf_start) -> None:
        """Write every master (and buffer) exactly once, then refresh the 8-bit shards from the
        masters: from the DCP step to resume, else the HF checkpoint, else the task's random init
        (each rank its own region of every full initial value). Buffers are set from the task's
        init first (a checkpoint without them keeps those)."""
        seed, model = self.cfg.training.seed, self.model
        with torch.no_grad():
            for fqn, buffer in model.named_buffers():
                buffer.copy_(self.task.initial_value(model, fqn, seed=seed))
        if self._resume_path is not None:
            self.load_dcp(self._resume_path, verified=True)
        elif hf_start is not None:
            self._load_initial_hf(hf_start)
        else:
            with self._kernels():
                self.optimizer.initialize_masters_(lambda fqn: self.task.initial_value(model, fqn, seed=seed))

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
        self._resume_path = preflight.resume_target(cfg.checkpoint)

    def _claim_folders(self) -> None:
        """Rank 0 (the only writer of logs and of the folder's top level) proves ``logging.dir``
        writable, locks ``checkpoint.dir`` and completes a save that died after it was published
        (``checkpoint_folder.finish_interrupted_save``); its ``ConfigError`` is raised on every rank."""
        cfg, error = self.cfg, None
        if self.rank == 0:
            try:
                preflight.check_writable(cfg.logging.dir, "logging.dir")
                self._lock = acquire_folder_lock(cfg.checkpoint.dir)  # also proves the folder writable
            except ConfigError as exc:
                error = str(exc)
            else:
                if self._lock.stale_holder is not None:
                    self._print(f" note: took over the lock of {cfg.checkpoint.dir}, left by a job that ended "
                                f"without releasing it ({describe_holder(self._lock.stale_holder)})")
                note = checkpoint_folder.finish_interrupted_save(cfg.checkpoint.dir)
                if note:
                    self._print(f" note: {note}")
        self._agree(error)

    def _agree(self, error: str | None) -> None:
        """Raise rank 0's ``ConfigError`` message (if any) on every rank; a sync point either way."""
        if self.world_size > 1:
            errors: list = [None] * self.world_size
            dist.all_gather_object(errors, error)
            error = errors[0]
        if error is not None:
            raise ConfigError(error)

    def _check_resume(self) -> None:
        """Verify the step to resume (collective) and that its data position maps onto this run;
        then, on rank 0, make it the head of the folder's history (``_settle_history``) and refuse
        a save or export plan that would overwrite what is not this run's (``_check_outputs``)."""
        c, t = self.cfg.checkpoint, self.cfg.training
        start = 0
        if self._resume_path is not None:
            checkpoint.verify_step(self._resume_path, checksums=c.verify_checksums)
            info = checkpoint.step_info(self._resume_path)
            extra = torch.load(os.path.join(self._resume_path, "extra_rank0.pt"), weights_only=True)
            try:
                if extra["data"] is not None:  # None: a converted step 0 (weights only), data from the start
                    self.batcher.position_for(extra["data"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(
                    f"checkpoint.dir: cannot resume {self._resume_path} (saved by {info.get('world_size')} ranks) on "
                    f"{self.world_size} rank(s) with this data config: {exc}"
                ) from None
            start, self.lineage = int(info["step"]), info.get("lineage")
            self._resume_step = start
            note = None if extra["data"] is None else recipe_change_note(info, self.recipe, os.path.basename(self._resume_path))
            if note is not None:  # a legitimate change between runs, never a silent one
                self._print_rank0(f" note: {note}")
        self.lineage = self.lineage or checkpoint.new_lineage()
        error = None
        if self.rank == 0:
            try:
                self._settle_history()
                self._check_outputs(start)
            except ConfigError as exc:
                error = str(exc)
        self._agree(error)

    def _settle_history(self) -> None:
        """Rank 0: resuming step K of this folder makes K its lineage's head: ``latest`` names it
        and the lineage's newer steps (a rollback's, or a restart's that redoes steps) move to
        ``abandoned/``, so no save of this run ever meets an old step directory."""
        if self._resume_path is None:
            return
        moved = checkpoint_folder.roll_back(self.cfg.checkpoint.dir, self._resume_path)
        if moved:
            names = ", ".join(os.path.basename(m) for m in moved)
            self._print(f" continuing from {os.path.basename(self._resume_path)}: this run's newer steps ({names}) "
                        f"were moved to {os.path.dirname(moved[0])} (kept; delete them when no longer needed)")

    def _check_outputs(self, start: int) -> None:
        """Rank 0: no planned save may replace another run's step; the HF export (if any) may
        replace only an earlier export of this run, and its folder must be writable."""
        c, t = self.cfg.checkpoint, self.cfg.training
        planned = preflight.planned_saves(start, t.train_steps, c.interval)
        preflight.check_step_collisions(c.dir, planned, self.lineage if self._resume_path else None,
                                        resuming=self._resume_path is not None)
        if c.last_save_format == "hf":
            preflight.check_export_dir(self._export_dir(t.train_steps), self.lineage,
                                       "checkpoint.export_dir" if c.export_dir else "checkpoint.last_save_format: hf")

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
            self._watch.start(t.collective_timeout_s, store=default_store(), rank=self.rank, world=self.world_size)
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

    def _setup_data(self) -> None:
        """The data kind's splits (rank 0 builds a cache first), their token ids against the model's
        vocabulary, the sampler; every problem a one-line ``ConfigError`` naming its ``data.*`` key."""
        t, d = self.cfg.training, self.cfg.data
        self.vocab_size = self.task.vocab_size(self.cfg)
        splits = None
        if DATA_KINDS[d.kind].writes_cache:
            if self.rank == 0:  # builds / verifies the cache before the others read it
                splits = build_splits(d, self.vocab_size, progress=True)
            self._barrier()
        splits = splits or build_splits(d, self.vocab_size)
        self.train_data, self.val_data = splits.train, splits.val
        for dataset, key in ((splits.train, splits.train_key), (splits.val, splits.val_key)):
            note = check_token_ids(dataset, self.vocab_size, key)
            if note:
                self._print_rank0(f" note: {note}")
        mapped_files.record(launch_env().mapped_files_dir, self.rank)  # the launcher's SIGBUS diagnosis
        run_samples = t.train_steps * t.micro_batch_size * t.gradient_accumulation_steps * self.world_size

        def batcher():
            try:
                return make_batcher(self.train_data, t.micro_batch_size, t.seq_len, seed=t.seed, rank=self.rank,
                                    world_size=self.world_size, shuffle=d.shuffle, vocab_size=self.vocab_size,
                                    run_samples=run_samples, start_sample=d.start_sample,
                                    train_samples=d.train_samples)
            except ValueError as exc:
                raise ConfigError(f"{splits.train_key} / training.seq_len / training.micro_batch_size: {exc}") from None

        made = None
        if getattr(self.train_data, "builds_index", False):  # Megatron's indices: rank 0 builds, the others map
            made = batcher() if self.rank == 0 else None
            self._barrier()
        self.batcher = made if made is not None else batcher()

    # ---- one step ----------------------------------------------------------------------------
    def forward_backward(self, batch: tuple[torch.Tensor, torch.Tensor], loss_scale: float = 1.0) -> torch.Tensor:
        """Loss of one micro-batch, with its gradient (times ``loss_scale``) accumulated."""
        input_ids, labels = (x.to(self.device, non_blocking=True) for x in batch)
        with self._kernels(), te_npu.autocast(enabled=self.recipe is not None, recipe=self.recipe):
            loss = self.task.loss(self.model, input_ids, labels)
            (loss * loss_scale).backward()
        return loss.detach()

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
        self._synchronize()
        start = time.perf_counter()
        with self._warm_up("step") as limit:  # each piece bounded by collective_timeout_s (warm-up: its own)
            with self._watch.phase("forward/backward", step + 1, limit_s=limit):
                losses = [self.forward_backward(b, 1.0 / len(micro_batches)) for b in micro_batches]
            with self._watch.phase("optimizer step", step + 1, limit_s=limit):
                result = self.optimizer_step()
            with self._watch.phase("loss all-reduce", step + 1, limit_s=limit):
                loss, self._stop_agreed = self._loss_and_stop(torch.stack(losses).float().mean())
                self._synchronize()
        elapsed = time.perf_counter() - start
        self.global_step += 1
        tokens = sum(b[0].numel() for b in micro_batches) * self.world_size
        return StepRecord(step + 1, loss, result.grad_norm, lr, result.updated, elapsed * 1e3, tokens / elapsed)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``training.eval_steps`` fixed batches (all ranks)."""
        t = self.cfg.training
        losses = []
        batches = validation_batches(
            self.val_data, t.micro_batch_size, t.seq_len, num_batches=t.eval_steps, rank=self.rank,
            world_size=self.world_size, vocab_size=self.vocab_size, seed=t.seed,
        )
        with self._warm_up("evaluation") as limit, self._watch.phase("evaluation", self.global_step, limit_s=limit), \
                self._kernels(), te_npu.autocast(enabled=self.recipe is not None, recipe=self.recipe):
            for input_ids, labels in batches:
                losses.append(self.task.loss(self.model, input_ids.to(self.device), labels.to(self.device)))
            return self._mean_over_ranks(torch.stack(losses).float().mean())

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
        if self._resume_step is not None:  # resumed: the steps after it are redone, each logged once
            self.logger.resume_at(self.global_step)
        if self.global_step >= t.train_steps:
            unfinished = self._unfinished_export()
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
            if step % t.log_interval == 0 or step == t.train_steps:
                self.logger.log_step(
                    step, lm_loss=record.lm_loss, lr=record.lr, grad_norm=record.grad_norm,
                    elapsed_ms=record.elapsed_ms, global_batch_size=global_batch,
                    consumed_samples=self.batcher.consumed_samples, tokens_per_s=record.tokens_per_s,
                    skipped_iterations=self.skipped_iterations, peak_mem_mb=peak_memory_mb(self.device),
                    **self._throughput(record),
                )
            try:
                guard.check(step, record.lm_loss, record.updated, record.grad_norm)
            except TrainingDiverged as exc:
                raise self._diverged(exc) from None
            if not guard.suspect:
                self._confirm_saves()  # this healthy loss vouches for every weight saved before it
            if self._stop_agreed:  # SIGTERM on some rank, combined over ranks with this step's loss
                self.save_dcp(prune=False)
                self._print_rank0(f" stopped on SIGTERM after iteration {step} (checkpoint saved)")
                return records
            if t.eval_interval and (step % t.eval_interval == 0 or step == t.train_steps):
                self.logger.log_validation(step, lm_loss=self.evaluate())
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
            self._unconfirmed.clear()
            if c.last_save_format == "hf":
                self.save_hf()
        if self.cfg.logging.plot and self.rank == 0:
            self._plot()
        return records

    def _confirm_saves(self) -> None:
        """The saved steps so far are good: prune their history down to ``keep_last``."""
        if self._unconfirmed:
            newest = self._unconfirmed[-1]
            self._unconfirmed.clear()
            checkpoint.prune(self.cfg.checkpoint.dir, self.cfg.checkpoint.keep_last, self.lineage, newest)

    def _diverged(self, exc: TrainingDiverged) -> TrainingDiverged:
        """The run stops: steps this run saved at or after ``began_at - 1`` (their weights gave
        the first bad loss or came after it) move to ``diverged/``, ``latest`` goes back to the
        newest good step; returns the error to raise, saying what happened (same on every rank)."""
        c, began = self.cfg.checkpoint, exc.began_at
        bad = [k for k in self._unconfirmed if began is not None and k >= began - 1]
        notes = ["nothing saved, no checkpoint pruned"]
        if bad:
            good = [k for k in self._saved if k not in bad]
            head = good[-1] if good else self._resume_step
            if self.rank == 0:
                checkpoint_folder.set_latest(c.dir, None if head is None else f"step_{head}")
                checkpoint_folder.set_aside(c.dir, [f"step_{k}" for k in bad], checkpoint_folder.DIVERGED)
            self._barrier()  # every rank raises this same error at this step; rank 0 has moved the steps
            notes.append(f"{', '.join(f'step_{k}' for k in bad)} (saved after the divergence began at iteration "
                         f"{began}) moved to {os.path.join(c.dir, checkpoint_folder.DIVERGED)}")
        if began is not None and self._resume_step is not None and self._resume_step >= began - 1:
            notes.append(f"the step this run resumed from (step_{self._resume_step}) already leads to it: resume "
                         "from an earlier step (checkpoint.load_step=N)")
        notes.append(self._latest_note())
        return TrainingDiverged(f"{exc}; {'; '.join(notes)}", began)

    # ---- checkpoints -------------------------------------------------------------------------
    def save_dcp(self, directory: str | None = None, *, prune: bool = True) -> str:
        """Atomic DCP save of BF16 weights, FP32 masters/moments, step, data position, RNG and the recipe
        (``te_npu.json`` ``low_precision``: format and MXFP8 scale rule, compared on resume).

        Refuses (``TrainingDiverged``) to save non-finite masters over the good checkpoints.
        ``prune``: apply ``checkpoint.keep_last`` now; ``train`` passes False and prunes once a
        later healthy loss vouches for the saved weights.
        """
        self._require_finite_masters()
        extra = {
            "data": self.batcher.state_dict(),
            "skipped_iterations": self.skipped_iterations,
            "rng": torch.get_rng_state(),
        }
        keep_last = (self.cfg.checkpoint.keep_last or None) if prune else None
        with self._watch.phase("checkpoint save", self.global_step, bounded=False):
            path = checkpoint.save(directory or self.cfg.checkpoint.dir, self.model, self.optimizer, self.global_step,
                                   extra, keep_last=keep_last, lineage=self.lineage, parent=self._parent_step,
                                   meta={"low_precision": recipe_record(self.recipe)})
        self._parent_step = self.global_step
        if directory is None or os.path.abspath(directory) == os.path.abspath(self.cfg.checkpoint.dir):
            self._saved.append(self.global_step)
            if not prune:
                self._unconfirmed.append(self.global_step)
        self._print_rank0(f" saved checkpoint at iteration {self.global_step} to {path}")
        return path

    def load_dcp(self, directory: str | None = None, *, verified: bool = False) -> int:
        """Restore the latest checkpoint (or a step dir): masters, moments, step, data position,
        skipped count, RNG; rebuild 8-bit shards. ``verified``: the manifest was checked already."""
        path = checkpoint.latest_checkpoint(directory or self.cfg.checkpoint.dir)
        with self._kernels():  # rebuilds the 8-bit shards from the loaded masters
            step, extra = checkpoint.load(path, self.model, self.optimizer, verify=not verified,
                                          checksums=self.cfg.checkpoint.verify_checksums)
        self.global_step = int(step)
        self.lineage = checkpoint.step_info(path).get("lineage") or self.lineage
        self._parent_step = self.global_step
        if extra["data"] is not None:  # None: a converted step 0 (weights only): data and RNG as a fresh run
            self.batcher.load_state_dict(extra["data"])
        self.skipped_iterations = int(extra["skipped_iterations"])
        if extra["rng"] is not None:
            torch.set_rng_state(extra["rng"])
        self._print_rank0(f" resumed from checkpoint at iteration {self.global_step} ({path}, consumed samples "
                          f"{self.batcher.consumed_samples})")
        return self.global_step

    def save_hf(self, directory: str | None = None) -> str:
        """Export the FP32 masters (cast to ``checkpoint.export_dtype``) and buffers as a Hugging
        Face directory (default ``checkpoint.export_dir`` or ``<checkpoint.dir>/hf/step_<N>``),
        carrying ``checkpoint.initial_load_path``'s config fields and tokenizer files; it replaces
        only an earlier export of this run (``hf_weights.export_weights``)."""
        c = self.cfg.checkpoint
        directory = directory or self._export_dir(self.global_step)
        adapter = hf_weights.hf_adapter_of(self.task, self.cfg, where="checkpoint.last_save_format: hf")
        with self._watch.phase("HF export", self.global_step, bounded=False):
            report = hf_weights.export_weights(directory, self.model, self.optimizer, adapter, dtype=c.export_dtype,
                                               max_shard_mb=c.export_max_shard_mb, progress=self.rank == 0,
                                               owner={"lineage": self.lineage, "step": self.global_step},
                                               source=c.initial_load_path)
        self._print_rank0(f" exported Hugging Face weights at iteration {self.global_step} to {report.directory} "
                          f"({len(report.files)} file(s), {report.total_bytes / 2**20:.1f} MiB, {c.export_dtype})"
                          f"{'; it replaces the interrupted export left in ' + report.directory + '.tmp' if report.completed else ''}")
        if report.kept:
            self._print_rank0(f" note: kept {', '.join(report.kept)} in {report.directory}: not written by the earlier "
                              "export of this run it replaces, so left as it was")
        return report.directory

    def _unfinished_export(self) -> str | None:
        """What is wrong with the HF export of this step (rank 0's view, on every rank), or None:
        complete, or no export configured."""
        if self.cfg.checkpoint.last_save_format != "hf":
            return None
        state = [export_state(self._export_dir(self.global_step), {"lineage": self.lineage, "step": self.global_step})
                 if self.rank == 0 else None]
        if self.world_size > 1:
            dist.broadcast_object_list(state, src=0)
        return state[0]

    def _export_dir(self, step: int) -> str:
        c = self.cfg.checkpoint
        return c.export_dir or os.path.join(c.dir, "hf", f"step_{step}")

    def _open_initial_hf(self, cfg: TrainConfig):
        self._hf_adapter = hf_weights.hf_adapter_of(self.task, cfg, where="checkpoint.initial_load_path")
        return hf_weights.open_initial_checkpoint(cfg.checkpoint.initial_load_path, self._hf_adapter)

    def _load_initial_hf(self, checkpoint) -> None:
        with self._kernels():  # re-quantizes the 8-bit weights from the loaded masters
            report = hf_weights.load_initial_weights(checkpoint, self.model, self.optimizer, self._hf_adapter,
                                                     progress=self.rank == 0)
        self.hf_read_report = report
        self._print_rank0(f" started from Hugging Face weights {checkpoint.path}: rank 0 read "
                          f"{report.bytes_read / 2**20:.1f} of {report.checkpoint_bytes / 2**20:.1f} MiB (its shards)")
        note = hf_weights.left_out_note(checkpoint, self._hf_adapter)
        if note:
            self._print_rank0(f" note: {note}")

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
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # ---- helpers -----------------------------------------------------------------------------
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
        from te_npu.training.metrics.plots import plot_runs, read_run

        out = Path(self.cfg.logging.dir) / "curves.png"
        plot_runs([(Path(self.cfg.logging.dir).name, read_run(Path(self.cfg.logging.dir), self.cfg.logging.metrics_jsonl))], out)
        self._print_rank0(f" wrote {out}")

    def _loss_and_stop(self, loss: torch.Tensor) -> tuple[float, bool]:
        """Mean loss over ranks and whether any rank asked to stop (one all-reduce for both)."""
        stop = float(self.stop is not None and self.stop.signum is not None)
        if self.world_size == 1:
            return float(loss), bool(stop)
        both = torch.stack([loss.detach().float(), torch.tensor(stop)]).to(self._collective_device())
        dist.all_reduce(both)
        return float(both[0] / self.world_size), bool(both[1] > 0)

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
                f"refusing to save them over the good checkpoints ({self._latest_note()})"
            )

    def _latest_note(self) -> str:
        try:
            return f"latest complete checkpoint: {checkpoint.latest_checkpoint(self.cfg.checkpoint.dir)}"
        except ConfigError:
            return f"no checkpoint in {self.cfg.checkpoint.dir} yet"

    def _mean_over_ranks(self, value: torch.Tensor) -> float:
        if self.world_size > 1:
            value = value.to(self._collective_device())
            dist.all_reduce(value)
            value = value / self.world_size
        return float(value)

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


def _other_dtype_modules(model: nn.Module, dtype: torch.dtype) -> list[nn.Module]:
    """Modules (not TE modules) owning a parameter not in ``dtype`` (e.g. the FP32 router of a
    BF16 model). FSDP2 needs one original dtype per parameter group, so each is its own unit."""
    return [
        m for m in model.modules()
        if m is not model and not isinstance(m, TEModule) and any(p.dtype != dtype for p in m.parameters(recurse=False))
    ]

