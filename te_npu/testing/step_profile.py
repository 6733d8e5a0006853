"""Profile a few training steps and say where their time went (``te_npu.testing.time_shares``).

``profile_steps(step, steps, out_dir, npu=...)`` runs ``step()`` ``steps`` times under a
profiler, writes the evidence into ``out_dir`` and returns the shares
(``te_npu.testing.time_shares``) with the per-step wall times. Every profiler specific lives
here; torch_npu is imported only when ``npu`` is true.

- elsewhere (CPU, CUDA): ``torch.profiler.profile`` (CPU activity, plus CUDA where a GPU is
  there); writes ``trace.json`` (``export_chrome_trace``) and ``table.txt`` (``key_averages``
  by self time).
- ``npu``: ``torch_npu.profiler.profile`` (CPU + NPU activities, level 1, text export, the
  same API) with ``tensorboard_trace_handler(out_dir)``; its parsed
  ``*_ascend_pt/ASCEND_PROFILER_OUTPUT/trace_view.json`` is read with the device tasks of
  ``Ascend Hardware`` and the ``Communication`` thread of ``HCCL`` as device spans (its
  ``Overlap Analysis`` view skipped). Written against the documented trace layout; not yet run
  on an A5 -- the trace stays beside the numbers to recompute them.

te_npu's op ranges (``te_npu.ops.profiling``) are forced open meanwhile, whatever profiler
records. Each step's wall time ends with a device synchronize (NPU / CUDA).
"""
from __future__ import annotations

import glob
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from te_npu.ops.profiling import ranges_forced
from te_npu.testing.time_shares import time_shares
from te_npu.testing.trace_spans import spans_from_chrome_trace

__all__ = ["profile_steps", "NPU_TRACE_LAYOUT"]

NPU_TRACE_LAYOUT = {"device_processes": ("Ascend Hardware", "HCCL"), "skip_processes": ("Overlap Analysis",),
                    "only_threads": {"HCCL": "Communication"}}
"""How ``spans_from_chrome_trace`` reads torch_npu's ``trace_view.json``."""


def _sync(npu: bool) -> None:
    if npu:
        torch.npu.synchronize()
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(step: Callable[[], object], npu: bool) -> float:
    start = time.perf_counter()
    step()
    _sync(npu)
    return (time.perf_counter() - start) * 1e6


def _torch_profile(step, steps: int, out: Path) -> tuple[list[float], dict, dict]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        walls = [_timed(step, False) for _ in range(steps)]
    prof.export_chrome_trace(str(out / "trace.json"))
    (out / "table.txt").write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60) + "\n")
    return walls, json.loads((out / "trace.json").read_text()), {}


def _npu_profile(step, steps: int, out: Path) -> tuple[list[float], dict, dict]:
    import torch_npu

    p = torch_npu.profiler
    experimental = p._ExperimentalConfig(export_type=p.ExportType.Text, profiler_level=p.ProfilerLevel.Level1,
                                         aic_metrics=p.AiCMetrics.AiCoreNone)
    with p.profile(activities=[p.ProfilerActivity.CPU, p.ProfilerActivity.NPU],
                   schedule=p.schedule(wait=0, warmup=0, active=steps, repeat=1),
                   on_trace_ready=p.tensorboard_trace_handler(str(out)), experimental_config=experimental) as prof:
        walls = []
        for _ in range(steps):
            walls.append(_timed(step, True))
            prof.step()
    found = sorted(glob.glob(str(out / "*_ascend_pt" / "ASCEND_PROFILER_OUTPUT" / "trace_view.json")))
    if not found:
        raise FileNotFoundError(f"torch_npu profiler wrote no */ASCEND_PROFILER_OUTPUT/trace_view.json under {out}")
    return walls, json.loads(Path(found[-1]).read_text()), NPU_TRACE_LAYOUT


def profile_steps(step: Callable[[], object], steps: int, out_dir: str | Path, *, npu: bool = False) -> dict:
    """Run ``step()`` ``steps`` times under the profiler; returns ``{"steps", "step_wall_ms": [...],
    "shares": time_shares(...), "files": [names under out_dir]}`` (shares over the summed wall time)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with ranges_forced():
        walls, trace, layout = (_npu_profile if npu else _torch_profile)(step, steps, out)
    shares = time_shares(spans_from_chrome_trace(trace, **layout), sum(walls))
    return {"steps": steps, "step_wall_ms": [round(w / 1000, 3) for w in walls], "shares": shares,
            "files": sorted(str(p.relative_to(out)) for p in out.iterdir())}
