"""``ObserverConfig``: what a precision observer watches, and when (the YAML's ``precision_observer``).

=============  ==========================================  ===========================================
key            default                                     meaning
=============  ==========================================  ===========================================
``enabled``    ``false``                                   off: nothing subscribed, nothing computed
``layers``     ``["*"]``                                   ``fnmatch`` patterns over GEMM names (TE
                                                           module FQNs; ``<fqn>.gate_up_proj`` /
                                                           ``.down_proj`` for SwiGLU experts)
``roles``      ``[activation, weight, grad_output]``       tensor roles, each reported per GEMM that
                                                           consumes it (``ROLE_GEMMS``)
``stats``      every name of ``stats.STATISTICS``          which statistics are written
``freq``       ``100``                                     observe every ``freq``-th step ...
``start_step`` ``0``                                       ... counted from this step ...
``end_step``   ``null``                                    ... up to this step (inclusive; null: no end)
=============  ==========================================  ===========================================

Steps are the numbers the caller passes (the Trainer: the iteration its step line prints, 1-based).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from te_npu.errors import ConfigError
from te_npu.formats import QuantizationRole
from te_npu.observer.stats import STATISTICS

__all__ = ["ObserverConfig", "ROLE_OF", "ROLE_GEMMS", "DEFAULT_FREQ"]

ROLE_OF = {
    QuantizationRole.INPUT_FWD: "activation",
    QuantizationRole.INPUT_BWD: "activation",
    QuantizationRole.WEIGHT_FWD: "weight",
    QuantizationRole.WEIGHT_BWD: "weight",
    QuantizationRole.GRAD_OUTPUT: "grad_output",
}
"""Quantization role -> the tensor it quantizes (the observer's ``roles``)."""

ROLE_GEMMS = {
    "activation": ("fprop", "wgrad"),
    "weight": ("fprop", "dgrad"),
    "grad_output": ("dgrad", "wgrad"),
}
"""Each tensor role and the GEMMs that consume a copy of it (labels ``<role>.<gemm>``)."""

DEFAULT_FREQ = 100


@dataclass(frozen=True)
class ObserverConfig:
    """The ``precision_observer`` section (module doc); checked on construction."""

    enabled: bool = False
    layers: tuple[str, ...] = ("*",)
    roles: tuple[str, ...] = tuple(ROLE_GEMMS)
    stats: tuple[str, ...] = STATISTICS
    freq: int = DEFAULT_FREQ
    start_step: int = 0
    end_step: int | None = None

    def __post_init__(self) -> None:
        path = "precision_observer"
        _names(self.layers, f"{path}.layers", None)
        _names(self.roles, f"{path}.roles", tuple(ROLE_GEMMS))
        _names(self.stats, f"{path}.stats", STATISTICS)
        for key in ("freq", "start_step", "end_step"):
            value = getattr(self, key)
            if value is None and key == "end_step":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "freq" else 0):
                raise ConfigError(f"{path}.{key}: {value!r} must be an integer >= {1 if key == 'freq' else 0}")
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"{path}.enabled: {self.enabled!r} must be true or false")
        if self.end_step is not None and self.end_step < self.start_step:
            raise ConfigError(f"{path}.end_step: {self.end_step} is before start_step {self.start_step}")

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], path: str = "precision_observer") -> ObserverConfig:
        """The section as written (a mapping; lists for ``layers`` / ``roles`` / ``stats``)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"{path}.{unknown[0]}: unknown key; known keys are {sorted(known)}")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
        for key in ("layers", "roles", "stats"):
            if key in values and not isinstance(values[key], tuple):
                raise ConfigError(f"{path}.{key}: expected a list of strings, got {raw[key]!r}")
        return cls(**values)

    def to_config(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    def selects(self, step: int) -> bool:
        """Whether ``step`` is observed (enabled, in the window, on the frequency)."""
        return (self.enabled and step >= self.start_step and (self.end_step is None or step <= self.end_step)
                and (step - self.start_step) % self.freq == 0)


def _names(values: tuple, key: str, allowed: tuple[str, ...] | None) -> None:
    if not isinstance(values, tuple) or not values or not all(isinstance(v, str) and v for v in values):
        raise ConfigError(f"{key}: expected a non-empty list of strings, got {values!r}")
    bad = [v for v in values if allowed is not None and v not in allowed]
    if bad:
        raise ConfigError(f"{key}: {bad[0]!r} is not supported; allowed values are {list(allowed)}")
