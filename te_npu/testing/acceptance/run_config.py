"""How an acceptance run is configured: its settings, the model it runs, and the overrides that make
a recipe one of its runs.

``run_overrides`` is the one statement of those overrides; the acceptance run
(``scripts/q3_acceptance.py``) and the acceptance system tests (``tests/system/harness.py``) both
build their configurations from it. On the CPU (the tiny recipes) they also shrink the model and
the data: 2 layers (a dense-MLP layer and a MoE layer, so every TE module kind is present) with
2 shared experts (the shared-expert gate/up weights then have 128 rows: 64 local rows on 2 ranks,
the MXFP8 shard rule), 64-token sequences, micro-batches of 2, BF16 parameters as on the A5 (the
tiny recipes default to FP32 for speed) and a 256 KiB corpus.

``te_npu`` never imports ``models/``: the model's task and the two facts the rules derive from a
configuration (the TE module FQNs it implies, its layer counts) come in an ``AcceptanceModel``
from the caller.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FORMATS", "TINY_MODEL_OVERRIDES", "CPU_OVERRIDES", "run_overrides", "load_run_config",
           "AcceptanceModel", "RunSettings"]

FORMATS = ("bf16", "mxfp8", "hif8")
TINY_MODEL_OVERRIDES = "model.overrides={num_hidden_layers: 2, n_shared_experts: 2}"
CPU_OVERRIDES = (TINY_MODEL_OVERRIDES, "training.seq_len=64", "training.micro_batch_size=2",
                 "training.warmup_steps=2", "training.param_dtype=bf16", f"data.max_bytes={2**18}")
"""The CPU runs' model and data (module doc)."""


def run_overrides(workdir: str | os.PathLike, *, cpu: bool, data_cache: str | os.PathLike | None = None) -> list[str]:
    """Overrides that make a recipe one acceptance run: its own log and checkpoint folders under
    ``workdir``, no evaluation, no periodic save, no resume, no plots; ``cpu``: the CPU model and
    data (``CPU_OVERRIDES``); ``data_cache``: where the tokenized corpus is cached."""
    workdir = Path(workdir)
    return [*(CPU_OVERRIDES if cpu else ()), "training.eval_interval=0", f"logging.dir={workdir / 'logs'}",
            "logging.plot=false", f"checkpoint.dir={workdir / 'ckpt'}", "checkpoint.interval=0",
            "checkpoint.resume=false", *([f"data.cache_dir={data_cache}"] if data_cache is not None else [])]


def load_run_config(recipe: str | os.PathLike, overrides: Sequence[str], model_section):
    """``load_config`` of ``recipe`` with ``overrides`` (from ``run_overrides`` plus the run's own)."""
    from te_npu.training.config import load_config

    return load_config(recipe, list(overrides), model_section=model_section)


@dataclass(frozen=True)
class AcceptanceModel:
    """The model under acceptance. ``task_type``: a ``TrainTask`` class (one fresh task per phase;
    its ``model_section`` parses the configuration's model section); ``expected_scope(cfg)``: the
    FQNs the configuration's TE modules must have (rule ``check_scope``); ``layers(cfg)``: (decoder
    layers, MTP layers) (rule ``check_high_precision_pieces``)."""

    task_type: type
    expected_scope: Callable[[object], list[str]]
    layers: Callable[[object], tuple[int, int]]

    def task(self):
        return self.task_type()

    @property
    def model_section(self):
        return self.task_type.model_section


@dataclass(frozen=True)
class RunSettings:
    """One acceptance run, as its command line chose it: the report folder ``out``, a recipe per
    format, the device (``npu``; else the CPU emulation on gloo ranks), ranks per job, the main
    phases' optimizer steps, config overrides for every recipe, the cases, the model and the
    repository (for the commit and relative recipe paths in the report)."""

    out: Path
    recipes: dict[str, str]
    npu: bool
    nproc: int
    steps: int
    overrides: tuple[str, ...]
    cases: tuple[str, ...]
    model: AcceptanceModel
    repo: Path

    @property
    def backend(self) -> str:
        return "npu" if self.npu else "emulation"

    def config(self, fmt: str, workdir: Path, extra: Sequence[str] = ()):
        """``fmt``'s recipe as one run in ``workdir``: ``run_overrides``, then the command line's, then ``extra``."""
        data_cache = None if self.npu else self.out / "data_cache"
        base = run_overrides(workdir, cpu=not self.npu, data_cache=data_cache)
        return load_run_config(self.recipes[fmt], [*base, *self.overrides, *extra], self.model.model_section)
