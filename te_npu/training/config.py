"""Training configuration: one YAML file -> a frozen, fully validated ``TrainConfig``.

``load_config(path_or_dict, overrides)`` is the only entry point. Everything that the
configuration alone can reject is rejected here, before any model, process group or tensor
exists, with a ``te_npu.ConfigError`` that names the full key path
(``fsdp_config.comm_fusion``, ``parallel.tensor_parallel_size``, ``checkpoint.format`` ...).
That covers unknown keys at any depth, wrong types (``true`` is not an int here, although
``bool`` subclasses ``int`` in Python), out-of-range values, and the configuration rows of
the spec's fail-fast matrix (section 15):

- low-precision format/scaling other than ``mxfp8_e4m3 + mx_block`` / ``hif8 + current``
  (parsed by ``te_npu.recipe_from_config``; checked even when ``enabled: false``);
- TP/CP/EP/PP > 1; FSDP ``comm_fusion: true``; a checkpoint format other than DCP;
  activation recompute other than ``off`` / ``full``.

YAML is read with YAML 1.2 scalar rules: only ``true``/``false`` are booleans (``off`` stays
the string "off", as ``activation_checkpoint.mode: off`` intends) and ``3e-3`` is a float.
Command-line overrides use the same rules: ``training.train_steps=10``,
``low_precision={enabled: true, format: hif8, scaling: current}``.

Each section is a frozen dataclass; a field's type annotation is its schema and its
``metadata`` holds range limits (``ge``/``gt``/``le``/``lt``), a required value
(``must_be``) and the ``reason`` quoted in the error.
"""
from __future__ import annotations

import copy
import dataclasses
import operator
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from te_npu.errors import ConfigError
from te_npu.ops.kernels import quant_kernel_device_problem
from te_npu.recipe import Recipe, recipe_from_config

__all__ = [
    "TrainConfig",
    "ModelConfig",
    "LowPrecisionConfig",
    "FSDPConfig",
    "ParallelConfig",
    "TrainingConfig",
    "ActivationCheckpointConfig",
    "CheckpointConfig",
    "DataConfig",
    "LoggingConfig",
    "load_config",
    "parse_override",
    "yaml_load",
    "HF_DEEPSEEK_V3_FIELDS",
]

_SPEC_15 = "spec section 15"

# DeepseekV3Config fields that ``model.overrides`` may set (transformers' keyword arguments
# plus the legacy rope keys found in published config.json files). A test cross-checks this
# list against the installed transformers, so te_npu itself never imports transformers.
HF_DEEPSEEK_V3_FIELDS = frozenset(
    """
    vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers
    num_attention_heads num_key_value_heads n_shared_experts n_routed_experts
    routed_scaling_factor kv_lora_rank q_lora_rank qk_rope_head_dim v_head_dim
    qk_nope_head_dim n_group topk_group num_experts_per_tok first_k_dense_replace
    norm_topk_prob hidden_act max_position_embeddings initializer_range rms_norm_eps
    use_cache pad_token_id bos_token_id eos_token_id pretraining_tp tie_word_embeddings
    rope_parameters rope_interleave attention_bias attention_dropout num_mtp_layers
    output_router_logits rope_theta rope_scaling num_nextn_predict_layers
    """.split()
)


def _f(default: Any = dataclasses.MISSING, **limits: Any) -> Any:
    """A dataclass field with schema metadata (ge/gt/le/lt/must_be/reason)."""
    return field(default=default, metadata=limits)


