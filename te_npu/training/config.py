"""Training configuration: one YAML file -> a frozen, fully validated ``TrainConfig``.

``load_config(path_or_dict, overrides, model_section=task.model_section)`` is the entry point.
Everything that the configuration alone can reject is rejected there, before any model,
process group or tensor exists, with a one-line ``te_npu.ConfigError`` that names the full
key path (``fsdp_config.comm_fusion``, ``parallel.tensor_parallel_size``, ``checkpoint.format``
...): unknown keys at any depth, wrong types, out-of-range values (the schema engine,
``te_npu.training.schema``) and the configuration rows of the fail-fast list
(docs/numerics-and-limits.md, Limits: "Not supported"), each stated once, where the code that depends on it lives:

- low-precision format / scaling other than ``mxfp8_e4m3 + mx_block`` / ``hif8 + current``,
  keys other than ``enabled / format / scaling / scale_alg``, ``scale_alg`` other than ``ceil`` /
  ``floor`` or with HiF8: ``te_npu.recipe.recipe_from_config``
  (here with ``check_disabled=True``: checked even when ``enabled: false``);
- TP/CP/EP/PP > 1 and FSDP ``comm_fusion: true``: ``te_npu.distributed.sharding.
  validate_parallel_config`` (which ``shard_model`` runs too);
- a checkpoint format other than DCP, activation recompute other than ``off`` / ``full``: the
  ``Literal`` types of ``checkpoint.format`` / ``activation_checkpoint.mode`` below;
- the model (which one, its fields, the frozen 16B spec): the model task's ``model`` section.

The ``model`` section belongs to the model task, not to this module: its schema is a section
class the task declares (``TrainTask.model_section``; DeepSeek-V3's is
``models.deepseek_v3.model_section.DeepseekV3ModelSection``). Loaded without one, the section
stays the frozen mapping as written and ``Trainer.setup`` applies the task's schema
(``TrainConfig.with_model_section``) before anything else, so a bad model section still fails
before the model is built.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, get_type_hints

from te_npu.distributed.sharding import validate_parallel_config
from te_npu.errors import ConfigError
from te_npu.observer import ObserverConfig
from te_npu.ops.capability import CAPABILITY_CHECKS
from te_npu.ops.kernels import quant_kernel_device_problem
from te_npu.recipe import Recipe, recipe_from_config
from te_npu.training.data import check_data_config
from te_npu.training.schema import (
    apply_overrides,
    build_mapping,
    build_section,
    freeze,
    option,
    read_config,
    reject_unknown,
    section_to_dict,
    thaw,
)

__all__ = [
    "TrainConfig",
    "LowPrecisionConfig",
    "FSDPConfig",
    "ParallelConfig",
    "TrainingConfig",
    "ActivationCheckpointConfig",
    "CheckpointConfig",
    "DataConfig",
    "LoggingConfig",
    "BACKENDS_BY_DEVICE",
    "load_config",
]

_UNSUPPORTED = "see docs/numerics-and-limits.md, Limits"

BACKENDS_BY_DEVICE: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"cpu": ("gloo",), "cuda": ("nccl", "gloo"), "npu": ("hccl",)}
)
"""``training.device`` -> the process-group backends that can drive it; the first is what
``training.backend: auto`` means."""


# ---------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LowPrecisionConfig:
    """The ``low_precision`` section as written, and the recipe it means (None = BF16 baseline).

    Its rules are the recipe parser's (``te_npu.recipe_from_config``), applied to the format
    and scaling even when ``enabled: false``.
    """

    section: Mapping[str, Any]
    recipe: Recipe | None
    capability_check: str = "strict"
    """``strict`` (default): an NPU that fails the capability gate is refused; ``warn``: the run
    goes on with a loud warning naming each failed check (``te_npu.ops.capability``)."""

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], path: str) -> LowPrecisionConfig:
        recipe_keys = {k: v for k, v in raw.items() if k != "capability_check"} if isinstance(raw, Mapping) else raw
        check = raw.get("capability_check", "strict") if isinstance(raw, Mapping) else "strict"
        if check not in CAPABILITY_CHECKS:
            raise ConfigError(f"{path}.capability_check: {check!r} is not supported; allowed values are "
                              f"{list(CAPABILITY_CHECKS)}")
        return cls(section=freeze(dict(raw)), recipe=recipe_from_config(recipe_keys, path=path, check_disabled=True),
                   capability_check=check)

    def to_config(self) -> dict[str, Any]:
        return thaw(self.section)

    @property
    def enabled(self) -> bool:
        return self.recipe is not None

    @property
    def format(self) -> str | None:
        return None if self.recipe is None else self.recipe.format.value


@dataclass(frozen=True)
class FSDPConfig:
    """FSDP2 sharding. ``comm_fusion`` exists only to be rejected (``validate_parallel_config``). ``dp_shard_size`` ranks share one copy of the model (each
    parameter sharded over them); ``dp_replicate_size`` > 1 is HSDP: that many copies, each
    sharded over its own ``dp_shard_size`` ranks (``te_npu.distributed.mesh``); their product is
    the world size."""

    dp_shard_size: int = option(1, ge=1)
    dp_replicate_size: int = option(1, ge=1)
    reshard_after_forward: bool = True
    comm_fusion: bool = False
    fallback_to_unsharded: bool = False

    def __post_init__(self) -> None:
        validate_parallel_config(comm_fusion=self.comm_fusion)


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel sizes; all must be 1 (``validate_parallel_config``: TP / CP / EP / PP are not implemented)."""

    tensor_parallel_size: int = option(1, ge=1)
    context_parallel_size: int = option(1, ge=1)
    expert_parallel_size: int = option(1, ge=1)
    pipeline_parallel_size: int = option(1, ge=1)

    def __post_init__(self) -> None:
        validate_parallel_config(
            tensor_parallel=self.tensor_parallel_size,
            context_parallel=self.context_parallel_size,
            expert_parallel=self.expert_parallel_size,
            pipeline_parallel=self.pipeline_parallel_size,
        )


