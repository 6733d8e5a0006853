"""What one rank's phase leaves as evidence: its trace summary and its peak memory, as JSON.

``phase_evidence(result)``: the step records, the module list, the MM/GMM trace and counts, the
FSDP gather trace, HiF8 scale statistics, refresh and micro-step counts, the 8-bit weights.

Peak memory, per phase: ``reset_peak_memory`` when the phase begins, ``peak_memory`` when it ends.
The process's peak RSS and the device's peak allocation are ``te_npu.training.metrics.log.
peak_memory_mb`` (the Trainer's step line reads the same); a phase's own host peak is Linux's
``VmHWM``, reset when the phase begins (``te_npu.training.metrics.host_rss``). Where that
reset fails the host peak is the process's so far (``host_peak_since: process``).
"""
from __future__ import annotations

from collections import Counter

from te_npu.training.metrics.host_rss import reset_peak_rss, status_bytes
from te_npu.training.metrics.log import peak_memory_mb

__all__ = ["phase_evidence", "reset_peak_memory", "peak_memory"]


def phase_evidence(result: dict) -> dict:
    """What a phase did, as JSON: records, modules, MM/GMM trace, gathers, HiF8 scales, refreshes."""
    probe = result.get("probe")
    out = {"records": result.get("records", []), "lines": result.get("lines", [])[-40:]}
    if probe is None:
        return out
    out["low_precision_modules"] = probe.low_precision_modules
    out["module_types"] = probe.module_types
    out["gemm_trace"] = [{"step": s, "kind": e.kind, "gemm": e.gemm, "format": e.format, "backend": e.backend,
                          "left": list(e.left_shape), "right": list(e.right_shape), "out": str(e.output_dtype)}
                         for s, e in probe.gemm_events if s <= 0]
    out["gemm_counts"] = Counter(f"{e.kind}/{e.gemm}/{e.format}/{e.backend}" for _, e in probe.gemm_events)
    out["gather_trace"] = [{"step": s, "fqn": g.context.param_fqn, "phase": g.context.phase, "fields": list(g.fields),
                            "format": g.format, "local_bytes": g.local_bytes, "gathered_bytes": g.gathered_bytes,
                            "reshard_after_forward": g.context.reshard_after_forward}
                           for s, g in probe.gather_records if s <= 0]
    scales = [(e.format_max, float(e.scale.min()), float(e.scale.max()))
              for _, e in probe.quant_events if e.format == "hif8" and e.scale is not None and e.scale.numel()]
    out["hif8_scales"] = {str(m): {"count": sum(1 for x in scales if x[0] == m),
                                   "min": min(x[1] for x in scales if x[0] == m),
                                   "max": max(x[2] for x in scales if x[0] == m)} for m in {x[0] for x in scales}}
    out["refresh_counts"] = {str(s): sum(c.values()) for s, c in sorted(probe.refreshes.items())}
    out["micro_steps"] = {str(s): n for s, n in sorted(probe.micro_steps.items())}
    out["weights"] = {f: {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in info.items()}
                      for f, info in result.get("weights", {}).items()}
    return out


def reset_peak_memory(npu: bool) -> bool:
    """Start a phase's peak memory afresh (module doc): the device's peak statistics on an NPU, the
    host's ``VmHWM``. False if the host's cannot be reset."""
    if npu:
        import torch

        torch.npu.reset_peak_memory_stats()
    return reset_peak_rss()


def peak_memory(npu: bool, host_reset: bool) -> dict:
    """This phase's peak memory: ``host_peak_rss_bytes`` (``VmHWM``: since the phase began when
    ``host_reset``, else the process's peak RSS) and on an NPU the device's peak allocated /
    reserved bytes (since the phase began)."""
    peak = {"host_peak_rss_bytes": int(peak_memory_mb("cpu") * 2**20),
            "host_peak_since": "phase" if host_reset else "process"}
    hwm = status_bytes("VmHWM")
    if hwm is not None:
        peak["host_peak_rss_bytes"] = hwm
    if npu:
        import torch

        peak["device_max_allocated_bytes"] = int(peak_memory_mb("npu") * 2**20)
        peak["device_max_reserved_bytes"] = int(torch.npu.max_memory_reserved())
    return peak