# ---------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """What model to build: an HF ``config.json`` (file or directory) or a named preset.

    ``overrides`` sets DeepseekV3Config fields on top of it. ``validate_16b`` asks the model
    builder to check the frozen 16B spec (layers, dense/MoE layout, shapes, parameter count);
    omitted, it is true exactly for ``preset: dsv3_16b``.
    """

    preset: Literal["dsv3_16b", "dsv3_tiny"] | None = None
    hf_config: str | None = None
    overrides: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    validate_16b: bool | None = None


@dataclass(frozen=True)
class LowPrecisionConfig:
    """The ``low_precision`` section as written, and the recipe it means (None = BF16 baseline)."""

    section: Mapping[str, Any]
    recipe: Recipe | None

    @property
    def enabled(self) -> bool:
        return self.recipe is not None

    @property
    def format(self) -> str | None:
        return None if self.recipe is None else self.recipe.format.value


@dataclass(frozen=True)
class FSDPConfig:
    """FSDP2 sharding. ``comm_fusion`` exists only to be rejected (spec section 15)."""

    dp_shard_size: int = _f(1, ge=1)
    reshard_after_forward: bool = True
    comm_fusion: bool = _f(False, must_be=False, reason=f"FSDP communication fusion is not supported, {_SPEC_15}")
    fallback_to_unsharded: bool = False


_PARALLEL_REASON = f"only FSDP2 data parallelism is supported (TP/CP/EP/PP = 1), {_SPEC_15}"


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel sizes; all must be 1 (spec section 15)."""

    tensor_parallel_size: int = _f(1, ge=1, must_be=1, reason=_PARALLEL_REASON)
    context_parallel_size: int = _f(1, ge=1, must_be=1, reason=_PARALLEL_REASON)
    expert_parallel_size: int = _f(1, ge=1, must_be=1, reason=_PARALLEL_REASON)
    pipeline_parallel_size: int = _f(1, ge=1, must_be=1, reason=_PARALLEL_REASON)


