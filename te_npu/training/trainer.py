"""Trainer: builds a model in the spec's order (section 12.1) and runs Megatron-style steps.

Model-agnostic: a ``TrainTask`` says how to build, validate, initialise and score one model
family (DeepSeek-V3's is ``models/deepseek_v3/pretrain.py``). Build order of ``setup``:

    process group -> capability gate -> meta build -> spec validation -> materialize + init
    -> finalize low-precision weights -> shard validation + FSDP2 -> activation checkpointing
    -> FP32-master optimizer -> data -> DCP resume

One optimizer step = ``gradient_accumulation_steps`` calls of ``forward_backward`` (FSDP2
reduce-scatters each micro-batch's gradients; weights are never re-quantized between them),
then ``optimizer_step`` (global grad norm, skip when non-finite, clip, AdamW on FP32
masters, refresh every 8-bit shard once).
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

import torch
import torch.distributed as dist
from torch import nn

import te_npu
from te_npu.distributed import (
    MasterWeightOptimizer,
    StepResult,
    checkpoint,
    finalize_low_precision_weights,
    record_gathers,
    shard_model,
    validate_parallel_config,
)
from te_npu.distributed.sharding import TE_MODULE_TYPES
from te_npu.errors import ConfigError
from te_npu.modules.base import assign_fqns
from te_npu.ops import observe, require_low_precision
from te_npu.training import hf_weights
from te_npu.training.config import TrainConfig
from te_npu.training.data import TokenBatcher, build_datasets, validation_batches
from te_npu.training.metrics_log import MetricsLogger, peak_memory_mb
from te_npu.training.probe import STProbe
from te_npu.training.recompute import apply_activation_checkpointing
from te_npu.training.schedule import lr_at

__all__ = ["TrainTask", "Trainer", "StepRecord"]

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class TrainTask(Protocol):
    """How to build and score one model family."""

    def build(self, cfg: TrainConfig, dtype: torch.dtype) -> nn.Module:
        """Construct the model; called under ``torch.device("meta")`` (must allocate nothing)."""

    def validate(self, model: nn.Module, cfg: TrainConfig) -> None:
        """Check the built structure against the requested spec (raise ``ConfigError``)."""

    def materialize(self, model: nn.Module, *, seed: int, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate on ``device`` and initialise deterministically from ``seed``."""

    def layer_types(self) -> tuple[type[nn.Module], ...]:
        """Module types that are FSDP2 units and activation-recompute units (decoder layers)."""

    def low_precision_scope(self, model: nn.Module) -> list[str]:
        """FQNs of the model's TE modules."""

    def loss(self, model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Scalar training loss of one micro-batch."""

    # Optional: ``hf_adapter(cfg) -> te_npu.training.hf_weights.HFAdapter`` lets the run start
    # from (``checkpoint.initial_load_path``) and export to (``last_save_format: hf``) Hugging Face.


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

    def __init__(self, task: TrainTask, *, print_fn=print) -> None:
        self.task = task
        self.probe: STProbe | None = None
        self._print = print_fn
        self.global_step = 0
        self.skipped_iterations = 0
        self.grad_norm: float | None = None
        self._owns_process_group = False

    def register_test_probe(self, probe: STProbe) -> None:
        """Attach a read-only ``STProbe`` (before ``setup``)."""
        self.probe = probe

    # ---- build -------------------------------------------------------------------------------
    def setup(self, cfg: TrainConfig) -> Trainer:
        """Build everything in the spec's order; resume from the latest DCP checkpoint if asked."""
        self.cfg, t = cfg, cfg.training
        self.recipe = cfg.low_precision.recipe
        validate_parallel_config(comm_fusion=cfg.fsdp_config.comm_fusion)
        _check_resume_path(cfg.checkpoint)  # a non-DCP resume path fails here, before anything is built
        c = cfg.checkpoint
        resuming = c.resume is True or (c.resume == "auto" and _has_checkpoint(c.dir))
        hf_start = self._open_initial_hf(cfg) if cfg.checkpoint.initial_load_path and not resuming else None
        if cfg.checkpoint.last_save_format == "hf":  # an export the task cannot write fails now, not after training
            hf_weights.hf_adapter_of(self.task, cfg, where="checkpoint.last_save_format: hf")
        self._init_distributed()
        if self.recipe is not None:
            require_low_precision(self.recipe.format, self.device)  # only touches torch_npu on npu
        self.dtype = _DTYPES[t.param_dtype]
        torch.manual_seed(t.seed)

        with torch.device("meta"):
            model = self.task.build(cfg, self.dtype)
        self.task.validate(model, cfg)
        if hf_start is not None:
            hf_weights.check_initial_keys(hf_start, model, self._hf_adapter)  # before any memory is allocated
        self.task.materialize(model, seed=t.seed, device=self.device, dtype=self.dtype)
        assign_fqns(model)
        initial = finalize_low_precision_weights(model, self.recipe) if self.recipe is not None else {}
        self.shard_plan = None
        if self.world_size > 1:
            mesh = torch.distributed.device_mesh.init_device_mesh(self.device.type, (self.world_size,))
            self.shard_plan = shard_model(
                model,
                mesh,
                reshard_after_forward=cfg.fsdp_config.reshard_after_forward,
                fallback_to_unsharded=cfg.fsdp_config.fallback_to_unsharded,
                comm_fusion=cfg.fsdp_config.comm_fusion,
                layer_types=self.task.layer_types(),
                unit_types=TE_MODULE_TYPES + _other_dtype_module_types(model, self.dtype),
            )
        if cfg.activation_checkpoint.mode == "full":
            apply_activation_checkpointing(model, self.task.layer_types())
        self.model = model
        self.optimizer = MasterWeightOptimizer(
            model,
            initial,
            lr=t.lr,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps,
            weight_decay=t.weight_decay,
            max_grad_norm=t.clip_grad or None,
        )
        del initial  # the masters now hold the only high-precision copy of the 8-bit weights
        if self.probe is not None:
            self.probe.on_setup(model, self.task.low_precision_scope(model))
            self.optimizer.add_refresh_hook(self.probe.on_refresh)
        if hf_start is not None:
            self._load_initial_hf(hf_start)

        self._setup_data()
        self.logger = MetricsLogger(
            cfg.logging.dir,
            train_steps=t.train_steps,
            rank=self.rank,
            jsonl_name=cfg.logging.metrics_jsonl,
            tensorboard=cfg.logging.tensorboard,
            print_fn=self._print,
        )
        self.logger.log_config(cfg.to_dict())
        resume = cfg.checkpoint.resume
        if resume is True or (resume == "auto" and _has_checkpoint(cfg.checkpoint.dir)):
            self.load_dcp(cfg.checkpoint.dir)
        return self

    def _init_distributed(self) -> None:
        t = self.cfg.training
        device_type = t.device
        if device_type == "npu":
            import torch_npu  # noqa: F401  (registers the npu device; only on the npu path)
        backend = _BACKENDS[device_type] if t.backend == "auto" else t.backend
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group(backend=backend)
            self._owns_process_group = True
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        if self.cfg.fsdp_config.dp_shard_size != self.world_size:
            raise ConfigError(
                f"fsdp_config.dp_shard_size: {self.cfg.fsdp_config.dp_shard_size} does not match the "
                f"{self.world_size} launched rank(s); FSDP2 shards over every rank (no replication groups)"
            )
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device_type == "cpu":
            self.device = torch.device("cpu")
        else:
            getattr(torch, device_type).set_device(local_rank)
            self.device = torch.device(device_type, local_rank)

    def _setup_data(self) -> None:
        t, d = self.cfg.training, self.cfg.data
        if self.rank == 0:
            build_datasets(d)  # build / verify the cache once before the other ranks read it
        self._barrier()
        self.train_data, self.val_data = build_datasets(d)
        self.batcher = TokenBatcher(
            self.train_data,
            t.micro_batch_size,
            t.seq_len,
            seed=t.seed,
            rank=self.rank,
            world_size=self.world_size,
            shuffle=d.shuffle,
        )

    # ---- one step ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _probing(self) -> Iterator[None]:
        if self.probe is None:
            yield
            return
        with observe(self.probe.on_ops_event), record_gathers(self.probe.on_gather):
            yield

    def forward_backward(self, batch: tuple[torch.Tensor, torch.Tensor], loss_scale: float = 1.0) -> torch.Tensor:
        """Loss of one micro-batch, with its gradient (times ``loss_scale``) accumulated."""
        input_ids, labels = (x.to(self.device, non_blocking=True) for x in batch)
        with self._probing(), te_npu.autocast(enabled=self.recipe is not None, recipe=self.recipe):
            loss = self.task.loss(self.model, input_ids, labels)
            (loss * loss_scale).backward()
        return loss.detach()

    def optimizer_step(self) -> StepResult:
        """Clip, update the FP32 masters and refresh 8-bit weights; skip if gradients are non-finite."""
        with self._probing():
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
        if self.probe is not None:
            self.probe.begin_optimizer_step(step)
        lr = self.set_lr(step)
        self._synchronize()
        start = time.perf_counter()
        losses = [self.forward_backward(b, 1.0 / len(micro_batches)) for b in micro_batches]
        result = self.optimizer_step()
        loss = self._mean_over_ranks(torch.stack(losses).float().mean())
        self._synchronize()
        elapsed = time.perf_counter() - start
        if self.probe is not None:
            self.probe.end_optimizer_step(updated=result.updated)
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
            world_size=self.world_size,
        )
        with te_npu.autocast(enabled=self.recipe is not None, recipe=self.recipe):
            for input_ids, labels in batches:
                losses.append(self.task.loss(self.model, input_ids.to(self.device), labels.to(self.device)))
        return self._mean_over_ranks(torch.stack(losses).float().mean())

    # ---- loop --------------------------------------------------------------------------------
    def train(self) -> list[StepRecord]:
        """Run until ``training.train_steps``; log, evaluate, checkpoint and plot on the way."""
        t, c = self.cfg.training, self.cfg.checkpoint
        records = []
        if self.global_step >= t.train_steps:
            self._print_rank0(f" training already complete at iteration {self.global_step}; nothing to do")
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
                )
            if t.eval_interval and (step % t.eval_interval == 0 or step == t.train_steps):
                self.logger.log_validation(step, lm_loss=self.evaluate())
            if c.interval and step % c.interval == 0 and step != t.train_steps:
                self.save_dcp()
        if records:
            self.save_dcp()
            if c.last_save_format == "hf":
                self.save_hf()
        if self.cfg.logging.plot and self.rank == 0:
            self._plot()
        return records

    # ---- checkpoints -------------------------------------------------------------------------
    def save_dcp(self, directory: str | None = None) -> str:
        """Atomic DCP save of BF16 weights, FP32 masters/moments, step, data position and RNG."""
        extra = {
            "data": self.batcher.state_dict(),
            "skipped_iterations": self.skipped_iterations,
            "rng": torch.get_rng_state(),
        }
        path = checkpoint.save(directory or self.cfg.checkpoint.dir, self.model, self.optimizer, self.global_step,
                               extra, keep_last=self.cfg.checkpoint.keep_last or None)
        self._print_rank0(f" saved checkpoint at iteration {self.global_step} to {path}")
        return path

    def load_dcp(self, directory: str | None = None) -> int:
        """Restore the latest checkpoint: masters, moments, step, data position; rebuild 8-bit shards."""
        step, extra = checkpoint.load(directory or self.cfg.checkpoint.dir, self.model, self.optimizer)
        self.global_step = int(step)
        if extra:
            self.batcher.load_state_dict(extra["data"])
            self.skipped_iterations = int(extra.get("skipped_iterations", 0))
            torch.set_rng_state(extra["rng"])
        self._print_rank0(f" resumed from checkpoint at iteration {self.global_step}")
        return self.global_step

    def save_hf(self, directory: str | None = None) -> str:
        """Export the FP32 masters (cast to ``checkpoint.export_dtype``) and buffers as a Hugging
        Face directory (default ``checkpoint.export_dir`` or ``<checkpoint.dir>/hf/step_<N>``)."""
        c = self.cfg.checkpoint
        directory = directory or c.export_dir or os.path.join(c.dir, "hf", f"step_{self.global_step}")
        adapter = hf_weights.hf_adapter_of(self.task, self.cfg, where="checkpoint.last_save_format: hf")
        report = hf_weights.export_weights(directory, self.model, self.optimizer, adapter, dtype=c.export_dtype,
                                           max_shard_mb=c.export_max_shard_mb, progress=self.rank == 0)
        self._print_rank0(f" exported Hugging Face weights at iteration {self.global_step} to {report.directory} "
                          f"({len(report.files)} file(s), {report.total_bytes / 2**20:.1f} MiB, {c.export_dtype})")
        return report.directory

    def _open_initial_hf(self, cfg: TrainConfig):
        self._hf_adapter = hf_weights.hf_adapter_of(self.task, cfg, where="checkpoint.initial_load_path")
        return hf_weights.open_initial_checkpoint(cfg.checkpoint.initial_load_path, self._hf_adapter)

    def _load_initial_hf(self, checkpoint) -> None:
        report = hf_weights.load_initial_weights(checkpoint, self.model, self.optimizer, self._hf_adapter,
                                                 progress=self.rank == 0)
        self.hf_read_report = report
        self._print_rank0(f" started from Hugging Face weights {checkpoint.path}: rank 0 read "
                          f"{report.bytes_read / 2**20:.1f} of {report.checkpoint_bytes / 2**20:.1f} MiB (its shards)")

    def close(self) -> None:
        """Close logs; tear down the process group if this trainer created it."""
        if hasattr(self, "logger"):
            self.logger.close()
        if self._owns_process_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    # ---- helpers -----------------------------------------------------------------------------
    def _plot(self) -> None:
        from te_npu.training.plots import plot_runs, read_run

        out = Path(self.cfg.logging.dir) / "curves.png"
        plot_runs([(Path(self.cfg.logging.dir).name, read_run(Path(self.cfg.logging.dir), self.cfg.logging.metrics_jsonl))], out)
        self._print_rank0(f" wrote {out}")

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


def _other_dtype_module_types(model: nn.Module, dtype: torch.dtype) -> tuple[type[nn.Module], ...]:
    """Types of modules owning a parameter not in ``dtype`` (e.g. the FP32 router of a BF16 model).

    FSDP2 needs one original dtype per parameter group, so each such module becomes its own unit.
    """
    types = {
        type(m) for m in model.modules()
        if m is not model and any(p.dtype != dtype for p in m.parameters(recurse=False))
    }
    return tuple(sorted(types - set(TE_MODULE_TYPES), key=lambda t: t.__qualname__))


def _check_resume_path(c) -> None:
    """``checkpoint.resume`` true (or ``auto`` with something at ``checkpoint.dir``) needs a te_npu DCP checkpoint."""
    if c.resume is False or (c.resume == "auto" and not (os.path.isfile(c.dir) or _has_checkpoint(c.dir))):
        return
    try:
        checkpoint.latest_checkpoint(c.dir)
    except ConfigError as exc:
        raise ConfigError(f"checkpoint.dir (checkpoint.resume: {str(c.resume).lower()}): {exc}") from None


def _has_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "latest"))
