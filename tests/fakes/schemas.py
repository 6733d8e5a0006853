"""The real op schemas (``npu_op_schemas.yaml``, extracted from the torch_npu wheel) registered
with ``torch.library`` so torch itself binds every call.

torch_npu exposes its ops as ``torch.ops.npu.<op>`` (``torch_npu/_init/core/_exports.py``
``_export_npu_ops``: ``globals_dict[name] = getattr(torch.ops.npu, name)``), so a call with a wrong
name, arity or type fails inside torch's schema matcher with a RuntimeError such as
"npu::npu_dynamic_mx_quant() Expected a value of type 'int' for argument 'axis' ...". Registering
the same schema strings reproduces that exactly (the namespace in the message is the fake's).
A ``torch.dtype`` passed to an ``int`` argument arrives as its ScalarType value, as in torch_npu.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import yaml

FIXTURE = Path(__file__).with_name("npu_op_schemas.yaml")
_NAMESPACE_IDS = itertools.count()


@dataclass(frozen=True)
class OpSchema:
    """One registered overload: ``qualified`` is 'npu_grouped_matmul' or 'npu_grouped_matmul.List'."""

    qualified: str
    text: str
    positional: tuple[str, ...]
    keyword_only: tuple[str, ...]
    defaults: tuple[tuple[str, object], ...]

    @property
    def op(self) -> str:
        return self.qualified.split(".", 1)[0]

    def bind(self, args: tuple, kwargs: dict) -> dict:
        """Arguments as the kernel receives them from the dispatcher -> {name: value}."""
        bound = dict(self.defaults)  # torch drops arguments equal to their default before the call
        bound.update(zip(self.positional + self.keyword_only, args))
        bound.update(kwargs)
        missing = [n for n in self.positional + self.keyword_only if n not in bound]
        if missing:
            raise RuntimeError(f"{self.qualified}: the dispatcher did not pass {missing}")
        return bound


def load_fixture(path: Path = FIXTURE) -> dict:
    return yaml.safe_load(path.read_text())


def parse(text: str) -> OpSchema:
    schema = torch._C.parse_schema(text)
    qualified = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
    positional = tuple(a.name for a in schema.arguments if not a.kwarg_only)
    keyword_only = tuple(a.name for a in schema.arguments if a.kwarg_only)
    defaults = tuple((a.name, a.default_value) for a in schema.arguments if a.has_default_value())
    return OpSchema(qualified, text, positional, keyword_only, defaults)


def all_schemas(path: Path = FIXTURE) -> list[OpSchema]:
    fixture = load_fixture(path)
    return [parse(text) for entry in fixture["ops"].values() for text in entry["registered"]]


def torch_npu_version(path: Path = FIXTURE) -> str:
    return load_fixture(path)["source"]["torch_npu_version"]


class RegisteredOps:
    """The fixture's schemas defined in a fresh namespace, each with a CPU kernel ``kernel(schema,
    bound_args)``. Keep the object alive as long as the ops are used (torch drops the
    registrations when the Library is garbage collected)."""

    def __init__(self, kernel: Callable[[OpSchema, dict], object], path: Path = FIXTURE):
        self.namespace = f"fake_torch_npu_{next(_NAMESPACE_IDS)}"
        self.schemas = {s.qualified: s for s in all_schemas(path)}
        self._lib = torch.library.Library(self.namespace, "DEF")
        for schema in self.schemas.values():
            self._lib.define(schema.text)
            self._lib.impl(schema.qualified, self._make_kernel(schema, kernel), "CPU")

    @staticmethod
    def _make_kernel(schema: OpSchema, kernel):
        def cpu_kernel(*args, **kwargs):
            return kernel(schema, schema.bind(args, kwargs))

        return cpu_kernel

    def packet(self, op: str):
        """``torch.ops.<namespace>.<op>``: the overload packet a call goes through."""
        return getattr(getattr(torch.ops, self.namespace), op)

    def ops(self) -> list[str]:
        return sorted({s.op for s in self.schemas.values()})