@dataclass(frozen=True)
class TrainingConfig:
    """Optimisation and run settings. ``clip_grad`` is the max global grad norm (0 disables);
    ``eval_interval`` 0 disables evaluation; ``backend: auto`` picks the first backend of
    ``BACKENDS_BY_DEVICE[device]`` (gloo / nccl / hccl; ``resolved_backend``).

    Stopping a dead run (``te_npu.training.guards.divergence``): ``max_consecutive_skipped_steps``
    optimizer steps in a row skipped for non-finite gradients stop it (0: never);
    ``stop_on_nonfinite_loss`` stops it at the first non-finite training loss;
    ``max_loss_factor`` stops it, from the first step, when a loss exceeds that factor times
    ``ln(vocab_size)`` (a uniform prediction's loss; 0: off); ``collapse_steps`` when that many
    steps in a row have a zero grad norm or a loss flat at ``ln(vocab_size)`` (0: off);
    ``loss_spike_factor`` when a loss exceeds that factor times the median of the previous 20
    (0: off). A stopped run saves nothing, keeps no checkpoint saved after the divergence began
    as good, and exits non-zero.

    ``collective_timeout_s``: the longest any rank waits for its peers, in one collective or one
    step: the process group's timeout, and the stall watch's (``te_npu.training.guards.stall``: a rank
    whose peer sends no heartbeat, or that spends a step waiting, that long names the stalled
    rank in one line and ends the job with exit code 4). The default, 600 s, is Megatron's and
    NCCL's 10 minutes: far above a 16B step on 8x A5, a resume's verification or an HF load of
    16B split over the ranks; raise it for storage so slow that one collective inside a save
    waits longer.

    ``first_step_timeout_s``: the same limit for warm-up: setup, the first step of each process
    (a fresh start or a resume) and its first evaluation, where a compile (``quant_kernel:
    compiled``), a graph build or communicator setup can take far longer than a step. The process
    group's timeout is this during warm-up and ``collective_timeout_s`` after it; the stall
    watch's step limit likewise (a silent peer is still a stall at ``collective_timeout_s``).
    Default 1800 s; never less than ``collective_timeout_s``.

    ``quant_kernel``: which bit-identical kernels the emulation quantizes and decodes with
    (``te_npu.ops.kernels``), chosen once per run and logged by rank 0: ``eager`` (torch, the
    reference), ``compiled`` (torch.compile of it; cpu / cuda), ``native`` (C++ CPU kernels), or
    ``auto``: ``native`` for a CPU run with a low-precision recipe when the kernels build here,
    else ``eager``, saying why. A named kernel that cannot run raises; the losses are the same bits.

    ``peak_tflops``: one device's peak TFLOP/s for the run's format, the denominator of the MFU
    the step line reports (``te_npu.training.metrics.throughput``); null: Ascend 950's (1000 for MXFP8 /
    HiF8, none published for BF16) on an ``npu`` device, no MFU elsewhere.
    """

    seed: int = option(1234, ge=0)
    micro_batch_size: int = option(1, ge=1)
    seq_len: int = option(1024, ge=1)
    gradient_accumulation_steps: int = option(1, ge=1)
    train_steps: int = option(1000, ge=1)
    lr: float = option(3e-4, gt=0.0)
    min_lr: float = option(0.0, ge=0.0)
    warmup_steps: int = option(0, ge=0)
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = option(0.1, ge=0.0)
    adam_beta1: float = option(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = option(0.95, ge=0.0, lt=1.0)
    adam_eps: float = option(1e-8, gt=0.0)
    clip_grad: float = option(1.0, ge=0.0)
    eval_interval: int = option(0, ge=0)
    eval_steps: int = option(1, ge=1)
    log_interval: int = option(1, ge=1)
    device: Literal["cpu", "cuda", "npu"] = "cpu"
    backend: Literal["gloo", "nccl", "hccl", "auto"] = "auto"
    param_dtype: Literal["bf16", "fp32"] = "bf16"
    max_consecutive_skipped_steps: int = option(10, ge=0)
    stop_on_nonfinite_loss: bool = True
    loss_spike_factor: float = option(10.0, ge=0.0)
    max_loss_factor: float = option(10.0, ge=0.0)
    collapse_steps: int = option(3, ge=0)
    collective_timeout_s: float = option(600.0, gt=0.0)
    first_step_timeout_s: float = option(1800.0, gt=0.0)
    quant_kernel: Literal["auto", "eager", "compiled", "native"] = "auto"
    peak_tflops: float | None = option(None, gt=0.0)

    def __post_init__(self) -> None:
        if self.min_lr > self.lr:
            raise ConfigError(f"training.min_lr: {self.min_lr} must be <= training.lr ({self.lr})")
        allowed = BACKENDS_BY_DEVICE[self.device]
        if self.backend != "auto" and self.backend not in allowed:
            raise ConfigError(f"training.backend: {self.backend!r} cannot drive device {self.device!r}; use one of "
                              f"{list(allowed)} or 'auto'")
        kernel_problem = quant_kernel_device_problem(self.quant_kernel, self.device)
        if kernel_problem:
            raise ConfigError(f"training.quant_kernel: {kernel_problem} (training.device is {self.device!r})")
        if 0 < self.loss_spike_factor <= 1:
            raise ConfigError(f"training.loss_spike_factor: {self.loss_spike_factor} must be 0 (off) or > 1")
        if 0 < self.max_loss_factor <= 1:
            raise ConfigError(f"training.max_loss_factor: {self.max_loss_factor} must be 0 (off) or > 1 (a multiple "
                              "of ln(vocab_size), the loss of a uniform prediction)")

    @property
    def resolved_backend(self) -> str:
        """The process-group backend: ``backend``, with ``auto`` resolved from ``device``."""
        return BACKENDS_BY_DEVICE[self.device][0] if self.backend == "auto" else self.backend


@dataclass(frozen=True)
class ActivationCheckpointConfig:
    """Activation recompute: ``off`` or ``full`` (every decoder layer); nothing else (selective recompute is not implemented)."""

    mode: Literal["off", "full"] = option("off", reason=f"only 'off' and 'full' recompute are supported, {_UNSUPPORTED}")


@dataclass(frozen=True)
class CheckpointConfig:
    """DCP checkpoints. ``interval`` 0 disables saving; ``keep_last`` 0 keeps every one (pruning
    only ever deletes older steps of this run); ``resume``: false, true (a checkpoint must exist)
    or ``auto`` (resume if one exists; a folder with steps but no ``latest`` is an error).

    ``load_step``: resume from ``step_{N}`` instead of ``latest`` (e.g. the previous complete
    step when ``latest`` is damaged). ``verify_checksums``: check every file's CRC-32 against the
    step's manifest before loading (sizes are always checked). ``save_on_sigterm``: on SIGTERM,
    finish the current step, save, then exit (default false, as Megatron's
    ``--exit-signal-handler``: under torchrun the save must fit in its 30 s shutdown grace).

    Hugging Face in and out: ``initial_load_path`` (an HF safetensors directory, format
    ``initial_load_format: hf``) starts a run that does not resume from it: its weights become
    the FP32 masters; a run that resumes ignores it. ``last_save_format: hf`` also exports the
    final weights as an HF directory (``export_dir``, default ``<dir>/hf/step_<N>``) in
    ``export_dtype``, files of at most ``export_max_shard_mb`` MiB, next to the final DCP save.
    """

    dir: str = "checkpoints"
    interval: int = option(0, ge=0)
    resume: bool | Literal["auto"] = False
    format: Literal["dcp"] = option("dcp", reason=f"only high-precision DCP checkpoints are supported, {_UNSUPPORTED}")
    keep_last: int = option(0, ge=0)
    load_step: int | None = option(None, ge=0)
    verify_checksums: bool = True
    save_on_sigterm: bool = False
    initial_load_path: str | None = None
    initial_load_format: Literal["hf"] = option("hf", reason="a run starts from a Hugging Face safetensors directory")
    last_save_format: Literal["dcp", "hf"] = "dcp"
    export_dir: str | None = None
    export_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    export_max_shard_mb: int = option(5000, ge=1)

    def __post_init__(self) -> None:
        if not self.dir:
            raise ConfigError("checkpoint.dir: must not be empty (the final checkpoint is always saved)")
        if self.load_step is not None and self.resume is False:
            raise ConfigError(f"checkpoint.load_step: {self.load_step} needs checkpoint.resume true or auto")


@dataclass(frozen=True)
class DataConfig:
    """Training tokens; ``kind`` picks the reader (``te_npu.training.data.DATA_KINDS``, which also
    holds each kind's rules: a key another kind reads is refused).

    ``kind: stdlib``: the running interpreter's standard-library ``.py`` sources, byte-level
    (vocab 256), first ``max_bytes`` bytes in sorted path order, cached under ``cache_dir``;
    a ``val_fraction`` of the files is held out. ``kind: bin``: ``path`` is the prefix of a
    prepared ``<path>.bin`` + ``<path>.json`` (scripts/prepare_data.py); validation is
    ``val_path`` if given, else the last ``val_fraction`` of the tokens.

    ``kind: megatron``: Megatron-LM indexed datasets (``<prefix>.bin`` + ``<prefix>.idx``) read
    in place: ``path`` (one prefix) or ``blend`` (``[[0.3, /data/web], [0.7, /data/code]]`` or
    Megatron's flat ``"0.3 /data/web 0.7 /data/code"``); validation from ``val_path`` /
    ``val_blend``, else the valid share of ``split`` (Megatron's ``"969,30,1"``, the default),
    by sequences; the samples and their order are Megatron's ``GPTDataset`` / ``BlendedDataset``
    ones, indexed in ``cache_dir`` for ``train_samples`` samples (Megatron's ``--train-samples``;
    default: this run's); ``start_sample`` starts a fresh run at that global sample
    (``te_npu.training.data.megatron_data``).

    ``kind: hf``: a local Hugging Face dataset at ``path`` (parquet / jsonl / arrow / txt / csv
    files, a folder of them, or a ``save_to_disk`` folder), column ``text_key`` of split
    ``hf_split``, tokenized with the local ``tokenizer`` folder once into a cached Megatron
    indexed dataset under ``cache_dir``; validation from ``val_path`` or ``split``
    (``te_npu.training.data.hf_data``); ``streaming: true`` tokenizes on the fly instead, in order
    (``shuffle: false``), validation from ``val_path`` (``te_npu.training.data.hf_stream``).
    """

    kind: str = "stdlib"
    path: str | None = None
    val_path: str | None = None
    blend: Any = None
    val_blend: Any = None
    split: str | None = None
    val_fraction: float = option(0.05, gt=0.0, le=0.5)
    cache_dir: str = "data_cache"
    max_bytes: int = option(12 * 2**20, ge=2**16)
    include_tests: bool = False
    shuffle: bool = True
    tokenizer: str | None = None
    text_key: str = "text"
    hf_split: str = "train"
    streaming: bool = False
    start_sample: int | None = option(None, ge=0)
    train_samples: int | None = option(None, ge=1)

    def __post_init__(self) -> None:
        check_data_config(self)


@dataclass(frozen=True)
class LoggingConfig:
    """Run outputs: Megatron-style lines on stdout, ``<dir>/<metrics_jsonl>``, optional
    TensorBoard and a loss-curve PNG at the end (``plot``)."""

    dir: str = "runs/default"
    tensorboard: bool = False
    metrics_jsonl: str = "metrics.jsonl"
    plot: bool = True

    def __post_init__(self) -> None:
        name = self.metrics_jsonl
        if not name or "/" in name or "\\" in name:
            raise ConfigError(f"logging.metrics_jsonl: {name!r} must be a plain file name (it lives in logging.dir)")
        if not self.dir:
            raise ConfigError("logging.dir: must not be empty")


@dataclass(frozen=True)
class TrainConfig:
    """The whole run. Build it with ``load_config``; ``to_dict()`` gives back the resolved YAML.

    ``model``: the model task's section (an instance of its ``model_section`` class), or, when
    loaded without one, the section as written (a frozen mapping) until
    :meth:`with_model_section` applies the task's schema.
    """

    model: Any
    low_precision: LowPrecisionConfig
    fsdp_config: FSDPConfig
    parallel: ParallelConfig
    training: TrainingConfig
    activation_checkpoint: ActivationCheckpointConfig
    checkpoint: CheckpointConfig
    data: DataConfig
    logging: LoggingConfig
    precision_observer: ObserverConfig = ObserverConfig()
    """Per-GEMM quantization statistics of observed steps (``te_npu.observer``); off by default."""

    def __post_init__(self) -> None:
        if self.precision_observer.enabled and not self.low_precision.enabled:
            raise ConfigError("precision_observer.enabled: true needs low_precision.enabled: true "
                              "(a BF16 run quantizes nothing to observe)")
        t, block = self.training, getattr(self.low_precision.recipe, "block_size", None)
        if block and (t.micro_batch_size * t.seq_len) % block:
            raise ConfigError(
                f"training.micro_batch_size x training.seq_len: {t.micro_batch_size} x {t.seq_len} = "
                f"{t.micro_batch_size * t.seq_len} tokens per micro batch is not a multiple of {block}: "
                f"{self.low_precision.format} blocks the wgrad GEMMs along the token dim"
            )

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: micro batch x accumulation x ``dp_shard_size`` x
        ``dp_replicate_size`` (every rank of the world reads its own samples)."""
        t, f = self.training, self.fsdp_config
        return t.micro_batch_size * t.gradient_accumulation_steps * f.dp_shard_size * f.dp_replicate_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.training.seq_len

    def with_model_section(self, model_section: type) -> TrainConfig:
        """This config with its ``model`` section checked against the task's ``model_section``
        schema (``ConfigError`` naming the ``model.*`` key); itself if it already is one."""
        if isinstance(self.model, model_section):
            return self
        if not isinstance(self.model, Mapping):
            raise TypeError(f"TrainConfig.model is a {type(self.model).__qualname__}, built for another task "
                            f"than the one whose model section is {model_section.__qualname__}")
        return dataclasses.replace(self, model=build_section(model_section, self.model, "model"))

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-able) that ``load_config`` turns back into ``self``."""
        return {f.name: section_to_dict(getattr(self, f.name)) for f in dataclasses.fields(self)}


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------


def load_config(
    path_or_dict: str | Path | Mapping[str, Any],
    overrides: list[str] | None = None,
    *,
    model_section: type | None = None,
) -> TrainConfig:
    """Read, override and validate a training config; raises ``ConfigError`` naming the key path.

    ``path_or_dict``: a YAML file path or an already-loaded mapping (not modified).
    ``overrides``: ``"dotted.key=value"`` strings, values parsed as YAML 1.2 scalars/flow.
    ``model_section``: the model task's schema of the ``model`` section
    (``TrainTask.model_section``); None keeps that section as written (see the module doc).
    """
    raw = apply_overrides(read_config(path_or_dict), overrides)
    reject_unknown(raw, _SECTION_TYPES, "")
    sections = {}
    for name, cls in _SECTION_TYPES.items():  # in field order: the model section first
        if name != "model":
            sections[name] = build_section(cls, raw.get(name), name)
        elif model_section is None:
            sections[name] = build_mapping(raw.get(name), name)
        else:
            sections[name] = build_section(model_section, raw.get(name), name)
    return TrainConfig(**sections)


_SECTION_TYPES = get_type_hints(TrainConfig)  # section name -> class (``model``: Any, the task's)
