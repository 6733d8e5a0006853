"""Count the host syncs a block of code would make on an accelerator, on any device (CPU too).

A host sync is a call whose result the host must read from device memory before it can go on
(``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``torch.equal``) or an op whose output size
depends on tensor values (``nonzero``, boolean-mask indexing, ``repeat_interleave`` without
``output_size``, ``unique``). On CUDA / NPU each one drains the stream: the host stops issuing
work until the device catches up. On CPU nothing waits, which is why this is detected by op,
not by time: the same count holds on every device.

    from te_npu.testing import count_host_syncs

    with count_host_syncs() as syncs:
        layer(x).sum().backward()
    assert syncs.total == 0, syncs.calls

A test instrument (``te_npu.testing``): it patches ``torch.Tensor.tolist`` process-wide while
the block runs, which no production code path may do. (``tolist`` reads memory directly, below
the dispatcher, and a ``TorchFunctionMode`` misses the reads made inside backward.)
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from te_npu import compat

__all__ = ["HostSyncs", "count_host_syncs"]

_aten = torch.ops.aten
_VALUE_DEPENDENT = {
    _aten._local_scalar_dense.default: "item",  # .item(), int(t), float(t), bool(t)
    _aten.is_nonzero.default: "bool",
    _aten.equal.default: "equal",
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten._unique2.default: "unique",
    _aten.unique_consecutive.default: "unique",
    _aten.unique_dim.default: "unique",
}


@dataclass
class HostSyncs:
    """What :func:`count_host_syncs` saw. calls: op name -> count; total: their sum."""

    calls: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


class _SyncMode(compat.torch_dispatch_mode()):
    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _VALUE_DEPENDENT.get(func)
        if name is None and func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            name = "repeat_interleave"
        if name is None and func is _aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            name = "boolean_index"
        if name is not None:
            self.syncs.calls[name] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Count host syncs (see the module docstring) made inside the block, forward and backward
    alike (autograd's engine runs backward ops on this thread for CPU tensors). A diagnostic:
    ``Tensor.tolist`` is patched process-wide for the block's duration (not thread-safe), and
    reads inside C++ kernels or from other threads are not seen."""
    syncs = HostSyncs()
    original_tolist = torch.Tensor.tolist

    def tolist(self):
        syncs.calls["tolist"] += 1
        return original_tolist(self)

    torch.Tensor.tolist = tolist
    try:
        with _SyncMode(syncs):
            yield syncs
    finally:
        torch.Tensor.tolist = original_tolist