@dataclass(frozen=True)
class TrainingConfig:
    """Optimisation and run settings. ``clip_grad`` is the max global grad norm (0 disables);
    ``eval_interval`` 0 disables evaluation; ``backend: auto`` picks gloo/nccl/hccl by device.

    Stopping a dead run (``te_npu.training.divergence``): ``max_consecutive_skipped_steps``
    optimizer steps in a row skipped for non-finite gradients stop it (0: never);
    ``stop_on_nonfinite_loss`` stops it at the first non-finite training loss;
    ``loss_spike_factor`` stops it when a loss exceeds that factor times the median of the
    previous 20 (0: off). A stopped run saves nothing and exits non-zero.

    ``quant_kernel``: which bit-identical kernels the emulation quantizes and decodes with
    (``te_npu.ops.kernels``), chosen once per run and logged by rank 0: ``eager`` (torch, the
    reference), ``compiled`` (torch.compile of it; cpu / cuda), ``native`` (C++ CPU kernels), or
    ``auto``: ``native`` for a CPU run with a low-precision recipe when the kernels build here,
    else ``eager``, saying why. A named kernel that cannot run raises; the losses are the same bits.
    """

    seed: int = _f(1234, ge=0)
    micro_batch_size: int = _f(1, ge=1)
    seq_len: int = _f(1024, ge=1)
    gradient_accumulation_steps: int = _f(1, ge=1)
    train_steps: int = _f(1000, ge=1)
    lr: float = _f(3e-4, gt=0.0)
    min_lr: float = _f(0.0, ge=0.0)
    warmup_steps: int = _f(0, ge=0)
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = _f(0.1, ge=0.0)
    adam_beta1: float = _f(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = _f(0.95, ge=0.0, lt=1.0)
    adam_eps: float = _f(1e-8, gt=0.0)
    clip_grad: float = _f(1.0, ge=0.0)
    eval_interval: int = _f(0, ge=0)
    eval_steps: int = _f(1, ge=1)
    log_interval: int = _f(1, ge=1)
    device: Literal["cpu", "cuda", "npu"] = "cpu"
    backend: Literal["gloo", "nccl", "hccl", "auto"] = "auto"
    param_dtype: Literal["bf16", "fp32"] = "bf16"
    max_consecutive_skipped_steps: int = _f(10, ge=0)
    stop_on_nonfinite_loss: bool = True
    loss_spike_factor: float = _f(10.0, ge=0.0)
    quant_kernel: Literal["auto", "eager", "compiled", "native"] = "auto"

    @property
    def resolved_backend(self) -> str:
        """``backend`` with ``auto`` resolved from ``device``."""
        return _DEFAULT_BACKEND[self.device] if self.backend == "auto" else self.backend


_DEFAULT_BACKEND = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
_BACKENDS_BY_DEVICE = {"cpu": ("gloo",), "cuda": ("nccl", "gloo"), "npu": ("hccl",)}


@dataclass(frozen=True)
class ActivationCheckpointConfig:
    """Activation recompute: ``off`` or ``full`` (every decoder layer); nothing else (section 15)."""

    mode: Literal["off", "full"] = _f("off", reason=f"only 'off' and 'full' recompute are supported, {_SPEC_15}")


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
    interval: int = _f(0, ge=0)
    resume: bool | Literal["auto"] = False
    format: Literal["dcp"] = _f("dcp", reason=f"only high-precision DCP checkpoints are supported, {_SPEC_15}")
    keep_last: int = _f(0, ge=0)
    load_step: int | None = _f(None, ge=0)
    verify_checksums: bool = True
    save_on_sigterm: bool = False
    initial_load_path: str | None = None
    initial_load_format: Literal["hf"] = _f("hf", reason="a run starts from a Hugging Face safetensors directory")
    last_save_format: Literal["dcp", "hf"] = "dcp"
    export_dir: str | None = None
    export_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    export_max_shard_mb: int = _f(5000, ge=1)


@dataclass(frozen=True)
class DataConfig:
    """Training tokens.

    ``kind: stdlib``: the running interpreter's standard-library ``.py`` sources, byte-level
    (vocab 256), first ``max_bytes`` bytes in sorted path order, cached under ``cache_dir``;
    a ``val_fraction`` of the files is held out. ``kind: bin``: ``path`` is the prefix of a
    prepared ``<path>.bin`` + ``<path>.json`` (scripts/prepare_data.py); validation is
    ``val_path`` if given, else the last ``val_fraction`` of the tokens.
    """

    kind: Literal["stdlib", "bin"] = "stdlib"
    path: str | None = None
    val_path: str | None = None
    val_fraction: float = _f(0.05, gt=0.0, le=0.5)
    cache_dir: str = "data_cache"
    max_bytes: int = _f(12 * 2**20, ge=2**16)
    include_tests: bool = False
    shuffle: bool = True


@dataclass(frozen=True)
class LoggingConfig:
    """Run outputs: Megatron-style lines on stdout, ``<dir>/<metrics_jsonl>``, optional
    TensorBoard and a loss-curve PNG at the end (``plot``)."""

    dir: str = "runs/default"
    tensorboard: bool = False
    metrics_jsonl: str = "metrics.jsonl"
    plot: bool = True


@dataclass(frozen=True)
class TrainConfig:
    """The whole run. Build it with ``load_config``; ``to_dict()`` gives back the resolved YAML."""

    model: ModelConfig
    low_precision: LowPrecisionConfig
    fsdp_config: FSDPConfig
    parallel: ParallelConfig
    training: TrainingConfig
    activation_checkpoint: ActivationCheckpointConfig
    checkpoint: CheckpointConfig
    data: DataConfig
    logging: LoggingConfig

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: micro batch x accumulation x ``dp_shard_size``."""
        t = self.training
        return t.micro_batch_size * t.gradient_accumulation_steps * self.fsdp_config.dp_shard_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.training.seq_len

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-able) that ``load_config`` turns back into ``self``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if isinstance(section, LowPrecisionConfig):
                out[f.name] = _thaw(section.section)
            else:
                out[f.name] = {sf.name: _thaw(getattr(section, sf.name)) for sf in dataclasses.fields(section)}
        return out


_SECTION_TYPES = get_type_hints(TrainConfig)

# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------


def load_config(path_or_dict: str | Path | Mapping[str, Any], overrides: list[str] | None = None) -> TrainConfig:
    """Read, override and validate a training config; raises ``ConfigError`` naming the key path.

    ``path_or_dict``: a YAML file path or an already-loaded mapping (not modified).
    ``overrides``: ``"dotted.key=value"`` strings, values parsed as YAML 1.2 scalars/flow.
    """
    if isinstance(path_or_dict, Mapping):
        raw = copy.deepcopy(_thaw(path_or_dict))
    else:
        path = Path(path_or_dict)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            raw = yaml_load(path.read_text())
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"config file {str(path)!r} is not valid YAML{at}: {problem}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {str(path)!r} cannot be read: {exc}") from None
        if raw is None:
            raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"<root>: expected a mapping of sections, got {type(raw).__name__}")
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)
    return _build_train_config(raw)


def parse_override(item: str) -> tuple[str, Any]:
    """``"a.b.c=value"`` -> ``("a.b.c", yaml_value)``."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key):
        raise ConfigError(f"override {item!r}: expected 'dotted.key=value'")
    try:
        value = yaml_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: cannot parse override value {text!r}: {exc}") from None
    return key, value


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            prefix = ".".join(parts[: depth + 1])
            raise ConfigError(f"{key}: cannot set inside {prefix}, which is {child!r}, not a mapping")
        node = child
    node[parts[-1]] = value


# ---------------------------------------------------------------------------------------
# YAML 1.2 scalars
# ---------------------------------------------------------------------------------------


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader where only true/false are booleans and exponent floats need no dot."""


_BOOL_TAG, _FLOAT_TAG = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Yaml12Loader.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    """Parse YAML text with YAML 1.2 booleans/floats (``off`` is a string, ``1e-3`` a float)."""
    return yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader subclass


# ---------------------------------------------------------------------------------------
# Schema engine
# ---------------------------------------------------------------------------------------


def _build_train_config(raw: dict) -> TrainConfig:
    _reject_unknown(raw, _SECTION_TYPES, "")
    sections: dict[str, Any] = {}
    for name, tp in _SECTION_TYPES.items():
        value = raw.get(name)
        if name == "low_precision":
            sections[name] = _parse_low_precision(value)
        else:
            sections[name] = _build_section(tp, value, name)
    sections["model"] = _resolve_model(sections["model"])
    cfg = TrainConfig(**sections)
    _check_cross_fields(cfg)
    return cfg


def _build_section(cls: type, raw: Any, path: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {_show(raw)}")
    hints = get_type_hints(cls)
    _reject_unknown(raw, hints, path)
    values = {}
    for f in dataclasses.fields(cls):
        key = f"{path}.{f.name}"
        if f.name not in raw:
            continue
        try:
            value = _coerce(raw[f.name], hints[f.name], key)
        except ConfigError as exc:
            if "reason" not in f.metadata:
                raise
            raise ConfigError(f"{exc}; {f.metadata['reason']}") from None
        _check_limits(value, f.metadata, key)
        values[f.name] = value
    return cls(**values)


def _reject_unknown(raw: Mapping, allowed: Mapping[str, Any], path: str) -> None:
    unknown = [k for k in raw if k not in allowed]
    if unknown:
        where = f"{path}." if path else ""
        names = ", ".join(f"{where}{k}" for k in map(str, unknown))
        raise ConfigError(f"{names}: unknown key; allowed keys under {path or '<root>'} are {sorted(allowed)}")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp``; returns it (ints widened to float, mappings frozen)."""
    origin = get_origin(tp)
    if tp is Any:
        return _freeze(value)
    if origin in (Union, types.UnionType):
        for arg in get_args(tp):
            try:
                return _coerce(value, arg, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: expected {_describe(tp)}, got {_show(value, typed=True)}")
    if origin is Literal:
        if any(value == choice and type(value) is type(choice) for choice in get_args(tp)):
            return value
        raise ConfigError(f"{path}: {_show(value)} is not supported; allowed values are {list(get_args(tp))}")
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is Mapping or tp is Mapping:
        if isinstance(value, Mapping):
            bad = [k for k in value if not isinstance(k, str)]
            if bad:
                raise ConfigError(f"{path}: keys must be strings, got {bad!r}")
            return _freeze(value)
    else:  # pragma: no cover - a schema bug, not a config error
        raise TypeError(f"{path}: unsupported schema type {tp!r}")
    raise ConfigError(f"{path}: expected {_describe(tp)}, got {_show(value, typed=True)}")


_LIMITS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le), "lt": ("<", operator.lt)}


