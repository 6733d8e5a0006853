"""One acceptance phase through the production Trainer with a ``PhaseProbe``, as plain results.

``run_phase(task, cfg, steps)`` -> ``setup`` -> ``train_step`` x steps (``save_dcp`` after step
``save_at``) -> ``close``; ``resume_phase`` sets up a fresh Trainer, ``load_dcp`` and trains on.
Both return dicts (step records, the probe, per-weight state, optimizer dtypes, FP32 masters)
that the rules of ``te_npu.testing.acceptance.rules`` read. The acceptance system tests
(``tests/system``) and the acceptance run (``scripts/q3_acceptance.py``) both run their phases
through these two functions. ``closing(trainer)`` is the one place a Trainer's life ends: ``close``
when the block succeeds, ``abandon`` (then re-raise) when it fails.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from te_npu import events
from te_npu.compat import local_tensor
from te_npu.numerics import hif8
from te_npu.numerics.constants import HIF8_INPUT_MAX
from te_npu.quantizers.hif8 import hif8_amax
from te_npu.tensor import QuantizedWeightTensor
from te_npu.testing.phase_probe import PhaseProbe

__all__ = ["make_trainer", "closing", "step_record", "run_phase", "resume_phase", "weight_state", "optimizer_dtypes"]


def make_trainer(task, lines: list[str], subscribers=()):
    """A production ``Trainer`` for ``task`` with an attached ``PhaseProbe`` (printing into ``lines``)."""
    from te_npu.training.trainer import Trainer

    probe = PhaseProbe()
    trainer = Trainer(task, print_fn=lines.append, subscribers=[probe, *subscribers])
    probe.attach(trainer)
    return trainer, probe


@contextlib.contextmanager
def closing(trainer):
    """``close`` the trainer when the block succeeds; ``abandon`` it and re-raise when the block
    raises (anything, Ctrl-C included): no process group, subscription or open file outlives it."""
    try:
        yield trainer
    except BaseException:
        trainer.abandon()
        raise
    trainer.close()


def step_record(result) -> dict:
    """One ``train_step`` result as the plain dict the rules and reports read."""
    return dataclasses.asdict(result)


def weight_state(trainer) -> dict:
    """Per quantized weight: class, logical and local shapes, whether sharded; HiF8: its local
    scale and whether it is ``amax(master) * (1 / 15)`` (dense: amax MAX-reduced over the FSDP group)."""
    out = {}
    for fqn, p in trainer.model.named_parameters():
        local = local_tensor(p)
        if not isinstance(local, QuantizedWeightTensor):
            continue
        info = {"cls": type(local).__name__, "shape": tuple(p.shape), "local_shape": tuple(local.shape),
                "sharded": hasattr(p, "_local_tensor")}
        if local.format.value == "hif8":
            amax = hif8_amax(local_tensor(trainer.optimizer.masters[fqn])).float()
            if local.dim() == 2 and info["sharded"] and dist.is_initialized():
                dist.all_reduce(amax, op=dist.ReduceOp.MAX)
            info["scale"] = local.scale.detach().cpu().clone()
            info["scale_matches_master"] = bool(torch.equal(local.scale.cpu(), hif8.current_scale(amax, HIF8_INPUT_MAX).cpu()))
        out[fqn] = info
    return out


def optimizer_dtypes(trainer) -> dict:
    """FQN -> the dtypes of its optimizer state (master, exp_avg, exp_avg_sq, step)."""
    return {fqn: tuple(str(v.dtype) for v in trainer.optimizer.state_for(fqn).values())
            for fqn in trainer.optimizer.masters}


def _buffers(trainer) -> dict:
    """FQN -> a CPU copy of every buffer of the model (e.g. DeepSeek-V3's router biases)."""
    return {fqn: b.detach().cpu().clone() for fqn, b in trainer.model.named_buffers()}


def run_phase(task, cfg, steps: int, *, save_at: int | None = None, save_dir: str | None = None,
              subscribers=()) -> dict:
    """Set up, train ``steps`` optimizer steps (``save_dcp(save_dir)`` after step ``save_at``), close."""
    lines: list[str] = []
    trainer, probe = make_trainer(task, lines, subscribers)
    with closing(trainer):
        trainer.setup(cfg)
        setup_refreshes = dict(probe.refresh_counts(-1))
        records = []
        for _ in range(steps):
            records.append(step_record(trainer.train_step()))
            if save_at is not None and trainer.global_step == save_at:
                trainer.save_dcp(save_dir)
        params = dict(trainer.model.named_parameters())
        result = {
            "records": records,
            "probe": probe,
            "setup_refreshes": setup_refreshes,
            "weights": weight_state(trainer),
            "optimizer_dtypes": optimizer_dtypes(trainer),
            "masters": {fqn: local_tensor(m).detach().cpu().clone() for fqn, m in trainer.optimizer.masters.items()},
            "replicated": dict(trainer.shard_plan.replicated) if trainer.shard_plan else {},
            "param_names": list(params),
            "buffer_names": [n for n in trainer.model.state_dict() if n not in params],
            "buffers": _buffers(trainer),
            "lines": lines,
        }
    result["subscribed_after_close"] = events.has_subscribers()  # the trainer's subscriptions ended
    return result


def resume_phase(task, cfg, dcp_dir: str, steps: int) -> dict:
    """A fresh Trainer: ``setup``, ``load_dcp(dcp_dir)`` (its refreshes filed under step -2), ``steps`` more."""
    lines: list[str] = []
    trainer, probe = make_trainer(task, lines)
    with closing(trainer):
        trainer.setup(cfg)
        before = {fqn: local_tensor(m).clone() for fqn, m in trainer.optimizer.masters.items()}
        probe.begin_optimizer_step(-2)  # refreshes made by load_dcp land here
        step = trainer.load_dcp(dcp_dir)
        load_refreshes = dict(probe.refresh_counts(-2))
        changed = sorted(fqn for fqn, m in trainer.optimizer.masters.items()
                         if not torch.equal(local_tensor(m), before[fqn]))
        records = [step_record(trainer.train_step()) for _ in range(steps)]
        result = {
            "step": step,
            "records": records,
            "load_refreshes": load_refreshes,
            "masters_changed_by_load": changed,
            "optimizer_dtypes": optimizer_dtypes(trainer),
            "weights": weight_state(trainer),
            "masters": {fqn: local_tensor(m).detach().cpu().clone() for fqn, m in trainer.optimizer.masters.items()},
            "buffers": _buffers(trainer),
            "probe": probe,
            "lines": lines,
        }
    return result
