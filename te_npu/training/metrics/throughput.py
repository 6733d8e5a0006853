"""Throughput as the field reports it: model FLOPs per token, TFLOP/s per device, MFU.

Megatron-LM prints "throughput per GPU (TFLOP/s/GPU)" and torchtitan "tflops" and "mfu" from a
model's FLOPs per token; here a ``TrainTask`` may give its ``ModelFlops`` (``flops_per_token(cfg)``,
DeepSeek-V3's in ``models/deepseek_v3/flops.py``) and the step line, ``metrics.jsonl`` and
TensorBoard carry ``tflops`` (model TFLOP/s per device) and ``mfu`` (that over the device's peak
for the run's format, ``training.peak_tflops``; no MFU where the peak is unknown).

Conventions (Megatron's and torchtitan's): matmul FLOPs only, two per multiply-add; training =
forward + backward = 3x forward (dgrad and wgrad each cost one forward); the forward replayed
by activation recompute is hardware work, not model work: it is reported apart
(``ModelFlops.recompute``) and left out of MFU.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelFlops", "ASCEND_950_PEAK_TFLOPS", "default_peak_tflops", "step_throughput"]

ASCEND_950_PEAK_TFLOPS: dict[str | None, float | None] = {"mxfp8_e4m3": 1000.0, "hif8": 1000.0, None: None}
"""Peak dense TFLOP/s of one Ascend 950 (950PR / 950DT) per training format: FP8 / MXFP8 / HiF8
1 PFLOPS (MXFP4 2 PFLOPS), Eric Xu's keynote at Huawei Connect 2025, Shanghai, 2025-09-18 (the
Ascend 950 series slide). BF16 (``None``: no low-precision format) is not published: no MFU."""


@dataclass(frozen=True)
class ModelFlops:
    """Matmul FLOPs per token of one training step.

    forward: per token, one forward pass; recompute: per token, the part of the forward that
    activation recompute replays in backward (0 without recompute).
    """

    forward: float
    recompute: float = 0.0

    @property
    def training(self) -> float:
        """Model FLOPs per token: forward + backward (3x forward); what MFU counts."""
        return 3.0 * self.forward

    @property
    def hardware(self) -> float:
        """FLOPs per token the device runs: training plus the recompute."""
        return self.training + self.recompute


def default_peak_tflops(format_value: str | None, device_type: str) -> float | None:
    """The peak to divide by when ``training.peak_tflops`` is null: Ascend 950's for the format
    on an ``npu`` device (None for BF16), None anywhere else (CPU, CUDA: set it yourself)."""
    return ASCEND_950_PEAK_TFLOPS.get(format_value) if device_type == "npu" else None


def step_throughput(flops: ModelFlops, tokens_per_s: float, world_size: int,
                    peak_tflops: float | None) -> dict[str, float | None]:
    """``{"tflops": model TFLOP/s per device, "hardware_tflops": with recompute, "mfu": tflops / peak
    (None without a peak)}`` for ``tokens_per_s`` tokens per second over all ``world_size`` devices."""
    per_device = tokens_per_s / max(world_size, 1)
    tflops = flops.training * per_device / 1e12
    return {
        "tflops": tflops,
        "hardware_tflops": flops.hardware * per_device / 1e12,
        "mfu": None if not peak_tflops else tflops / peak_tflops,
    }
