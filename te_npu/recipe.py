"""Recipes: frozen descriptions of *how* to compute in 8 bits, and config -> recipe parsing.

A recipe holds no tensors and reads no environment. It maps each ``QuantizationRole`` to
an immutable quantizer (spec sections 7.1 and 13.3). Two recipes exist:

- ``MXFP8BlockRecipe``: E4M3 data, one E8M0 scale per 32 elements along the reduction dim.
- ``HiF8CurrentScalingRecipe``: HiFloat8 data, FP32 scale = amax / format_max of the
  current tensor (15.0 for inputs and weights, 224.0 for gradients). Not configurable: a
  different contract would be a new recipe, never a different meaning of this one.

Transformer Engine's names (``transformer_engine.common.recipe``) are spelled here too, so a
TE user's ``recipe.MXFP8BlockScaling(fp8_format=recipe.Format.E4M3)`` works: ``Format`` in
this module is TE's element-format enum (``te_npu.Format`` / ``te_npu.formats.Format`` name
te_npu's two training formats), ``MXFP8BlockScaling`` checks TE's fields and returns the
equivalent ``MXFP8BlockRecipe``, and TE recipes with no A5 counterpart raise ``ConfigError``
with the reason when called. ``check_recipe`` is the one type check every entry point
(``autocast``, ``quantized_model_init``) runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from te_npu.errors import ConfigError
from te_npu.formats import Format as TrainingFormat
from te_npu.formats import QuantizationRole
from te_npu.numerics.constants import HIF8_GRAD_MAX, HIF8_INPUT_MAX, MX_BLOCK_SIZE
from te_npu.quantizers import HiF8Quantizer, MXFP8Quantizer, Quantizer

__all__ = [
    "QuantizationRole",
    "MXFP8BlockRecipe",
    "HiF8CurrentScalingRecipe",
    "Recipe",
    "check_recipe",
    "recipe_from_config",
    # Transformer Engine's spellings
    "Format",
    "MXFP8BlockScaling",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "NVFP4BlockScaling",
]

_GRADIENT_ROLES = frozenset({QuantizationRole.GRAD_OUTPUT})


@dataclass(frozen=True)
class MXFP8BlockRecipe:
    """OCP microscaling FP8: E4M3 elements, an E8M0 scale per ``block_size`` elements.

    ``scale_alg``: ``"floor"`` (``e = floor(log2(amax)) - 8``, the OCP rule and the
    default) or ``"ceil"`` (smallest power of two >= amax / 448, torch_npu ``scale_alg=1``).
    Every role shares one stateless quantizer.
    """

    fp8_format: str = "E4M3"
    block_size: int = MX_BLOCK_SIZE
    scale_dtype: str = "E8M0"
    scale_alg: str = "floor"
    format: ClassVar[TrainingFormat] = TrainingFormat.MXFP8_E4M3

    def __post_init__(self) -> None:
        _require(self.fp8_format == "E4M3", "fp8_format", self.fp8_format, ["E4M3"])
        _require(self.block_size == MX_BLOCK_SIZE, "block_size", self.block_size, [MX_BLOCK_SIZE])
        _require(self.scale_dtype == "E8M0", "scale_dtype", self.scale_dtype, ["E8M0"])
        _require(self.scale_alg in ("floor", "ceil"), "scale_alg", self.scale_alg, ["floor", "ceil"])

    def quantizer(self, role: QuantizationRole) -> Quantizer:
        """The quantizer for ``role`` (the same immutable object for every role)."""
        return self.quantizers()[QuantizationRole(role)]

    def quantizers(self) -> Mapping[QuantizationRole, Quantizer]:
        """Immutable role -> quantizer mapping."""
        shared = MXFP8Quantizer(block_size=self.block_size, scale_alg=self.scale_alg)
        return MappingProxyType({role: shared for role in QuantizationRole})


@dataclass(frozen=True)
class HiF8CurrentScalingRecipe:
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


Recipe = MXFP8BlockRecipe | HiF8CurrentScalingRecipe
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

_RECIPES_BY_FORMAT_AND_SCALING = {
    ("mxfp8_e4m3", "mx_block"): MXFP8BlockRecipe,
    ("hif8", "current"): HiF8CurrentScalingRecipe,
}
_ALLOWED_KEYS = ("enabled", "format", "scaling")
_ALLOWED_FORMATS = ("mxfp8_e4m3", "hif8")
_ALLOWED_SCALINGS = {"mxfp8_e4m3": ("mx_block",), "hif8": ("current",)}


def recipe_from_config(
    config: Mapping[str, Any] | None, *, path: str = "low_precision", check_disabled: bool = False
) -> Recipe | None:
    """Parse a ``low_precision`` config section into a recipe, or None when disabled.

    Accepts exactly ``{enabled, format, scaling}`` with the combinations
    ``mxfp8_e4m3 + mx_block`` and ``hif8 + current``. Anything else raises ``ConfigError``
    naming the key path (``path``) and the allowed values. ``enabled: false`` returns None
    without looking at the other fields' support (unless ``check_disabled``: the training
    config refuses an unsupported combination even when it is switched off) and without
    touching torch_npu. The one statement of these rules (spec section 15).
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
    return _RECIPES_BY_FORMAT_AND_SCALING[(fmt, scaling)]() if enabled else None


