"""Q3 system-test harness: 2 gloo ranks running the production ``Trainer`` with an ``STProbe``.

Every run goes through ``load_config`` (a ``recipes/dsv3_tiny_<fmt>.yaml`` plus overrides) ->
``Trainer(DeepseekV3Task(), subscribers=[probe])`` -> ``setup`` -> ``train_step`` /
``save_dcp`` / ``load_dcp`` (spec 16.6). Nothing here quantizes, gathers or refreshes: the
probe (``te_npu.testing.STProbe``) only records the ``te_npu.events`` the production code
emits, and ``PhaseProbe.attach`` wraps the trainer's ``setup`` / ``forward_backward`` /
``optimizer_step`` *instance attributes* to tag each event with the phase it happened in (so
"no weight quantization during forward/backward" is checkable while ``train_step`` itself
drives the step; setup's initial weight quantization is tagged ``setup``).

Workers (``run_main_worker``, ``run_resume_worker``) are module-level so
``tests.distributed.harness.run_ranks`` can spawn them; they return plain dicts (records,
probes, a few tensors) that the tests assert on in the parent.

Parameters are BF16 (``training.param_dtype=bf16``, as on A5; the tiny CPU recipes default to
FP32 for speed): that is the dtype whose paths Q3 accepts (BF16 logical weights in DCP, FP32
router next to BF16 layers under FSDP2, BF16 GEMM outputs).

The model is the ``dsv3_tiny`` preset, shrunk by ``TINY_MODEL_OVERRIDES`` for speed:
2 layers (one dense-MLP layer, one MoE layer: every TE module kind is still present), and
``n_shared_experts: 2`` so the shared-expert gate/up weights have 128 rows (64 local rows on
2 ranks, the MXFP8 shard rule; a no-op once the preset itself has 2 shared experts).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import defaultdict
from pathlib import Path

from te_npu.testing.phase_probe import PhaseProbe
from te_npu.testing.q3_rules import (
    expected_activation_quants,
    expected_gemm_counts,
    expected_weight_fqns,
    gather_counts,
    unwrapped,
)
from te_npu.testing.q3_runs import make_trainer, resume_phase, run_phase

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
RECIPES = {fmt: REPO / "recipes" / f"dsv3_tiny_{fmt}.yaml" for fmt in ("bf16", "mxfp8", "hif8")}
FORMAT_VALUE = {"bf16": None, "mxfp8": "mxfp8_e4m3", "hif8": "hif8"}
TINY_MODEL_OVERRIDES = "model.overrides={num_hidden_layers: 2, n_shared_experts: 2}"
MAIN_STEPS, SAVE_AT = 20, 17  # Q3-01..03: 20 steps; Q3-09: save at N=17, continue N+3
GEMMS = ("fprop", "dgrad", "wgrad")


def st_overrides(fmt: str, workdir: str | os.PathLike, data_dir: str | os.PathLike, *extra: str) -> list[str]:
    """Overrides that turn ``recipes/dsv3_tiny_<fmt>.yaml`` into the ST configuration."""
    workdir = Path(workdir)
    return [
        TINY_MODEL_OVERRIDES,
        "training.seq_len=64",
        "training.micro_batch_size=2",
        f"training.train_steps={MAIN_STEPS}",
        "training.warmup_steps=2",
        "training.param_dtype=bf16",  # the A5 dtype (the CPU recipes default to fp32 for speed)
        "training.eval_interval=0",
        f"data.cache_dir={data_dir}",
        f"data.max_bytes={2**18}",
        f"logging.dir={workdir / 'logs'}",
        "logging.plot=false",
        f"checkpoint.dir={workdir / 'ckpt'}",
        "checkpoint.interval=0",
        "checkpoint.resume=false",
        *extra,
    ]


def st_config(fmt: str, workdir, data_dir, *extra: str):
    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.training.config import load_config

    return load_config(RECIPES[fmt], st_overrides(fmt, workdir, data_dir, *extra),
                       model_section=DeepseekV3Task.model_section)


# ---- probe, runs and rule helpers live in te_npu.testing (scripts/q3_acceptance.py runs the same) ----
__all__ = ["PhaseProbe", "expected_activation_quants", "expected_gemm_counts", "expected_weight_fqns",
           "gather_counts", "unwrapped"]


def _task():
    from models.deepseek_v3.pretrain import DeepseekV3Task

    return DeepseekV3Task()


def _record(result) -> dict:
    """One train step's result as the plain dict the tests compare (the Q3 runs record the same)."""
    return dataclasses.asdict(result)


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
    if "misaligned" in phases:
        from te_npu.errors import ConfigError

        misaligned = "model.overrides={num_hidden_layers: 2, n_shared_experts: 2, hidden_size: 96, v_head_dim: 48}"
        cfg = st_config(fmt, Path(workdir) / "misaligned", data_dir, misaligned)
        lines: list[str] = []
        trainer, _ = _trainer(cfg, lines)
        try:
            trainer.setup(cfg)
            error = None
        except ConfigError as exc:
            error = str(exc)
        out["misaligned_error"] = error
        out["misaligned_has_model"] = hasattr(trainer, "model")
        cfg = st_config(fmt, Path(workdir) / "fallback", data_dir, misaligned, "fsdp_config.fallback_to_unsharded=true")
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
