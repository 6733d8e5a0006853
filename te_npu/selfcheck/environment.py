"""What the capability gate read on this machine, as the self-check prints and reports it."""
from __future__ import annotations

import dataclasses

from te_npu.formats import Format
from te_npu.ops import capability

__all__ = ["gate_report"]


def gate_report() -> dict:
    """The gate's reading (device name, SoC, CANN, torch / torch_npu versions, each torch_npu
    attribute and aclnn symbol found or not) and, per format, its verdict: every failed check."""
    reading = capability.read_gate()
    verdicts = {fmt.value: capability.failed_checks(fmt, reading) for fmt in (Format.MXFP8_E4M3, Format.HIF8)}
    return {"reading": dataclasses.asdict(reading), "summary": reading.summary(), "failed_checks": verdicts}
