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
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from te_npu import events
from te_npu.compat import local_tensor
from te_npu.events import GemmEvent, QuantEvent
from te_npu.testing import STProbe

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
RECIPES = {fmt: REPO / "recipes" / f"dsv3_tiny_{fmt}.yaml" for fmt in ("bf16", "mxfp8", "hif8")}
FORMAT_VALUE = {"bf16": None, "mxfp8": "mxfp8_e4m3", "hif8": "hif8"}
TINY_MODEL_OVERRIDES = "model.overrides={num_hidden_layers: 2, n_shared_experts: 2}"
MAIN_STEPS, SAVE_AT = 20, 17  # Q3-01..03: 20 steps; Q3-09: save at N=17, continue N+3
GEMMS = ("fprop", "dgrad", "wgrad")
GROUPED_GEMMS_PER_CALL = {"TELinear": 0, "TEGroupedLinear": 1, "TEGroupedSwiGLUExperts": 2}
DENSE_GEMMS_PER_CALL = {"TELinear": 1, "TEGroupedLinear": 0, "TEGroupedSwiGLUExperts": 0}


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


# ---- probe --------------------------------------------------------------------------------------


@dataclass
class PhaseProbe(STProbe):
    """``STProbe`` that also records the phase (``setup`` / ``forward_backward`` / ``optimizer_step`` /
    ``other``) of every GEMM and quantization event, and the number of micro-steps per optimizer step."""

    phase: str = "other"
    gemm_phases: list[str] = field(default_factory=list)
    quant_phases: list[str] = field(default_factory=list)
    micro_steps: Counter = field(default_factory=Counter)

    def __call__(self, event: object) -> None:
        super().__call__(event)
        if isinstance(event, GemmEvent):
            self.gemm_phases.append(self.phase)
        elif isinstance(event, QuantEvent):
            self.quant_phases.append(self.phase)

    def attach(self, trainer) -> None:
        """Tag ``trainer``'s setup and two step pieces (instance attributes; read-only spies); once set
        up, record its model's module types (the trainer has this probe among its subscribers)."""
        assert self in trainer.subscribers
        setup, forward_backward, optimizer_step = trainer.setup, trainer.forward_backward, trainer.optimizer_step

        def tagged(phase, fn, count=False):
            def call(*args, **kwargs):
                if count:
                    self.micro_steps[self.current_step] += 1
                self.phase = phase
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.phase = "other"

            return call

        def setup_and_record(cfg):
            result = tagged("setup", setup)(cfg)
            self.on_setup(trainer.model, trainer.task.low_precision_scope(trainer.model))
            return result

        trainer.setup = setup_and_record
        trainer.forward_backward = tagged("forward_backward", forward_backward, count=True)
        trainer.optimizer_step = tagged("optimizer_step", optimizer_step)

    def quant_events_in(self, phase: str, step: int | None = None) -> list[QuantEvent]:
        return [e for (s, e), p in zip(self.quant_events, self.quant_phases) if p == phase and (step is None or s == step)]

    def gemm_events_in(self, phase: str) -> list[GemmEvent]:
        return [e for (_, e), p in zip(self.gemm_events, self.gemm_phases) if p == phase]


# ---- what the model's TE module list implies -----------------------------------------------------


def unwrapped(type_name: str) -> str:
    """FSDP2 renames a sharded module's class ``FSDP<cls>``; the probe records that name."""
    return type_name.removeprefix("FSDP")


def expected_gemm_counts(low_precision_modules: dict[str, str], micro_steps: int, recompute: bool = False) -> Counter:
    """``Counter[(kind, gemm)]`` of one optimizer step: 3 GEMMs per TE GEMM call per micro-batch
    (a TELinear is one dense GEMM, TEGroupedSwiGLUExperts two grouped ones); full recompute
    replays every forward once more in backward (fprop twice)."""
    types = [unwrapped(t) for t in low_precision_modules.values()]
    dense = sum(DENSE_GEMMS_PER_CALL[t] for t in types)
    grouped = sum(GROUPED_GEMMS_PER_CALL[t] for t in types)
    counts = Counter()
    for gemm in GEMMS:
        replay = 2 if recompute and gemm == "fprop" else 1
        if dense:
            counts[("dense", gemm)] = dense * micro_steps * replay
        if grouped:
            counts[("grouped", gemm)] = grouped * micro_steps * replay
    return counts


def expected_activation_quants(low_precision_modules: dict[str, str], fmt: str, micro_steps: int,
                               recompute: bool = False) -> int:
    """Quantization calls of one optimizer step inside forward/backward when only activations are
    quantized: every GEMM call quantizes its input X in forward and its dY in backward, each once
    (MXFP8 dense: one dual-axis call; MXFP8 grouped: a row call plus a ragged col call; HiF8: one
    call serves both orientations); full recompute quantizes X once more. A weight quantized
    during forward/backward would add to this count."""
    types = [unwrapped(t) for t in low_precision_modules.values()]
    dense = sum(DENSE_GEMMS_PER_CALL[t] for t in types)
    grouped = sum(GROUPED_GEMMS_PER_CALL[t] for t in types)
    per_source = {"dense": 1, "grouped": 2 if fmt == "mxfp8" else 1}
    sources = 2 + (1 if recompute else 0)  # X (forward, replayed by recompute) and dY (backward)
    return micro_steps * sources * (dense * per_source["dense"] + grouped * per_source["grouped"])