def _check_limits(value: Any, meta: Mapping[str, Any], path: str) -> None:
    if value is None:
        return
    reason = f"; {meta['reason']}" if "reason" in meta else ""
    if "must_be" in meta and value != meta["must_be"]:
        raise ConfigError(f"{path}: {_show(value)} is not supported; must be {_show(meta['must_be'])}{reason}")
    for key, (op, compare) in _LIMITS.items():
        if key in meta and not compare(value, meta[key]):
            raise ConfigError(f"{path}: {_show(value)} is out of range; must be {op} {meta[key]}{reason}")


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin is Literal:
        return " or ".join(repr(c) for c in get_args(tp))
    if tp is type(None):
        return "null"
    if origin is Mapping or tp is Mapping:
        return "a mapping"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, repr(tp))


def _show(value: Any, typed: bool = False) -> str:
    """YAML spelling of a value (``true``, ``null``, ``'text'``), with its type if ``typed``."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if typed and not isinstance(value, str):
        return f"{value!r} ({type(value).__name__})"
    return repr(value)


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------
# Section-specific rules
# ---------------------------------------------------------------------------------------


_LOW_PRECISION_KEYS = ("enabled", "format", "scaling")


def _parse_low_precision(raw: Any) -> LowPrecisionConfig:
    """Delegate to ``recipe_from_config``; format/scaling are checked even when disabled."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"low_precision: expected a mapping, got {_show(raw)}")
    _reject_unknown(raw, dict.fromkeys(_LOW_PRECISION_KEYS), "low_precision")
    recipe = recipe_from_config(raw, path="low_precision")
    if recipe is None and ("format" in raw or "scaling" in raw):
        recipe_from_config({**raw, "enabled": True}, path="low_precision")  # validate the combination only
    return LowPrecisionConfig(section=_freeze(dict(raw)), recipe=recipe)