def _require(ok: bool, field: str, value: Any, allowed: list) -> None:
    if not ok:
        raise ConfigError(f"MXFP8BlockRecipe.{field}: {value!r} is not supported; allowed values are {allowed}")


# ---- Transformer Engine's spellings -------------------------------------------------------------


class Format(str, Enum):
    """Transformer Engine's element formats (``transformer_engine.common.recipe.Format``).

    Only ``E4M3`` has a te_npu recipe (``MXFP8BlockScaling``); the others are named so that a
    TE script fails with the reason (see ``MXFP8BlockScaling``) instead of an AttributeError.
    """

    E2M1 = "E2M1"
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


# TE field -> (the only accepted value, why nothing else has a meaning here)
_MXFP8_TE_FIELDS = {
    "margin": (0, "MX scales are per 32-element block, E8M0 = floor(log2 amax) - 8; there is no "
                  "delayed-scaling margin to apply"),
    "fp8_dpa": (False, "te_npu has no FP8 attention (core attention stays high precision)"),
    "fp8_mha": (False, "te_npu has no FP8 attention (core attention stays high precision)"),
    "backward_override": (None, "every backward GEMM runs in the recipe's format; there is no "
                                "high-precision or dequantized backward mode"),
    "enable_2d_quantization": (False, "MXFP8 weights are 1x32-blocked along each GEMM's reduction dim; "
                                      "2D weight blocks are not implemented"),
}


def MXFP8BlockScaling(  # noqa: N802 -- TE's class name, kept so TE scripts port unchanged
    margin: int = 0,
    fp8_format: Format | str = Format.E4M3,
    fp8_dpa: bool = False,
    fp8_mha: bool = False,
    backward_override: str | None = None,
    enable_2d_quantization: bool = False,
) -> MXFP8BlockRecipe:
    """TE's ``MXFP8BlockScaling(...)``: returns the equivalent ``MXFP8BlockRecipe()``.

    Arguments are TE's, in TE's order. ``fp8_format`` must be ``Format.E4M3`` (or ``"E4M3"``):
    te_npu's MXFP8 numerics are E4M3 for every tensor, so ``HYBRID`` (E5M2 gradients) is
    refused. The other fields accept only TE's defaults; any other value raises ``ConfigError``
    naming the field and why it has no meaning on A5 here.
    """
    # te_npu's Format, TE's own Format enum (by member name) or the name as a string
    name = fp8_format.name if isinstance(fp8_format, Enum) else fp8_format
    if name != Format.E4M3.name:
        raise ConfigError(
            f"MXFP8BlockScaling.fp8_format: {fp8_format!r} is not supported; only Format.E4M3: te_npu's MXFP8 "
            "numerics use E4M3 for inputs, weights and gradients (E5M2 / HYBRID gradients are not implemented)"
        )
    given = dict(margin=margin, fp8_dpa=fp8_dpa, fp8_mha=fp8_mha, backward_override=backward_override,
                 enable_2d_quantization=enable_2d_quantization)
    for field, value in given.items():
        accepted, reason = _MXFP8_TE_FIELDS[field]
        if value != accepted or type(value) is not type(accepted):
            raise ConfigError(f"MXFP8BlockScaling.{field}: {value!r} is not supported (only {accepted!r}): {reason}")
    return MXFP8BlockRecipe(fp8_format="E4M3")


def _refused_recipe(name: str, reason: str):
    def refuse(*args: Any, **kwargs: Any):
        raise ConfigError(f"{name} is not supported by te_npu: {reason}")

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"TE's ``{name}``: not supported (raises ``ConfigError``): {reason}."
    return refuse


DelayedScaling = _refused_recipe(
    "DelayedScaling", "delayed scaling (amax history) is not implemented; te_npu's recipes are stateless "
                      "(MXFP8BlockScaling / MXFP8BlockRecipe, HiF8CurrentScalingRecipe)")
Float8CurrentScaling = _refused_recipe(
    "Float8CurrentScaling", "per-tensor FP8 (E4M3 / E5M2) scaling is not implemented; the per-tensor "
                            "current-scaling recipe here is HiF8: HiF8CurrentScalingRecipe()")
Float8BlockScaling = _refused_recipe(
    "Float8BlockScaling", "1x128 / 128x128 FP8 block scaling is not implemented; use MXFP8BlockScaling() "
                          "(1x32 blocks, E8M0 scales)")
NVFP4BlockScaling = _refused_recipe("NVFP4BlockScaling", "FP4 formats are not implemented")
