"""The schema engine is generic: any frozen dataclass is a section, checked field by field."""
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import pytest

from te_npu import ConfigError
from te_npu.training.schema import (
    apply_overrides,
    build_mapping,
    build_section,
    option,
    read_config,
    section_to_dict,
)


@dataclass(frozen=True)
class Toy:
    """A section that knows nothing of training."""

    count: int = option(2, ge=1, le=8)
    ratio: float = option(0.5, gt=0.0, lt=1.0)
    scale: float = option(1.0, ge=0.0)
    flavour: Literal["a", "b"] = option("a", reason="only a and b are baked")
    name: str | None = None
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if self.flavour == "b" and self.count > 4:
            raise ConfigError(f"toy.count: {self.count} is too many for flavour 'b'")


@dataclass(frozen=True)
class SelfParsed:
    """A section that parses itself (as ``low_precision`` does)."""

    words: tuple[str, ...]

    @classmethod
    def from_config(cls, raw, path):
        return cls(tuple(f"{path}:{k}" for k in raw))

    def to_config(self):
        return {w.split(":")[1]: None for w in self.words}


@pytest.mark.parametrize(("raw", "match"), [
    ({"count": 0}, r"toy\.count: 0 is out of range; must be >= 1"),
    ({"count": 9}, r"toy\.count: 9 is out of range; must be <= 8"),
    ({"count": True}, r"toy\.count: expected an integer, got true"),
    ({"count": 2.0}, r"toy\.count: expected an integer, got 2\.0 \(float\)"),
    ({"ratio": 1}, r"toy\.ratio: 1\.0 is out of range; must be < 1\.0"),
    ({"ratio": "x"}, r"toy\.ratio: expected a number, got 'x'"),
    ({"flavour": "c"}, r"toy\.flavour: 'c' is not supported; allowed values are \['a', 'b'\]; only a and b are baked"),
    ({"name": 3}, r"toy\.name: expected a string or null, got 3 \(int\)"),
    ({"extra": [1]}, r"toy\.extra: expected a mapping"),
    ({"extra": {1: 2}}, r"toy\.extra: keys must be strings"),
    ({"colour": "red"}, r"toy\.colour: unknown key; allowed keys under toy are "
                        r"\['count', 'extra', 'flavour', 'name', 'ratio', 'scale'\]"),
    ({"flavour": "b", "count": 5}, r"toy\.count: 5 is too many for flavour 'b'"),
    ([1, 2], r"toy: expected a mapping, got \[1, 2\]"),
], ids=lambda v: str(v)[:30])
def test_schema_rejects_with_the_key_path(raw, match):
    with pytest.raises(ConfigError, match=match) as info:
        build_section(Toy, raw, "toy")
    assert "\n" not in str(info.value)


def test_schema_builds_frozen_values_and_round_trips():
    toy = build_section(Toy, {"count": 3, "ratio": 0.25, "extra": {"k": [1, {"x": 2}]}}, "toy")
    assert toy == Toy(count=3, ratio=0.25, extra=MappingProxyType({"k": (1, MappingProxyType({"x": 2}))}))
    with pytest.raises(TypeError):
        toy.extra["k"] = 0
    assert section_to_dict(toy) == {"count": 3, "ratio": 0.25, "scale": 1.0, "flavour": "a",
                                    "name": None, "extra": {"k": [1, {"x": 2}]}}
    assert build_section(Toy, section_to_dict(toy), "toy") == toy
    assert build_section(Toy, None, "toy") == Toy()


def test_schema_int_widens_to_float():
    with pytest.raises(ConfigError, match=r"toy\.ratio: 0\.0 is out of range"):
        build_section(Toy, {"ratio": 0}, "toy")  # the int 0 is read as the number 0.0, then gt=0 refuses it
    widened = build_section(Toy, {"scale": 2}, "toy")
    assert widened.scale == 2.0 and type(widened.scale) is float


def test_schema_self_parsing_section_and_opaque_mapping():
    assert build_section(SelfParsed, {"a": 1, "b": 2}, "s").words == ("s:a", "s:b")
    assert section_to_dict(build_section(SelfParsed, {"a": 1}, "s")) == {"a": None}
    opaque = build_mapping({"anything": {"goes": [1]}}, "m")
    assert opaque == {"anything": {"goes": (1,)}} and section_to_dict(opaque) == {"anything": {"goes": [1]}}
    with pytest.raises(ConfigError, match="m: expected a mapping"):
        build_mapping(5, "m")


def test_schema_overrides_are_yaml_12_and_nest():
    raw = apply_overrides(read_config({"toy": {"count": 1}}), ["toy.count=3", "toy.extra.deep=off", "other.x=1e-3"])
    assert raw == {"toy": {"count": 3, "extra": {"deep": "off"}}, "other": {"x": 1e-3}}
    with pytest.raises(ConfigError, match=r"toy\.count\.x: cannot set inside toy\.count"):
        apply_overrides(raw, ["toy.count.x=1"])


def test_schema_option_refuses_unknown_limits():
    with pytest.raises(TypeError, match="unknown limit"):
        option(1, at_least=1)


@dataclass(frozen=True)
class Outer:
    """A section holding a nested sub-section (a dataclass-typed field)."""

    toy: Toy = field(default_factory=Toy)
    label: str = "x"


def test_schema_nested_section_is_checked_under_its_key_and_round_trips():
    outer = build_section(Outer, {"toy": {"count": 4}}, "model")
    assert outer.toy == Toy(count=4) and build_section(Outer, None, "model").toy == Toy()
    assert section_to_dict(outer)["toy"]["count"] == 4
    assert build_section(Outer, section_to_dict(outer), "model") == outer
    with pytest.raises(ConfigError, match=r"^model\.toy\.count: 9 is out of range"):
        build_section(Outer, {"toy": {"count": 9}}, "model")
    with pytest.raises(ConfigError, match=r"^model\.toy\.nope: unknown key"):
        build_section(Outer, {"toy": {"nope": 1}}, "model")
    with pytest.raises(ConfigError, match=r"^model\.toy: expected a mapping"):
        build_section(Outer, {"toy": 3}, "model")
