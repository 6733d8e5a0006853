"""The generic trainer and its rooms.

At the top: ``trainer`` (the ``Trainer``: the build order and the step loop) and
``checkpointer`` (the ``Checkpointer`` it holds: its on-disk side), ``job`` (the entry point's
error path), ``runtime`` (the launch environment and the stop request, below both), ``launch``
and ``launch_report`` (the launcher and its one-line summary), ``mapped_files``, ``config`` /
``schema`` (the YAML sections), ``schedule`` and ``recompute``. The rooms: ``data`` (every data
kind, blends, splits, samplers, checksums), ``metrics`` (step lines, ``metrics.jsonl``, plots,
throughput / MFU), ``guards`` (preflight, divergence rules, the stall watch), ``hf`` (Hugging
Face start, export and conversion) and ``capacity`` (the memory estimate and its tracker).
Importing this package loads the config, the data entry and the metrics logger, not the Trainer.
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
from te_npu.training.metrics.log import MetricsLogger, format_step_line, peak_memory_mb, read_metrics

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
