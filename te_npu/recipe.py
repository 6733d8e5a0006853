"""Recipes: frozen descriptions of *how* to compute in 8 bits, and config -> recipe parsing.

A recipe holds no tensors and reads no environment. It maps each ``QuantizationRole`` to
an immutable quantizer (spec sections 7.1 and 13.3). Two recipes exist:

- ``MXFP8BlockRecipe``: E4M3 data, one E8M0 scale per 32 elements along the reduction dim.
- ``HiF8CurrentScalingRecipe``: HiFloat8 data, FP32 scale = amax / format_max of the
  current tensor (15.0 for inputs and weights, 224.0 for gradients). Not configurable: a
  different contract would be a new recipe, never a different meaning of this one.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from te_npu.errors import ConfigError
from te_npu.formats import Format, QuantizationRole
from te_npu.numerics.constants import HIF8_GRAD_MAX, HIF8_INPUT_MAX, MX_BLOCK_SIZE
from te_npu.quantizers import HiF8Quantizer, MXFP8Quantizer, Quantizer

__all__ = [
    "Format",
    "QuantizationRole",
    "MXFP8BlockRecipe",
    "HiF8CurrentScalingRecipe",
    "Recipe",
    "recipe_from_config",
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
    format: ClassVar[Format] = Format.MXFP8_E4M3

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
    format: ClassVar[Format] = Format.HIF8

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

_RECIPES_BY_FORMAT_AND_SCALING = {
    ("mxfp8_e4m3", "mx_block"): MXFP8BlockRecipe,
    ("hif8", "current"): HiF8CurrentScalingRecipe,
}
_ALLOWED_KEYS = ("enabled", "format", "scaling")
_ALLOWED_FORMATS = ("mxfp8_e4m3", "hif8")
_ALLOWED_SCALINGS = {"mxfp8_e4m3": ("mx_block",), "hif8": ("current",)}


def recipe_from_config(config: Mapping[str, Any] | None, *, path: str = "low_precision") -> Recipe | None:
    """Parse a ``low_precision`` config section into a recipe, or None when disabled.

    Accepts exactly ``{enabled, format, scaling}`` with the combinations
    ``mxfp8_e4m3 + mx_block`` and ``hif8 + current``. Anything else raises ``ConfigError``
    naming the key path (``path``) and the allowed values. ``enabled: false`` returns None
    without looking at the other fields' support and without touching torch_npu.
    """
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {type(config).__name__}")
    unknown = sorted(set(config) - set(_ALLOWED_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; allowed keys are {list(_ALLOWED_KEYS)}")
    enabled = config.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{path}.enabled: expected true or false, got {enabled!r}")
    if not enabled:
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
    return _RECIPES_BY_FORMAT_AND_SCALING[(fmt, scaling)]()


def _require(ok: bool, field: str, value: Any, allowed: list) -> None:
    if not ok:
        raise ConfigError(f"MXFP8BlockRecipe.{field}: {value!r} is not supported; allowed values are {allowed}")
