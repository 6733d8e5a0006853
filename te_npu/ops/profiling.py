"""The profiler ranges te_npu's op entry points open: stable names for time shares.

Every quantization entry point of ``te_npu.ops.quantize`` runs inside a
``torch.profiler.record_function`` range named ``QUANT_RANGE + " <what>"`` (e.g.
``"te_npu::quantize mxfp8 row"``), every GEMM of ``te_npu.ops.gemm`` inside
``GEMM_RANGE + " <kind> <gemm> <format>"`` (e.g. ``"te_npu::gemm grouped wgrad hif8"``). The
prefixes are the contract: ``te_npu.testing.time_shares`` classifies a trace by them.

A range costs about 5 us even with no profiler recording, so :func:`op_range` opens one only
while a profiler records: torch's own (``compat.profiler_enabled()``), or any other
one (e.g. ``torch_npu.profiler``, whose state torch may not see) inside :func:`ranges_forced`.
Otherwise it is a ``nullcontext`` (about 0.1 us).
"""
from __future__ import annotations

import contextlib

import torch

from te_npu import compat

__all__ = ["QUANT_RANGE", "GEMM_RANGE", "op_range", "ranges_forced"]

QUANT_RANGE = "te_npu::quantize"
GEMM_RANGE = "te_npu::gemm"

_forced = 0


@contextlib.contextmanager
def ranges_forced():
    """Open te_npu's ranges inside this block whatever torch's profiler state says (for a
    profiler torch does not report as enabled); nests."""
    global _forced
    _forced += 1
    try:
        yield
    finally:
        _forced -= 1


def op_range(label: str):
    """``record_function(label)`` while a profiler records, else a no-op context."""
    if _forced or compat.profiler_enabled():
        return torch.profiler.record_function(label)
    return contextlib.nullcontext()
