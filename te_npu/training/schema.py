"""The config schema engine: frozen dataclasses as schemas, YAML 1.2 files, dotted overrides.

Knows nothing about training: ``te_npu.training.config`` declares the run's sections with it
and a model task declares its ``model`` section the same way (``models/deepseek_v3``).

A section is a frozen dataclass. A field's type annotation is its schema (``bool``, ``int``,
``float``, ``str``, ``None``, ``Literal[...]``, unions of these, ``Mapping[str, Any]``,
``Any``, or another section class: a nested sub-section, built the same way under its key); its metadata, set with :func:`option`, holds range limits (``ge`` / ``gt`` / ``le``
/ ``lt``) and the ``reason`` quoted when a value is refused. :func:`build_section` rejects
unknown keys, wrong types (``true`` is not an int here, although ``bool`` subclasses ``int``
in Python) and out-of-range values, then constructs the dataclass, whose ``__post_init__``
checks the rules that tie several of its fields together. A section that parses itself
defines ``from_config(raw, path)`` (and ``to_config()`` for :func:`section_to_dict`).

Every error is one ``te_npu.ConfigError`` line that starts with the full key path
(``training.lr: ...``). YAML is read with YAML 1.2 scalar rules: only ``true``/``false`` are
booleans (``off`` stays the string "off") and ``3e-3`` is a float; overrides
(``training.train_steps=10``, ``low_precision={enabled: true, format: hif8}``) use the same rules.
"""
from __future__ import annotations

import copy
import dataclasses
import operator
import re
import types
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from te_npu.errors import ConfigError

__all__ = [
    "option",
    "build_section",
    "build_mapping",
    "section_to_dict",
    "reject_unknown",
    "read_config",
    "apply_overrides",
    "parse_override",
    "yaml_load",
    "show",
    "freeze",
    "thaw",
]

_LIMITS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le), "lt": ("<", operator.lt)}


def option(default: Any = dataclasses.MISSING, *, reason: str | None = None, **limits: float) -> Any:
    """A dataclass field with schema metadata: ``ge`` / ``gt`` / ``le`` / ``lt`` limits and the
    ``reason`` appended to any error about it (e.g. why a ``Literal`` allows only one value)."""
    unknown = set(limits) - set(_LIMITS)
    if unknown:
        raise TypeError(f"option(): unknown limit(s) {sorted(unknown)}; use {sorted(_LIMITS)}")
    metadata = dict(limits, **({"reason": reason} if reason is not None else {}))
    return dataclasses.field(default=default, metadata=metadata)


# ---- building sections ------------------------------------------------------------------------


def build_section(cls: type, raw: Any, path: str) -> Any:
    """``raw`` (a mapping, or None for "all defaults") checked against section ``cls`` -> an instance.

    ``path`` is the section's key path, the prefix of every error (``"training"``).
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {show(raw)}")
    if hasattr(cls, "from_config"):
        return cls.from_config(raw, path)
    hints = get_type_hints(cls)
    reject_unknown(raw, hints, path)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        key = f"{path}.{f.name}"
        try:
            value = _coerce(raw[f.name], hints[f.name], key)
        except ConfigError as exc:
            if "reason" not in f.metadata:
                raise
            raise ConfigError(f"{exc}; {f.metadata['reason']}") from None
        _check_limits(value, f.metadata, key)
        values[f.name] = value
    return cls(**values)


def build_mapping(raw: Any, path: str) -> Mapping[str, Any]:
    """A section kept as written (string keys, frozen), for a schema that is applied later."""
    if raw is None:
        raw = {}
    return _coerce(raw, Mapping[str, Any], path)


def section_to_dict(section: Any) -> Any:
    """A built section back as plain YAML/JSON-able data (what :func:`build_section` reads)."""
    if hasattr(section, "to_config"):
        return section.to_config()
    if dataclasses.is_dataclass(section):
        return {f.name: section_to_dict(getattr(section, f.name)) for f in dataclasses.fields(section)}
    return thaw(section)


def reject_unknown(raw: Mapping, allowed: Mapping[str, Any] | tuple[str, ...], path: str) -> None:
    """``ConfigError`` naming every key of ``raw`` not in ``allowed`` (and what is allowed)."""
    unknown = [k for k in raw if k not in allowed]
    if unknown:
        where = f"{path}." if path else ""
        names = ", ".join(f"{where}{k}" for k in map(str, unknown))
        raise ConfigError(f"{names}: unknown key; allowed keys under {path or '<root>'} are {sorted(allowed)}")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp``; returns it (ints widened to float, mappings frozen)."""
    origin = get_origin(tp)
    if tp is Any:
        return freeze(value)
    if dataclasses.is_dataclass(tp):  # a nested sub-section
        return build_section(tp, value, path)
    if origin in (Union, types.UnionType):
        for arg in get_args(tp):
            try:
                return _coerce(value, arg, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: expected {_describe(tp)}, got {show(value, typed=True)}")
    if origin is Literal:
        if any(value == choice and type(value) is type(choice) for choice in get_args(tp)):
            return value
        raise ConfigError(f"{path}: {show(value)} is not supported; allowed values are {list(get_args(tp))}")
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
            return freeze(value)
    else:  # pragma: no cover - a schema bug, not a config error
        raise TypeError(f"{path}: unsupported schema type {tp!r}")
    raise ConfigError(f"{path}: expected {_describe(tp)}, got {show(value, typed=True)}")


def _check_limits(value: Any, meta: Mapping[str, Any], path: str) -> None:
    if value is None:
        return
    reason = f"; {meta['reason']}" if "reason" in meta else ""
    for key, (op, compare) in _LIMITS.items():
        if key in meta and not compare(value, meta[key]):
            raise ConfigError(f"{path}: {show(value)} is out of range; must be {op} {meta[key]}{reason}")


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin is Literal:
        return " or ".join(repr(c) for c in get_args(tp))
    if tp is type(None):
        return "null"
    if origin is Mapping or tp is Mapping or dataclasses.is_dataclass(tp):
        return "a mapping"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, repr(tp))


def show(value: Any, typed: bool = False) -> str:
    """YAML spelling of a value (``true``, ``null``, ``'text'``), with its type if ``typed``."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if typed and not isinstance(value, str):
        return f"{value!r} ({type(value).__name__})"
    return repr(value)


def freeze(value: Any) -> Any:
    """Mappings -> read-only ``MappingProxyType``, lists -> tuples, recursively."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """The inverse of :func:`freeze`: plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


# ---- files and overrides ----------------------------------------------------------------------


def read_config(path_or_dict: str | Path | Mapping[str, Any]) -> dict:
    """A YAML file (path) or an already-loaded mapping (deep-copied, never modified) -> a dict.

    An empty file is ``{}``; a missing, unreadable or malformed file, or a document that is not
    a mapping, raises a one-line ``ConfigError``.
    """
    if isinstance(path_or_dict, Mapping):
        raw = copy.deepcopy(thaw(path_or_dict))
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
    return raw


def apply_overrides(raw: dict, overrides: list[str] | None) -> dict:
    """Set each ``"dotted.key=value"`` of ``overrides`` in ``raw`` (in place; returns it)."""
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)
    return raw


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
