"""Acceptance system-test harness: 2 gloo ranks running the production ``Trainer`` with a ``PhaseProbe``.

Every run goes through ``load_config`` (a ``recipes/dsv3_tiny_<fmt>.yaml`` plus overrides) ->
``Trainer(DeepseekV3Task(), subscribers=[probe])`` -> ``setup`` -> ``train_step`` /
``save_dcp`` / ``load_dcp``. Nothing here quantizes, gathers or refreshes: the probe
(``te_npu.testing.phase_probe.PhaseProbe``) only records the ``te_npu.events`` the production code emits,
tagged with the trainer phase each happened in (so "no weight quantization during
forward/backward" is checkable while ``train_step`` itself drives the step).

The phases, their overrides and the Trainer's setup / abandon / close are the acceptance run's own
(``te_npu.testing.acceptance``: ``run_config.run_overrides`` on the CPU, with BF16 parameters as
on A5 and the 2-layer tiny model; ``runs.run_phase`` / ``resume_phase`` / ``closing``); this file
only adds the tests' step counts and spawns the ranks.

Workers (``run_main_worker``, ``run_resume_worker``) are module-level so
``tests.distributed.harness.run_ranks`` can spawn them; they return plain dicts (records,
probes, a few tensors) that the tests assert on in the parent.
"""
from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from pathlib import Path

from te_npu.testing.acceptance.matrix import MISALIGNED
from te_npu.testing.acceptance.run_config import TINY_MODEL_OVERRIDES, load_run_config, run_overrides
from te_npu.testing.acceptance.runs import closing, make_trainer, resume_phase, run_phase, step_record

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
RECIPES = {fmt: REPO / "recipes" / f"dsv3_tiny_{fmt}.yaml" for fmt in ("bf16", "mxfp8", "hif8")}
MAIN_STEPS, SAVE_AT = 20, 17  # Q3-01..03: 20 steps; Q3-09: save at N=17, continue N+3

__all__ = ["REPO", "WORLD", "RECIPES", "TINY_MODEL_OVERRIDES", "MAIN_STEPS", "SAVE_AT", "st_overrides", "st_config"]


def st_overrides(fmt: str, workdir: str | os.PathLike, data_dir: str | os.PathLike, *extra: str) -> list[str]:
    """Overrides that turn ``recipes/dsv3_tiny_<fmt>.yaml`` into the ST configuration: the acceptance
    run's CPU overrides, ``MAIN_STEPS`` as the schedule's length, then ``extra``."""
    return [*run_overrides(workdir, cpu=True, data_cache=data_dir), f"training.train_steps={MAIN_STEPS}", *extra]


def st_config(fmt: str, workdir, data_dir, *extra: str):
    from models.deepseek_v3.pretrain import DeepseekV3Task

    return load_run_config(RECIPES[fmt], st_overrides(fmt, workdir, data_dir, *extra), DeepseekV3Task.model_section)


def _task():
    from models.deepseek_v3.pretrain import DeepseekV3Task

    return DeepseekV3Task()


def _record(result) -> dict:
    """One train step's result as the plain dict the tests compare (the acceptance runs record the same)."""
    return step_record(result)


def _trainer(cfg, lines: list[str]):
    return make_trainer(_task(), lines)


def _run(cfg, steps: int, *, save_at: int | None = None, save_dir: str | None = None) -> dict:
    return run_phase(_task(), cfg, steps, save_at=save_at, save_dir=save_dir)


PHASES = {
    "main": ((), MAIN_STEPS),
    "variant": (("fsdp_config.reshard_after_forward=false", "activation_checkpoint.mode=full",
                 "training.gradient_accumulation_steps=2"), 3),
    "reshard_false": (("fsdp_config.reshard_after_forward=false",), 3),
    "recompute": (("activation_checkpoint.mode=full", "training.gradient_accumulation_steps=2"), 3),
}
"""phase -> (overrides on top of ``st_overrides``, optimizer steps)."""


@contextlib.contextmanager
def _backend(backend: str):
    """``"emulation"``: as is. ``"npu"``: every TE quantization and GEMM of the block runs through
    ``te_npu/ops/npu.py`` on the vendor-faithful fake torch_npu (installed in this process)."""
    if backend == "emulation":
        yield
        return
    from tests.npu_backend import npu_backend_process

    with npu_backend_process():
        yield


def run_main_worker(rank, world, workdir, data_dir, fmt, phases, backend="emulation"):
    """One spawned 2-rank job, several phases (each a fresh ``Trainer`` in the same process group),
    on ``backend`` ("emulation", or "npu": the NPU wrappers through the fake torch_npu):

    - ``main``: 20 steps, reshard_after_forward true, accumulation 1, DCP save after step 17;
    - ``variant``: reshard_after_forward false + activation_checkpoint full + accumulation 2, 3 steps;
    - ``reshard_false`` / ``recompute``: one of those switches alone (the slow duplicates);
    - ``misaligned``: MXFP8 with hidden_size 96 and v_head_dim 48 (o_proj ``[96, 96]``: 48 local
      rows and 48 local columns, no 64-aligned shard dim): setup must raise ``ConfigError``; with
      ``fallback_to_unsharded: true`` it trains 2 steps.
    """
    with _backend(backend):
        return _main_phases(workdir, data_dir, fmt, phases)


def _main_phases(workdir, data_dir, fmt, phases) -> dict:
    out = {}
    for phase in phases:
        if phase in PHASES:
            extra, steps = PHASES[phase]
            cfg = st_config(fmt, Path(workdir) / phase, data_dir, *extra)
            save = {"save_at": SAVE_AT, "save_dir": str(Path(workdir) / "dcp")} if phase == "main" else {}
            out[phase] = _run(cfg, steps, **save)
    if "misaligned" in phases:  # the acceptance run's misaligned phase (te_npu.testing.acceptance.matrix)
        from te_npu.errors import ConfigError

        cfg = st_config(fmt, Path(workdir) / "misaligned", data_dir, *MISALIGNED)
        trainer, _ = _trainer(cfg, [])
        error = None
        try:
            with closing(trainer):
                trainer.setup(cfg)
        except ConfigError as exc:
            error = str(exc)
        out["misaligned_error"] = error
        out["misaligned_has_model"] = hasattr(trainer, "model")
        cfg = st_config(fmt, Path(workdir) / "fallback", data_dir, *MISALIGNED, "fsdp_config.fallback_to_unsharded=true")
        out["fallback"] = _run(cfg, 2)
    return out


def run_resume_worker(rank, world, workdir, data_dir, fmt, steps, backend="emulation"):
    """Fresh processes: a new ``Trainer`` is set up, ``load_dcp`` restores step N, then ``steps`` more."""
    with _backend(backend):
        return _resume(workdir, data_dir, fmt, steps)


def _resume(workdir, data_dir, fmt, steps) -> dict:
    cfg = st_config(fmt, Path(workdir) / "resume", data_dir)
    return resume_phase(_task(), cfg, str(Path(workdir) / "dcp"), steps)


def spawn(fn, workdir, *args) -> list:
    """Run ``fn`` on 2 fresh gloo ranks (``tests.distributed.harness.run_ranks``)."""
    from tests.distributed.harness import run_ranks

    os.makedirs(workdir, exist_ok=True)
    return run_ranks(fn, WORLD, workdir, *args)


def per_step(records: list[dict], key: str) -> list:
    return [r[key] for r in records]


def group_by(items, key) -> dict:
    out = defaultdict(list)
    for item in items:
        out[key(item)].append(item)
    return out
