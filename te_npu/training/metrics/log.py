"""Run metrics: Megatron-style step lines, ``metrics.jsonl``, optional TensorBoard, peak memory.

Only rank 0 writes: on other ranks ``MetricsLogger`` is silent and creates no files.

``metrics.jsonl`` holds one JSON object per line:

- ``{"kind": "config", "time", "config": {...}}`` - the resolved config, once per start;
- ``{"kind": "train", "step", "train_steps", "time", "lm_loss", "lr", "grad_norm",
  "elapsed_ms", "tokens_per_s", "global_batch_size", "consumed_samples",
  "skipped_iterations", "peak_mem_mb", "tflops", "mfu", ...losses, ...extra}`` (``tflops``: model
  TFLOP/s per device, ``mfu``: its share of the device's peak; null where unknown; ``losses``: a
  task's named loss parts beside ``lm_loss``, e.g. ``balance_loss``; ``extra``: what the task
  reports per step, e.g. per-layer routing figures);
- ``{"kind": "val", "step", "time", "lm_loss", "ppl", ...losses}``.

TensorBoard gets the fixed tags below, each loss part as ``<name>/train`` (``<name>/validation``)
and every numeric ``extra`` value under its own key.

- ``{"kind": "resume", "step", "time", "redone"}`` - a resumed run continues the file from ``step``.

Non-finite floats are written as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict JSON;
``float()`` reads them back). The file is appended to, so a resumed run continues it. A run that
resumes at step ``K`` first moves the ``train`` / ``val`` records of steps after ``K`` -- the
steps it is about to redo, written by the attempt that died or was rolled back -- into
``<name>.redone.jsonl`` (``resume_at``): every step appears once in ``metrics.jsonl``, and
nothing is lost. A fresh run (``fresh=True``: nothing resumed) in a ``logging.dir`` that holds
an earlier run's file starts a clean one: the old ``metrics.jsonl`` (and its ``.redone.jsonl``)
move to ``metrics.<N>.jsonl`` (the first free N), named in one line. Readers still keep the last
record of each (kind, step).
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["MetricsLogger", "format_step_line", "format_validation_line", "peak_memory_mb", "read_metrics"]


_TB_TAGS = {  # TensorBoard tag -> train record field
    "lm-loss/train": "lm_loss",
    "learning-rate": "lr",
    "grad-norm": "grad_norm",
    "tokens-per-second": "tokens_per_s",
    "iteration-time-ms": "elapsed_ms",
    "peak-mem-mb": "peak_mem_mb",
    "throughput/tflops-per-device": "tflops",
    "throughput/mfu": "mfu",
}


def format_step_line(
    *,
    step: int,
    train_steps: int,
    consumed_samples: int,
    elapsed_ms: float,
    lr: float,
    global_batch_size: int,
    lm_loss: float,
    grad_norm: float | None,
    skipped_iterations: int,
    tokens_per_s: float,
    peak_mem_mb: float | None,
    tflops: float | None = None,
    mfu: float | None = None,
    losses: Mapping[str, float] | None = None,
    summary: str | None = None,
) -> str:
    """One Megatron-style training line (``grad_norm`` None when clipping is off and unmeasured;
    ``tflops`` / ``mfu`` shown when the model's FLOPs / the device's peak are known; each of
    ``losses`` after ``lm loss`` as ``<name with spaces>: value``, Megatron's way of printing its
    MoE / MTP losses; ``summary`` (a task's short report) last)."""
    fields = [
        f" iteration {step:8d}/{train_steps:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
        f"learning rate: {lr:.3E}",
        f"global batch size: {global_batch_size:5d}",
        f"lm loss: {lm_loss:.6E}",
        *(f"{_loss_label(name)}: {value:.6E}" for name, value in (losses or {}).items()),
        f"grad norm: {'n/a' if grad_norm is None else f'{grad_norm:.3f}'}",
        f"skipped iterations: {skipped_iterations:3d}",
        f"tokens/s: {tokens_per_s:.1f}",
    ]
    if tflops is not None:
        fields.append(f"throughput per device (TFLOP/s/device): {tflops:.3g}")
        fields.append(f"MFU: {'n/a' if mfu is None else f'{mfu:.1%}'}")
    fields.append(f"peak mem (MB): {'n/a' if peak_mem_mb is None else f'{peak_mem_mb:.1f}'}")
    if summary:
        fields.append(summary)
    return " | ".join(fields) + " |"


def format_validation_line(*, step: int, lm_loss: float, losses: Mapping[str, float] | None = None) -> str:
    """Megatron's validation line: loss and perplexity, then each named loss part's value."""
    extra = "".join(f" {_loss_label(name)} value: {value:.6E} |" for name, value in (losses or {}).items())
    return (f" validation loss at iteration {step} | lm loss value: {lm_loss:.6E} | lm loss PPL: "
            f"{_ppl(lm_loss):.6E} |{extra}")


def _loss_label(name: str) -> str:
    """``balance_loss`` -> ``balance loss`` (a loss part's name as the step line prints it)."""
    return name.replace("_", " ")


def peak_memory_mb(device: torch.device | str) -> float:
    """Peak memory in MiB: ``max_memory_allocated`` on cuda/npu, process max RSS on CPU.

    For ``npu`` the caller has imported torch_npu already (it registers ``torch.npu``).
    """
    device = torch.device(device)
    if device.type == "cpu":
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return rss / 2**20 if sys.platform == "darwin" else rss / 2**10
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "max_memory_allocated"):
        raise RuntimeError(f"peak_memory_mb: torch.{device.type}.max_memory_allocated is not available")
    return backend.max_memory_allocated(device) / 2**20


class MetricsLogger:
    """Step/validation logging for rank 0: stdout line, jsonl record, TensorBoard scalars.

    ``tensorboard=True`` uses ``torch.utils.tensorboard.SummaryWriter`` when the
    ``tensorboard`` package is importable; otherwise a note is printed and the run goes on.
    """

    def __init__(
        self,
        log_dir: str | Path,
        *,
        train_steps: int,
        rank: int = 0,
        jsonl_name: str = "metrics.jsonl",
        tensorboard: bool = False,
        print_fn: Callable[[str], None] = print,
        fresh: bool = False,
    ):
        self.enabled = rank == 0
        self.train_steps = train_steps
        self.log_dir = Path(log_dir)
        self.jsonl_path = self.log_dir / jsonl_name
        self._print = print_fn
        self._jsonl = None
        self._tb = None
        if not self.enabled:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            self._set_aside_earlier_run()
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if tensorboard:
            self._tb = _open_tensorboard(self.log_dir / "tensorboard", print_fn)

    def log_config(self, config: dict[str, Any]) -> None:
        """Record the resolved config (jsonl ``config`` record)."""
        self._write({"kind": "config", "time": time.time(), "config": config})

    def log_step(
        self,
        step: int,
        *,
        lm_loss: float,
        lr: float,
        grad_norm: float | None,
        elapsed_ms: float,
        global_batch_size: int,
        consumed_samples: int,
        tokens_per_s: float,
        skipped_iterations: int = 0,
        peak_mem_mb: float | None = None,
        tflops: float | None = None,
        mfu: float | None = None,
        losses: Mapping[str, float] | None = None,
        extra: dict[str, Any] | None = None,
        summary: str | None = None,
    ) -> str | None:
        """Print the step line and record it; returns the line (None on ranks != 0).

        ``losses``: named loss parts beside ``lm_loss`` (line, record, ``<name>/train`` scalars);
        ``extra``: more record fields (numeric ones also TensorBoard scalars under their key);
        ``summary``: appended to the step line."""
        if not self.enabled:
            return None
        values = dict(
            lm_loss=float(lm_loss),
            lr=float(lr),
            grad_norm=None if grad_norm is None else float(grad_norm),
            elapsed_ms=float(elapsed_ms),
            global_batch_size=int(global_batch_size),
            consumed_samples=int(consumed_samples),
            tokens_per_s=float(tokens_per_s),
            skipped_iterations=int(skipped_iterations),
            peak_mem_mb=None if peak_mem_mb is None else float(peak_mem_mb),
            tflops=None if tflops is None else float(tflops),
            mfu=None if mfu is None else float(mfu),
        )
        losses = {name: float(value) for name, value in (losses or {}).items()}
        line = format_step_line(step=step, train_steps=self.train_steps, **values, losses=losses, summary=summary)
        self._print(line)
        record = {"kind": "train", "step": step, "train_steps": self.train_steps, "time": time.time(), **values}
        self._write({**record, **losses, **(extra or {})})
        self._scalars(step, {
            **{tag: values[key] for tag, key in _TB_TAGS.items()},
            **{f"{name}/train": value for name, value in losses.items()},
            **_numeric(extra or {}),
        })
        return line

    def log_validation(self, step: int, *, lm_loss: float, losses: Mapping[str, float] | None = None) -> str | None:
        """Print and record a validation result (mean losses over the eval batches)."""
        if not self.enabled:
            return None
        losses = {name: float(value) for name, value in (losses or {}).items()}
        line = format_validation_line(step=step, lm_loss=float(lm_loss), losses=losses)
        self._print(line)
        self._write({"kind": "val", "step": step, "time": time.time(), "lm_loss": float(lm_loss), "ppl": _ppl(lm_loss),
                     **losses})
        self._scalars(step, {"lm-loss/validation": float(lm_loss),
                             **{f"{name}/validation": value for name, value in losses.items()}})
        return line

    def resume_at(self, step: int) -> int:
        """The run continues from ``step``: move the train / val records of later steps to
        ``<name>.redone.jsonl`` and record the resume; returns how many records moved."""
        if self._jsonl is None:
            return 0
        self._jsonl.close()
        kept, redone = [], []
        for line in self.jsonl_path.read_text(encoding="utf-8").splitlines(keepends=True):
            try:
                record = json.loads(line)
            except ValueError:
                kept.append(line)  # not ours to judge: left as it is
                continue
            later = isinstance(record, dict) and record.get("kind") in ("train", "val") and \
                isinstance(record.get("step"), int) and record["step"] > step
            (redone if later else kept).append(line)
        if redone:
            with open(self.jsonl_path.with_suffix(".redone.jsonl"), "a", encoding="utf-8") as f:
                f.writelines(redone)
                f.flush()
                os.fsync(f.fileno())
            tmp = self.jsonl_path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, self.jsonl_path)
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._write({"kind": "resume", "step": int(step), "time": time.time(), "redone": len(redone)})
        return len(redone)

    def _set_aside_earlier_run(self) -> None:
        """A fresh run: an earlier run's non-empty file (and its redone records) moves to
        ``<stem>.<N>.jsonl`` (``<stem>.<N>.redone.jsonl``), N the first number free for both."""
        if not self.jsonl_path.is_file() or self.jsonl_path.stat().st_size == 0:
            return
        redone = self.jsonl_path.with_suffix(".redone.jsonl")
        n = 1
        while any(p.exists() for p in self._aside(n)):
            n += 1
        aside, aside_redone = self._aside(n)
        os.rename(self.jsonl_path, aside)
        moved = [aside.name]
        if redone.exists():
            os.rename(redone, aside_redone)
            moved.append(aside_redone.name)
        self._print(f" note: {self.jsonl_path} held an earlier run's records (this run starts fresh): moved to "
                    f"{' and '.join(moved)} in {self.log_dir}")

    def _aside(self, n: int) -> tuple[Path, Path]:
        stem = self.jsonl_path.name.removesuffix(".jsonl")
        return self.log_dir / f"{stem}.{n}.jsonl", self.log_dir / f"{stem}.{n}.redone.jsonl"

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, record: dict[str, Any]) -> None:
        if self._jsonl is None:
            return
        self._jsonl.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")
        self._jsonl.flush()

    def _scalars(self, step: int, scalars: dict[str, float | None]) -> None:
        if self._tb is None:
            return
        for tag, value in scalars.items():
            if value is not None:
                self._tb.add_scalar(tag, value, step)
        self._tb.flush()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl``, non-finite strings turned back into floats, the last
    record of each (kind, step) kept, in step order per kind."""
    latest: dict[tuple[str, Any], dict[str, Any]] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = _json_restore(json.loads(line))
            latest[(record.get("kind"), record.get("step"))] = record
    return sorted(latest.values(), key=lambda r: (str(r.get("kind")), r.get("step") or 0))


def _open_tensorboard(path: Path, print_fn: Callable[[str], None]) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the optional `tensorboard` package
    except ImportError as exc:
        print_fn(f"note: TensorBoard logging requested but unavailable ({exc}); continuing without it")
        return None
    return SummaryWriter(log_dir=str(path))


def _numeric(extra: Mapping[str, Any]) -> dict[str, float]:
    """The plain numbers of ``extra`` (not bools, nested mappings or text): TensorBoard scalars."""
    return {k: float(v) for k, v in extra.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _ppl(loss: float) -> float:
    return math.exp(min(float(loss), 700.0)) if math.isfinite(loss) else float("nan")


_NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _json_restore(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: (v if k == "config" else _json_restore(v)) for k, v in value.items()}
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    return value
