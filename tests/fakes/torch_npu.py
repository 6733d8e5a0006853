"""A recording fake of the ``torch_npu`` module, built from Ascend's sources (see README.md).

Every op call is bound by torch against the real schema, appended to ``calls`` and run by a CPU
model of the vendor op (checks, numerics, output layout). ``fail(name, exc)`` makes the next calls
of an op raise ``exc``. Self-contained: it depends on nothing of the library under test.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

from tests.fakes import dynamic_quant, grouped_matmul, mx_quant, quant_matmul, quant_max, quantize
from tests.fakes.capability import FakeNpuConfig, device_module
from tests.fakes.dtypes import TORCH_NPU_DTYPE_CODES
from tests.fakes.schemas import OpSchema, RegisteredOps, torch_npu_version
from tests.fakes.vendor_errors import not_modelled


@dataclass
class Call:
    """One op call, recorded before torch binds it.

    args: the positional arguments exactly as passed. kwargs: every other schema argument by name,
    as passed or, when not passed, its schema default (values are not converted: a torch.dtype
    passed to an ``int`` argument stays a torch.dtype here). bound: every argument as the kernel
    received it after torch's binding (dtype -> ScalarType int, tuples -> lists), empty when the
    binding failed. overload: the schema overload that ran ("npu_grouped_matmul.List", ...)."""

    name: str
    args: tuple
    kwargs: dict
    bound: dict = field(default_factory=dict)
    overload: str = ""


def _list_overload(config, **bound):
    # npu_grouped_matmul.List (int[] group_list) runs aclnnGroupedMatmul (V1), which has no
    # x_dtype / scale_dtype: no MX or HiF8 call can be expressed through it.
    raise not_modelled("npu_grouped_matmul.List (aclnnGroupedMatmul with an int[] group_list)")


IMPLEMENTATIONS = {
    "npu_dynamic_mx_quant": mx_quant.dynamic_mx_quant,
    "npu_dynamic_mx_quant_with_dual_axis": mx_quant.dynamic_mx_quant_with_dual_axis,
    "npu_grouped_dynamic_mx_quant": mx_quant.grouped_dynamic_mx_quant,
    "npu_dynamic_quant": dynamic_quant.dynamic_quant,
    "npu_quantize": quantize.quantize,
    "npu_quant_max": quant_max.quant_max,
    "npu_quant_matmul": quant_matmul.quant_matmul,
    "npu_grouped_matmul": grouped_matmul.grouped_matmul,
    "npu_grouped_matmul.List": _list_overload,
}


class FakeTorchNpu(types.ModuleType):
    """``sys.modules["torch_npu"]`` stand-in: the ops, the dtype codes, ``npu`` (= ``torch.npu``)."""

    def __init__(self, config: FakeNpuConfig | None = None):
        super().__init__("torch_npu")
        self.config = config or FakeNpuConfig()
        self.__version__ = torch_npu_version()
        self.version = types.ModuleType("torch_npu.version")
        self.version.__version__ = self.__version__
        for name, code in TORCH_NPU_DTYPE_CODES.items():  # torch_npu.hifloat8 == 290, ...
            setattr(self, name, code)
        self.npu = device_module(self.config)
        self.calls: list[Call] = []
        self._failures: dict[str, BaseException] = {}
        self._pending: Call | None = None
        self._ops = RegisteredOps(self._kernel)
        for op in self._ops.ops():
            setattr(self, op, self._entry(op))

    # ---- test helpers
    def fail(self, name: str, exc: BaseException) -> None:
        """Make every later call of op ``name`` raise ``exc`` (after it is recorded)."""
        self._failures[name] = exc

    def calls_of(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    def aclnn_kernel_available(self, name: str) -> bool:
        """Test-only stand-in for op-plugin's check_aclnn_kernel_available (dlsym in libopapi.so);
        NOT a real torch_npu API."""
        return self.config.has_kernel(name)

    @property
    def op_namespace(self) -> str:
        """The torch.ops namespace the fake's schemas live in (the real one is ``npu``)."""
        return self._ops.namespace

    # ---- plumbing
    def _entry(self, op: str):
        packet = self._ops.packet(op)

        def call_op(*args, **kwargs):
            call = Call(op, args, self._with_defaults(op, len(args), kwargs))
            self.calls.append(call)
            if op in self._failures:
                raise self._failures[op]
            self._pending = call
            try:
                return packet(*args, **kwargs)
            finally:
                self._pending = None

        call_op.__name__ = op
        call_op.__doc__ = "\n".join(s.text for s in self._ops.schemas.values() if s.op == op)
        return call_op

    def _with_defaults(self, op: str, n_positional: int, kwargs: dict) -> dict:
        """The arguments after the first ``n_positional``: as passed, else their default (the first
        overload's schema; overloads of one op share their argument names and defaults here)."""
        schema = next(s for s in self._ops.schemas.values() if s.op == op)
        names = (schema.positional + schema.keyword_only)[n_positional:]
        defaults = dict(schema.defaults)
        filled = {n: kwargs[n] if n in kwargs else defaults.get(n) for n in names}
        filled.update({k: v for k, v in kwargs.items() if k not in filled})
        return filled

    def _kernel(self, schema: OpSchema, bound: dict):
        call = self._pending
        if call is not None and call.name == schema.op:
            call.bound = dict(bound)
            call.overload = schema.qualified
        return IMPLEMENTATIONS[schema.qualified](self.config, **bound)
