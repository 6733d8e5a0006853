"""Recipes: frozen descriptions of *how* to compute in 8 bits, and config -> recipe parsing.

A recipe holds no tensors and reads no environment. It maps each ``QuantizationRole`` to
an immutable quantizer. Two recipes exist:

- ``MXFP8BlockRecipe``: E4M3 data, one E8M0 scale per 32 elements along the reduction dim.
- ``HiF8CurrentScalingRecipe``: HiFloat8 data, FP32 scale = amax / format_max of the
  current tensor (15.0 for inputs and weights, 224.0 for gradients). Not configurable: a
  different contract would be a new recipe, never a different meaning of this one.

Transformer Engine's recipe classes (``transformer_engine.common.recipe``) are spelled here as
classes, so TE code ports with its ``isinstance`` checks and kind predicates: every recipe
derives from ``Recipe``, whose classmethods ``mxfp8()``, ``delayed()``,
``float8_current_scaling()``, ``float8_per_tensor_scaling()``, ``float8_block_scaling()``,
``nvfp4()`` and ``custom()`` answer as TE's do (plus te_npu's ``hif8()``).
``MXFP8BlockScaling`` *is* ``MXFP8BlockRecipe`` (one class, TE's fields first, in TE's order);
``Format`` in this module is TE's element-format enum (``te_npu.Format`` / ``te_npu.formats.Format``
name te_npu's two training formats). TE recipes with no A5 counterpart (``DelayedScaling``,
``Float8CurrentScaling``, ``Float8BlockScaling``, ``NVFP4BlockScaling``, ``CustomRecipe``) are
classes too (``isinstance`` and their predicates work) whose construction raises ``ConfigError``
with the reason. ``check_recipe`` is the one type check every entry point (``autocast``,
``quantized_model_init``) runs.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from te_npu.errors import ConfigError
from te_npu.formats import Format as TrainingFormat
from te_npu.formats import QuantizationRole
from te_npu.numerics.constants import HIF8_GRAD_MAX, HIF8_INPUT_MAX, MX_BLOCK_SIZE, MX_DEFAULT_SCALE_ALG, MX_SCALE_ALGS
from te_npu.quantizers import HiF8Quantizer, MXFP8Quantizer, Quantizer

__all__ = [
    "QuantizationRole",
    "Recipe",
    "MXFP8BlockRecipe",
    "HiF8CurrentScalingRecipe",
    "check_recipe",
    "describe_recipe",
    "recipe_change_note",
    "recipe_record",
    "recipe_from_config",
    # Transformer Engine's spellings
    "Format",
    "MXFP8BlockScaling",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "NVFP4BlockScaling",
    "CustomRecipe",
]

_GRADIENT_ROLES = frozenset({QuantizationRole.GRAD_OUTPUT})


class Format(str, Enum):
    """Transformer Engine's element formats (``transformer_engine.common.recipe.Format``).

    Only ``E4M3`` has a te_npu recipe (``MXFP8BlockScaling``); the others are named so that a
    TE script fails with the reason (see ``MXFP8BlockScaling``) instead of an AttributeError.
    """

    E2M1 = "E2M1"
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


class Recipe:
    """Base of every recipe (TE's ``transformer_engine.common.recipe.Recipe``): what kind it is.

    The predicates are classmethods, as in TE, so they answer on the class and on instances.
    """

    __slots__ = ()

    @classmethod
    def mxfp8(cls) -> bool:
        """MXFP8 block scaling (``MXFP8BlockScaling`` / ``MXFP8BlockRecipe``)."""
        return issubclass(cls, MXFP8BlockRecipe)

    @classmethod
    def hif8(cls) -> bool:
        """HiF8 current scaling (te_npu's ``HiF8CurrentScalingRecipe``; TE has no such recipe)."""
        return issubclass(cls, HiF8CurrentScalingRecipe)

    @classmethod
    def delayed(cls) -> bool:
        """TE's delayed scaling (not supported here: ``DelayedScaling`` cannot be built)."""
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        """TE's per-tensor FP8 current scaling (HiF8 current scaling is not this: other format)."""
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        """TE's per-tensor FP8 scaling (delayed or current)."""
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def float8_block_scaling(cls) -> bool:
        """TE's 1x128 / 128x128 FP8 block scaling."""
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def nvfp4(cls) -> bool:
        """TE's NVFP4 block scaling."""
        return issubclass(cls, NVFP4BlockScaling)

    @classmethod
    def custom(cls) -> bool:
        """TE's custom quantizer-factory recipe."""
        return issubclass(cls, CustomRecipe)


# TE field -> (the only accepted value, why nothing else has a meaning here)
_MXFP8_TE_FIELDS = {
    "margin": (0, "MX scales are per 32-element block, an E8M0 power of two from the block's amax "
                  "(scale_alg); there is no delayed-scaling margin to apply"),
    "fp8_dpa": (False, "te_npu has no FP8 attention (core attention stays high precision)"),
    "fp8_mha": (False, "te_npu has no FP8 attention (core attention stays high precision)"),
    "backward_override": (None, "every backward GEMM runs in the recipe's format; there is no "
                                "high-precision or dequantized backward mode"),
    "enable_2d_quantization": (False, "MXFP8 weights are 1x32-blocked along each GEMM's reduction dim; "
                                      "2D weight blocks are not implemented"),
}


@dataclass(frozen=True)
class MXFP8BlockRecipe(Recipe):
    """OCP microscaling FP8: E4M3 elements, an E8M0 scale per ``block_size`` elements.

    Also TE's ``MXFP8BlockScaling``: TE's fields come first, in TE's order (``margin``,
    ``fp8_format``, ``fp8_dpa``, ``fp8_mha``, ``backward_override``, ``enable_2d_quantization``),
    and accept only TE's defaults, except ``fp8_format``, which takes ``Format.E4M3`` as TE's
    enum, this module's or a string (stored as this module's ``Format.E4M3``, equal to
    ``"E4M3"``); ``HYBRID`` / ``E5M2`` gradients are refused. Any other value raises
    ``ConfigError`` naming the field and why it has no meaning here.

    te_npu's own fields are keyword-only: ``scale_alg`` is ``"ceil"`` (the default: the smallest
    power of two >= amax / 448 -- what TE's ``float_to_e8m0`` round-up, torchao's ``RCEIL`` and
    torch_npu's ``scale_alg=1`` compute, arXiv 2506.08027's recipe) or ``"floor"`` (the OCP MX
    rule ``e = floor(log2(amax)) - 8``, torch_npu ``scale_alg=0``: a block's values above 448
    after scaling are clipped to 448); ``block_size`` (32) and ``scale_dtype`` (``"E8M0"``) are fixed.
    Every role shares one stateless quantizer.
    """

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None
    enable_2d_quantization: bool = False
    _: KW_ONLY
    block_size: int = MX_BLOCK_SIZE
    scale_dtype: str = "E8M0"
    scale_alg: str = MX_DEFAULT_SCALE_ALG
    format: ClassVar[TrainingFormat] = TrainingFormat.MXFP8_E4M3

    def __post_init__(self) -> None:
        # te_npu's Format, TE's own Format enum (by member name) or the name as a string
        given = self.fp8_format
        name = given.name if isinstance(given, Enum) else given
        if name != Format.E4M3.name:
            raise ConfigError(
                f"MXFP8BlockScaling.fp8_format: {given!r} is not supported; only Format.E4M3: te_npu's MXFP8 "
                "numerics use E4M3 for inputs, weights and gradients (E5M2 / HYBRID gradients are not implemented)"
            )
        object.__setattr__(self, "fp8_format", Format.E4M3)
        for field, (accepted, reason) in _MXFP8_TE_FIELDS.items():
            value = getattr(self, field)
            if value != accepted or type(value) is not type(accepted):
                raise ConfigError(f"MXFP8BlockScaling.{field}: {value!r} is not supported (only {accepted!r}): {reason}")
        _require(self.block_size == MX_BLOCK_SIZE, "block_size", self.block_size, [MX_BLOCK_SIZE])
        _require(self.scale_dtype == "E8M0", "scale_dtype", self.scale_dtype, ["E8M0"])
        _require(self.scale_alg in MX_SCALE_ALGS, "scale_alg", self.scale_alg, list(MX_SCALE_ALGS))

    def quantizer(self, role: QuantizationRole) -> Quantizer:
        """The quantizer for ``role`` (the same immutable object for every role)."""
        return self.quantizers()[QuantizationRole(role)]

    def quantizers(self) -> Mapping[QuantizationRole, Quantizer]:
        """Immutable role -> quantizer mapping."""
        shared = MXFP8Quantizer(block_size=self.block_size, scale_alg=self.scale_alg)
        return MappingProxyType({role: shared for role in QuantizationRole})


MXFP8BlockScaling = MXFP8BlockRecipe
"""Transformer Engine's name of :class:`MXFP8BlockRecipe` (the same class)."""


@dataclass(frozen=True)
class HiF8CurrentScalingRecipe(Recipe):
    """HiFloat8 with current (just-in-time) per-tensor scaling; nothing is configurable.

    ``input_max`` / ``weight_max`` = 15.0 and ``grad_max`` = 224.0 are the format maxima the
    scale targets; scales are FP32, per tensor (per expert for 3D grouped weights).
    """

    input_max: ClassVar[float] = HIF8_INPUT_MAX
    weight_max: ClassVar[float] = HIF8_INPUT_MAX
    grad_max: ClassVar[float] = HIF8_GRAD_MAX
    format: ClassVar[TrainingFormat] = TrainingFormat.HIF8

    def quantizer(self, role: QuantizationRole) -> Quantizer:
        """The quantizer for ``role``: max 224.0 for ``grad_output``, 15.0 otherwise."""
        return self.quantizers()[QuantizationRole(role)]

    def quantizers(self) -> Mapping[QuantizationRole, Quantizer]:
        """Immutable role -> quantizer mapping (input/weight share one, gradient has its own)."""
        forward = HiF8Quantizer(format_max=self.input_max)
        gradient = HiF8Quantizer(format_max=self.grad_max)
        return MappingProxyType(
            {role: gradient if role in _GRADIENT_ROLES else forward for role in QuantizationRole}
        )


_RECIPE_TYPES = (MXFP8BlockRecipe, HiF8CurrentScalingRecipe)


def check_recipe(recipe: Any, where: str) -> Recipe | None:
    """``recipe`` itself when it is a te_npu recipe (or None); else ``TypeError`` naming ``where``.

    Run where a recipe enters (``autocast(...)``, ``quantized_model_init(...)``), so a wrong
    object fails at that line instead of at the first forward of some module.
    """
    if recipe is None or isinstance(recipe, _RECIPE_TYPES):
        return recipe
    raise TypeError(
        f"{where}: recipe must be a te_npu recipe (MXFP8BlockRecipe(), HiF8CurrentScalingRecipe(), or "
        f"te_npu.recipe.MXFP8BlockScaling(...), TE's spelling), got {type(recipe).__module__}."
        f"{type(recipe).__qualname__}"
    )

def recipe_record(recipe: Recipe | None) -> dict[str, str] | None:
    """What a run computes in, as JSON: ``{"format": "mxfp8_e4m3", "scale_alg": "ceil"}``,
    ``{"format": "hif8"}``, or None (the BF16 baseline). A checkpoint keeps it (``te_npu.json``)."""
    if recipe is None:
        return None
    record = {"format": recipe.format.value}
    if isinstance(recipe, MXFP8BlockRecipe):
        record["scale_alg"] = recipe.scale_alg
    return record


def describe_recipe(recipe: Recipe | None) -> str:
    """One phrase for a run's log line: the format and, for MXFP8, the E8M0 scale rule."""
    if recipe is None:
        return "off (BF16 baseline)"
    if isinstance(recipe, MXFP8BlockRecipe):
        rule = "round-up" if recipe.scale_alg == "ceil" else "OCP floor"
        return f"{recipe.format.value} ({type(recipe).__name__}, scale_alg={recipe.scale_alg}: {rule} E8M0 scales)"
    return f"{recipe.format.value} ({type(recipe).__name__})"


def recipe_change_note(step_info: Mapping[str, Any], recipe: Recipe | None, where: str) -> str | None:
    """One line when a resumed run's recipe differs from the one checkpoint ``where`` was trained
    with (``step_info``: its ``te_npu.json``, whose ``low_precision`` is a ``recipe_record``),
    else None. Changing the recipe between runs is legitimate; doing it silently is not. A
    checkpoint older than the record is noted only for an MXFP8 run (te_npu computed MXFP8
    scales with the floor rule then)."""
    current = recipe_record(recipe)
    if "low_precision" not in step_info:
        if current is None or "scale_alg" not in current:
            return None
        return (f"checkpoint {where} does not record its MXFP8 scale rule (saved by a te_npu that computed "
                f"scale_alg=floor); this run continues with scale_alg={current['scale_alg']}")
    saved = step_info["low_precision"]
    if saved == current:
        return None
    if isinstance(saved, Mapping) and current is not None and saved.get("format") == current.get("format"):
        return (f"checkpoint {where} was trained with MXFP8 scale_alg={saved.get('scale_alg')}; this run continues "
                f"with scale_alg={current.get('scale_alg')} (low_precision.scale_alg)")
    return (f"checkpoint {where} was trained with low precision {_record_phrase(saved)}; this run continues with "
            f"{_record_phrase(current)}")


def _record_phrase(record: Any) -> str:
    if not isinstance(record, Mapping) or not record:
        return "off (BF16)"
    return " ".join(f"{k}={v}" for k, v in record.items())


_RECIPES_BY_FORMAT_AND_SCALING = {
    ("mxfp8_e4m3", "mx_block"): MXFP8BlockRecipe,
    ("hif8", "current"): HiF8CurrentScalingRecipe,
}
_ALLOWED_KEYS = ("enabled", "format", "scaling", "scale_alg")
_ALLOWED_FORMATS = ("mxfp8_e4m3", "hif8")
_ALLOWED_SCALINGS = {"mxfp8_e4m3": ("mx_block",), "hif8": ("current",)}


def recipe_from_config(
    config: Mapping[str, Any] | None, *, path: str = "low_precision", check_disabled: bool = False
) -> Recipe | None:
    """Parse a ``low_precision`` config section into a recipe, or None when disabled.

    Accepts exactly ``{enabled, format, scaling, scale_alg}`` with the combinations
    ``mxfp8_e4m3 + mx_block`` and ``hif8 + current``; ``scale_alg`` (``ceil``, the default, or
    ``floor``: the MXFP8 E8M0 scale rule) only with ``mxfp8_e4m3``. Anything else raises ``ConfigError``
    naming the key path (``path``) and the allowed values. ``enabled: false`` returns None
    without looking at the other fields' support (unless ``check_disabled``: the training
    config refuses an unsupported combination even when it is switched off) and without
    touching torch_npu. The one statement of these rules (docs/numerics-and-limits.md, Limits).
    """
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {type(config).__name__}")
    unknown = [str(k) for k in config if k not in _ALLOWED_KEYS]
    if unknown:
        names = ", ".join(f"{path}.{k}" for k in unknown)
        raise ConfigError(f"{names}: unknown key; allowed keys under {path} are {sorted(_ALLOWED_KEYS)}")
    enabled = config.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{path}.enabled: expected true or false, got {enabled!r}")
    if not enabled and not check_disabled:
        return None
    fmt = config.get("format", "mxfp8_e4m3")
    if fmt not in _ALLOWED_FORMATS:
        raise ConfigError(f"{path}.format: {fmt!r} is not supported; allowed values are {list(_ALLOWED_FORMATS)}")
    scaling = config.get("scaling", _ALLOWED_SCALINGS[fmt][0])
    if scaling not in _ALLOWED_SCALINGS[fmt]:
        raise ConfigError(
            f"{path}.scaling: {scaling!r} is not supported with format {fmt!r}; "
            f"allowed values are {list(_ALLOWED_SCALINGS[fmt])}"
        )
    kwargs = {}
    if "scale_alg" in config:
        scale_alg = config["scale_alg"]
        if fmt != "mxfp8_e4m3":
            raise ConfigError(f"{path}.scale_alg: {scale_alg!r} is not supported with format {fmt!r}; the E8M0 "
                              "scale rule is MXFP8's only (HiF8 scales are FP32 amax / format_max): remove the key")
        if scale_alg not in MX_SCALE_ALGS:
            raise ConfigError(f"{path}.scale_alg: {scale_alg!r} is not supported; allowed values are "
                              f"{list(MX_SCALE_ALGS)} (ceil: round-up, the default; floor: the OCP rule)")
        kwargs["scale_alg"] = scale_alg
    return _RECIPES_BY_FORMAT_AND_SCALING[(fmt, scaling)](**kwargs) if enabled else None


def _require(ok: bool, field: str, value: Any, allowed: list) -> None:
    if not ok:
        raise ConfigError(f"MXFP8BlockRecipe.{field}: {value!r} is not supported; allowed values are {allowed}")


# ---- Transformer Engine's recipes with no A5 counterpart ----------------------------------------


class _RefusedRecipe(Recipe):
    """A TE recipe class that exists for ``isinstance`` and the kind predicates; building one
    raises ``ConfigError`` with ``_reason``."""

    __slots__ = ()
    _reason: ClassVar[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(f"{type(self).__name__} is not supported by te_npu: {self._reason}")


class DelayedScaling(_RefusedRecipe):
    """TE's ``DelayedScaling``: not supported (raises ``ConfigError``)."""

    __slots__ = ()
    _reason = ("delayed scaling (amax history) is not implemented; te_npu's recipes are stateless "
               "(MXFP8BlockScaling / MXFP8BlockRecipe, HiF8CurrentScalingRecipe)")


class Float8CurrentScaling(_RefusedRecipe):
    """TE's ``Float8CurrentScaling``: not supported (raises ``ConfigError``)."""

    __slots__ = ()
    _reason = ("per-tensor FP8 (E4M3 / E5M2) scaling is not implemented; the per-tensor current-scaling "
               "recipe here is HiF8: HiF8CurrentScalingRecipe()")


class Float8BlockScaling(_RefusedRecipe):
    """TE's ``Float8BlockScaling``: not supported (raises ``ConfigError``)."""

    __slots__ = ()
    _reason = "1x128 / 128x128 FP8 block scaling is not implemented; use MXFP8BlockScaling() (1x32 blocks, E8M0 scales)"


class NVFP4BlockScaling(_RefusedRecipe):
    """TE's ``NVFP4BlockScaling``: not supported (raises ``ConfigError``)."""

    __slots__ = ()
    _reason = "FP4 formats are not implemented"


class CustomRecipe(_RefusedRecipe):
    """TE's ``CustomRecipe`` (a user quantizer factory): not supported (raises ``ConfigError``)."""

    __slots__ = ()
    _reason = ("custom quantizer factories are not implemented; te_npu's quantizers come from "
               "MXFP8BlockRecipe / HiF8CurrentScalingRecipe")