def expected_weight_fqns(low_precision_modules: dict[str, str]) -> set[str]:
    """Parameter FQNs of the 8-bit weights of the TE modules."""
    names = {"TELinear": ("weight",), "TEGroupedLinear": ("weight",), "TEGroupedSwiGLUExperts": ("gate_up_proj", "down_proj")}
    return {f"{m}.{n}" for m, t in low_precision_modules.items() for n in names[unwrapped(t)]}


# ---- workers --------------------------------------------------------------------------------------


def _local(t):
    return local_tensor(t)


def _record(r) -> dict:
    return dataclasses.asdict(r)


def _trainer(cfg, lines: list[str]):
    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.training.trainer import Trainer

    probe = PhaseProbe()
    trainer = Trainer(DeepseekV3Task(), print_fn=lines.append, subscribers=[probe])
    probe.attach(trainer)
    return trainer, probe


def _weight_state(trainer) -> dict:
    """Per quantized weight: class, local shapes; HiF8 local scales and whether they match the master."""
    import torch.distributed as dist

    from te_npu.numerics import hif8
    from te_npu.quantizers.hif8 import hif8_amax
    from te_npu.tensor import QuantizedWeightTensor

    out = {}
    for fqn, p in trainer.model.named_parameters():
        local = _local(p)
        if not isinstance(local, QuantizedWeightTensor):
            continue
        info = {"cls": type(local).__name__, "shape": tuple(p.shape), "local_shape": tuple(local.shape),
                "sharded": hasattr(p, "_local_tensor")}
        if local.format.value == "hif8":
            # current scaling from the FP32 master: amax * (1 / 15) (weights use the input maximum).
            # Grouped: per local expert from its own master; dense: amax MAX-reduced over the
            # FSDP group (the full weight's amax), so every rank holds the same scalar.
            amax = hif8_amax(_local(trainer.optimizer.masters[fqn])).float()
            if local.dim() == 2 and info["sharded"] and dist.is_initialized():
                dist.all_reduce(amax, op=dist.ReduceOp.MAX)
            info["scale"] = local.scale.clone()
            info["scale_matches_master"] = bool(torch.equal(local.scale, hif8.current_scale(amax, 15.0)))
        out[fqn] = info
    return out


def _optimizer_dtypes(trainer) -> dict:
    return {fqn: tuple(str(v.dtype) for v in trainer.optimizer.state_for(fqn).values())
            for fqn in trainer.optimizer.masters}


def _run(cfg, steps: int, *, save_at: int | None = None, save_dir: str | None = None) -> dict:
    lines: list[str] = []
    trainer, probe = _trainer(cfg, lines)
    try:
        trainer.setup(cfg)
        setup_refreshes = dict(probe.refresh_counts(-1))
        records = []
        for _ in range(steps):
            records.append(_record(trainer.train_step()))
            if save_at is not None and trainer.global_step == save_at:
                trainer.save_dcp(save_dir)
        result = {
            "records": records,
            "probe": probe,
            "setup_refreshes": setup_refreshes,
            "weights": _weight_state(trainer),
            "optimizer_dtypes": _optimizer_dtypes(trainer),
            "masters": {fqn: _local(m).detach().clone() for fqn, m in trainer.optimizer.masters.items()},
            "replicated": dict(trainer.shard_plan.replicated) if trainer.shard_plan else {},
            "param_names": [name for name, _ in trainer.model.named_parameters()],
            "buffer_names": [n for n in trainer.model.state_dict() if n not in dict(trainer.model.named_parameters())],
            "lines": lines,
        }
    finally:
        trainer.close()
    result["subscribed_after_close"] = events.has_subscribers()  # the trainer's subscriptions ended
    return result


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
    lines: list[str] = []
    trainer, probe = _trainer(cfg, lines)
    try:
        trainer.setup(cfg)
        before = {fqn: _local(m).clone() for fqn, m in trainer.optimizer.masters.items()}
        probe.begin_optimizer_step(-2)  # refreshes made by load_dcp land here
        step = trainer.load_dcp(str(Path(workdir) / "dcp"))
        load_refreshes = dict(probe.refresh_counts(-2))
        changed = sorted(fqn for fqn, m in trainer.optimizer.masters.items() if not torch.equal(_local(m), before[fqn]))
        records = [_record(trainer.train_step()) for _ in range(steps)]
        return {
            "step": step,
            "records": records,
            "load_refreshes": load_refreshes,
            "masters_changed_by_load": changed,
            "optimizer_dtypes": _optimizer_dtypes(trainer),
            "weights": _weight_state(trainer),
            "probe": probe,
        }
    finally:
        trainer.close()


def spawn(fn, workdir, *args) -> list:
    """Run ``fn`` on 2 fresh gloo ranks (``tests.distributed.harness.run_ranks``)."""
    from tests.distributed.harness import run_ranks

    os.makedirs(workdir, exist_ok=True)
    return run_ranks(fn, WORLD, workdir, *args)


def per_step(records: list[dict], key: str) -> list:
    return [r[key] for r in records]


def gather_counts(probe, step: int) -> Counter:
    """``Counter[(param_fqn, phase)]`` of the quantized-weight all-gathers of one step."""
    return Counter((g.context.param_fqn, g.context.phase) for g in probe.gathers(step))


def group_by(items, key) -> dict:
    out = defaultdict(list)
    for item in items:
        out[key(item)].append(item)
    return out
