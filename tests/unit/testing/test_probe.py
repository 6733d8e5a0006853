"""``STProbe`` files every event under the optimizer step the trainer's events say it is in."""
from __future__ import annotations

from collections import Counter

import torch

from te_npu import events
from te_npu.testing import STProbe


def _gemm(gemm: str) -> events.GemmEvent:
    return events.GemmEvent("dense", "NT", gemm, "hif8", (32, 64), (96, 64), torch.float32, torch.float32,
                            torch.bfloat16, "emulation")


def test_st_probe_files_events_by_step():
    probe = STProbe()
    gather = events.FSDPGatherEvent(events.FSDPGatherContext("forward", True, "w"), "hif8", ("qdata", "scale"), 8, 16, 16)
    quant = events.QuantEvent("hif8", "row", (32, 64), "emulation", scale=torch.tensor(1.0), format_max=15.0)
    with events.subscribe(probe):
        events.emit(events.WeightRefreshEvent("w"))  # before any step: step -1 (setup)
        for step in range(2):
            events.emit(events.StepBeginEvent(step))
            for e in (quant, _gemm("fprop"), _gemm("dgrad"), gather, events.WeightRefreshEvent("w")):
                events.emit(e)
            events.emit(events.OptimizerStepEvent(step == 0, 1.0 if step == 0 else float("inf")))
        probe.begin_optimizer_step(-2)  # a test may file what follows (e.g. a checkpoint load) itself
        events.emit(events.WeightRefreshEvent("w"))
    assert probe.refresh_counts(-1) == Counter(w=1) and probe.refresh_counts(-2) == Counter(w=1)
    assert probe.refresh_counts(1) == Counter(w=1) and probe.refresh_counts(5) == Counter()
    assert probe.step_updated == {0: True, 1: False}
    assert probe.gemm_counts(0) == Counter({("dense", "fprop"): 1, ("dense", "dgrad"): 1})
    assert probe.executed_kernel_roles() == {("dense", "fprop"), ("dense", "dgrad")} and probe.kernel_formats() == {"hif8"}
    assert probe.gathers(1) == [gather] and len(probe.gathers()) == 2
    assert probe.hif8_quant_events() == [quant, quant]
