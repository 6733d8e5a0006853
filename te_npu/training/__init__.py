"""Generic training pieces: YAML config schema, token data and samplers, metrics logging.

The Trainer, FSDP2 wiring and DCP live elsewhere; these pieces never build a model.
"""
from te_npu.training.config import TrainConfig, load_config
from te_npu.training.data import (
    TokenBatcher,
    TokenDataset,
    build_datasets,
    build_stdlib_corpus,
    validation_batches,
    write_token_file,
)
from te_npu.training.metrics_log import MetricsLogger, format_step_line, peak_memory_mb, read_metrics

__all__ = [
    "TrainConfig",
    "load_config",
    "TokenDataset",
    "TokenBatcher",
    "build_datasets",
    "build_stdlib_corpus",
    "validation_batches",
    "write_token_file",
    "MetricsLogger",
    "format_step_line",
    "peak_memory_mb",
    "read_metrics",
]