def _resolve_model(model: ModelConfig) -> ModelConfig:
    if (model.preset is None) == (model.hf_config is None):
        raise ConfigError(
            "model.preset / model.hf_config: set exactly one of them "
            f"(got preset={_show(model.preset)}, hf_config={_show(model.hf_config)})"
        )
    if model.hf_config is not None:
        path = Path(model.hf_config)
        if not (path.is_file() or (path / "config.json").is_file()):
            raise ConfigError(
                f"model.hf_config: {model.hf_config!r} is neither a config.json file nor a directory holding one"
            )
    unknown = sorted(set(model.overrides) - HF_DEEPSEEK_V3_FIELDS)
    if unknown:
        names = ", ".join(f"model.overrides.{k}" for k in unknown)
        raise ConfigError(f"{names}: not a DeepseekV3Config field; allowed fields are {sorted(HF_DEEPSEEK_V3_FIELDS)}")
    validate = model.preset == "dsv3_16b" if model.validate_16b is None else model.validate_16b
    if validate and model.preset == "dsv3_tiny":
        raise ConfigError("model.validate_16b: true cannot hold for preset 'dsv3_tiny' (not the 16B spec)")
    return dataclasses.replace(model, validate_16b=validate)


def _check_cross_fields(cfg: TrainConfig) -> None:
    t = cfg.training
    if t.min_lr > t.lr:
        raise ConfigError(f"training.min_lr: {t.min_lr} must be <= training.lr ({t.lr})")
    allowed = _BACKENDS_BY_DEVICE[t.device]
    if t.backend != "auto" and t.backend not in allowed:
        raise ConfigError(
            f"training.backend: {t.backend!r} cannot drive device {t.device!r}; use one of {list(allowed)} or 'auto'"
        )
    kernel_problem = quant_kernel_device_problem(t.quant_kernel, t.device)
    if kernel_problem:
        raise ConfigError(f"training.quant_kernel: {kernel_problem} (training.device is {t.device!r})")
    d = cfg.data
    if d.kind == "bin" and d.path is None:
        raise ConfigError("data.path: required when data.kind is 'bin' (prefix of a prepared .bin/.json pair)")
    if d.kind == "stdlib":
        for key in ("path", "val_path"):
            if getattr(d, key) is not None:
                raise ConfigError(f"data.{key}: only used with data.kind 'bin' (data.kind is 'stdlib')")
    if 0 < t.loss_spike_factor <= 1:
        raise ConfigError(f"training.loss_spike_factor: {t.loss_spike_factor} must be 0 (off) or > 1")
    block = getattr(cfg.low_precision.recipe, "block_size", None)
    if block and (t.micro_batch_size * t.seq_len) % block:
        raise ConfigError(
            f"training.micro_batch_size x training.seq_len: {t.micro_batch_size} x {t.seq_len} = "
            f"{t.micro_batch_size * t.seq_len} tokens per micro batch is not a multiple of {block}: "
            f"{cfg.low_precision.format} blocks the wgrad GEMMs along the token dim"
        )
    c = cfg.checkpoint
    if not c.dir:
        raise ConfigError("checkpoint.dir: must not be empty (the final checkpoint is always saved)")
    if c.load_step is not None and c.resume is False:
        raise ConfigError(f"checkpoint.load_step: {c.load_step} needs checkpoint.resume true or auto")
    name = cfg.logging.metrics_jsonl
    if not name or "/" in name or "\\" in name:
        raise ConfigError(f"logging.metrics_jsonl: {name!r} must be a plain file name (it lives in logging.dir)")
    if not cfg.logging.dir:
        raise ConfigError("logging.dir: must not be empty")
