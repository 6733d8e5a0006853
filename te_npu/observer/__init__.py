"""``te_npu.observer``: the precision observer, per-GEMM quantization statistics of a real run
(Transformer Engine's precision debug tools, ``LogTensorStats`` / ``LogFp8TensorStats``).

``ObserverConfig`` (the YAML's ``precision_observer``) says which GEMMs, tensor roles, statistics
and steps; ``PrecisionObserver`` collects them from ``te_npu.events`` (``observer.py``);
``stats.py`` defines each statistic on one operand against its high-precision source."""
from te_npu.observer.config import DEFAULT_FREQ, ROLE_GEMMS, ObserverConfig
from te_npu.observer.observer import (
    ObservedStep,
    PrecisionObserver,
    StepFigures,
    gemm_names,
    quantized_weights,
)
from te_npu.observer.stats import STATISTICS, OperandFigures, operand_stats

__all__ = [
    "ObserverConfig",
    "PrecisionObserver",
    "StepFigures",
    "ObservedStep",
    "OperandFigures",
    "STATISTICS",
    "ROLE_GEMMS",
    "DEFAULT_FREQ",
    "gemm_names",
    "quantized_weights",
    "operand_stats",
]
