"""The acceptance run's report: ``report.md`` / ``report.json``, ``environment.json`` and the curves.

``report.json``: the environment file's name, the curves, per (job, phase) peak memory, the
reshard / recompute differences, the time shares per format, every case's verdict and a summary
of the verdicts. ``report.md`` shows the same as tables: one row per case (verdict, reasons,
evidence folders), the measured values of Q3-09 / Q3-11, then

- time shares: per format, the percent of step wall time (and ms per step) spent in quant,
  MM-GMM, all-gather, reduce-scatter and other, from the profiled job
  (``te_npu.testing.time_shares``, mean over the ranks);
- reshard and recompute: per format, the phase with the switch flipped
  (``reshard_after_forward: false``; full recompute) against the main phase over the same steps
  2..``SHORT_STEPS`` (same data): mean step time (rank 0) and global peak memory;
- peak memory per job and phase: every rank's and the largest (the global peak).

``environment.json``: commit, torch / torch_npu / CANN, device, each YAML as run, the seeds,
the world size.
"""
from __future__ import annotations

import json
import os
import subprocess
from collections import Counter

from te_npu.testing.acceptance.job_files import JobFiles, write_json
from te_npu.testing.acceptance.matrix import FAIL, PROFILE_STEPS, SHORT_STEPS
from te_npu.testing.acceptance.run_config import FORMATS, RunSettings
from te_npu.testing.time_shares import CATEGORIES, mean_over_ranks

__all__ = ["write_report"]

_CATEGORY_NAMES = {"quant": "quant", "mm_gmm": "MM-GMM", "all_gather": "all-gather",
                   "reduce_scatter": "reduce-scatter", "other": "other"}


def write_report(settings: RunSettings, verdicts: list[dict]) -> int:
    """Write every report file of ``settings.out``; the run's exit code (1 when some case failed)."""
    files = JobFiles(settings.out, settings.nproc)
    env = _environment(settings)
    write_json(settings.out / "environment.json", env)
    curves = _plot(settings, files)
    memory = _memory(settings, files)
    switches = _switches(files, memory)
    shares = _time_shares(files)
    report = {"tool": "scripts/q3_acceptance.py", "environment": "environment.json", "curves": curves,
              "memory": memory, "reshard_recompute": switches, "time_shares": shares, "cases": verdicts,
              "summary": dict(Counter(v["verdict"] for v in verdicts))}
    write_json(settings.out / "report.json", report)
    lines = [f"# Q3 acceptance ({env['backend']}, {settings.nproc} ranks, commit {str(env['commit'])[:12]})", "",
             f"torch {env['torch']}, torch_npu {env['torch_npu']}, CANN {env['cann']}, device {env['device']}; "
             f"recipes: " + ", ".join(f"{f} `{os.path.relpath(p, settings.repo)}`" for f, p in settings.recipes.items()),
             "", "| case | what | verdict | reasons | evidence |", "|---|---|---|---|---|"]
    for v in verdicts:
        reasons = "<br>".join(v["reasons"][:4]) + (f"<br>... {len(v['reasons']) - 4} more" if len(v["reasons"]) > 4 else "")
        lines.append(f"| {v['id']} | {v['title']} | **{v['verdict']}** | {reasons} | {', '.join(v['evidence'][:3])} |")
    for v in verdicts:
        if v["measured"]:
            lines += ["", f"{v['id']} measured: `{json.dumps(v['measured'], default=str)}`"]
    lines += _time_share_lines(shares) + _switch_lines(settings, switches) + _memory_lines(memory)
    lines += ["", f"Curves: {', '.join(curves)}. Environment (each YAML as run, seed, versions): environment.json."]
    (settings.out / "report.md").write_text("\n".join(lines) + "\n")
    return 0 if all(v["verdict"] != FAIL for v in verdicts) else 1


def _environment(settings: RunSettings) -> dict:
    import torch

    from te_npu.ops.capability import read_gate

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=settings.repo, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = None
    configs = {}
    for f in settings.recipes:
        try:
            configs[f] = settings.config(f, settings.out / "env").to_dict()
        except Exception as exc:  # noqa: BLE001 - reported, the cases will fail on it
            configs[f] = f"{type(exc).__name__}: {exc}"
    gate = read_gate()  # what the capability gate read (as the self-check reports it)
    return {"commit": commit, "torch": torch.__version__, "torch_npu": gate.torch_npu,
            "cann": gate.cann_version, "device": gate.device_name,
            "backend": settings.backend, "world_size": settings.nproc, "recipes": settings.recipes,
            "overrides": list(settings.overrides), "configs_as_run": configs,
            "seed": {f: c["training"]["seed"] for f, c in configs.items() if isinstance(c, dict)}}


def _plot(settings: RunSettings, files: JobFiles) -> list[str]:
    """``curves_loss.png`` / ``curves_grad_norm.png``: each format's main phase (rank 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, name in (("lm_loss", "loss"), ("grad_norm", "grad_norm")):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for f in FORMATS:
            ranks = files.read(f"train-{f}", "main")
            if ranks and ranks[0].get("records"):
                recs = ranks[0]["records"]
                ax.plot([r["step"] for r in recs], [r[key] for r in recs], label=f)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(key)
        ax.legend()
        fig.tight_layout()
        path = settings.out / f"curves_{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path.name)
    return written


def _memory(settings: RunSettings, files: JobFiles) -> dict:
    """Per job and phase: per-rank and global peak memory (device bytes allocated on an NPU, host
    peak RSS here), each phase's own peak (reset when it began)."""
    key = "device_max_allocated_bytes" if settings.npu else "host_peak_rss_bytes"
    out = {}
    for job_dir in sorted((settings.out / "jobs").glob("*")):
        for phase_dir in sorted(p for p in job_dir.glob("*") if p.is_dir()):
            ranks = files.read(job_dir.name, phase_dir.name)
            if not ranks:
                continue
            per_rank = [d.get("memory", {}).get(key) for d in ranks]
            known = [v for v in per_rank if v is not None]
            out[f"{job_dir.name}/{phase_dir.name}"] = {
                "what": key, "per_rank": per_rank, "global_max": max(known) if known else None,
                "since": sorted({d.get("memory", {}).get("host_peak_since", "phase") for d in ranks})}
    return out


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _switches(files: JobFiles, memory: dict) -> dict:
    """The reshard / recompute differences (module doc), from the jobs' own data; the main phase's
    peak also covers its later steps and the DCP save."""
    out = {}
    for f in FORMATS:
        main = files.read(f"train-{f}", "main")
        if not main or not main[0].get("records"):
            continue
        for phase, switch in (("reshard_false", "reshard_after_forward true -> false"),
                              ("recompute", "activation_checkpoint none -> full")):
            other = files.read(f"train-{f}", phase)
            if not other or not other[0].get("records"):
                continue
            base_ms = _mean(r["elapsed_ms"] for r in main[0]["records"][1:SHORT_STEPS])
            ms = _mean(r["elapsed_ms"] for r in other[0]["records"][1:SHORT_STEPS])
            base_mem = memory.get(f"train-{f}/main", {}).get("global_max")
            mem = memory.get(f"train-{f}/{phase}", {}).get("global_max")
            out[f"{f}/{phase}"] = {
                "switch": switch, "steps": f"2..{SHORT_STEPS}", "step_ms": [base_ms, ms],
                "step_time_change": None if not base_ms or ms is None else ms / base_ms - 1,
                "peak_bytes": [base_mem, mem],
                "peak_change_bytes": None if base_mem is None or mem is None else mem - base_mem}
    return out


def _time_shares(files: JobFiles) -> dict:
    """Per format: the profiled job's time shares, per rank and their mean over the ranks."""
    out = {}
    for f in FORMATS:
        ranks = files.read("profile", f)
        if not ranks:
            continue
        errors = [f"rank {r}: {d['error']}" for r, d in enumerate(ranks) if "error" in d]
        if errors:
            out[f] = {"error": errors}
            continue
        shares = [d["shares"] for d in ranks]
        out[f] = {**mean_over_ranks(shares, ranks[0]["steps"]),  # the recipe comparison's mean too
                  "per_rank": shares, "files": [f"jobs/profile/{name}" for d in ranks for name in d["files"]]}
    return out


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}"


def _time_share_lines(shares: dict) -> list[str]:
    if not shares:
        return []
    basis = {s.get("basis") for s in shares.values() if "basis" in s}
    what = ("device busy time per category (NPU kernels and HCCL tasks, by the host range that launched them)"
            if basis == {"device"} else
            "host self time of the ops under each range: **emulation numbers** (the CPU emulation's "
            "quantization and GEMMs, nothing about the A5 kernels)")
    lines = ["", "## Time shares", "",
             f"{PROFILE_STEPS} profiled steps per format after the timing job's warm-up, in a run apart from "
             f"Q3-11's (profiling off there), mean over the ranks: percent of step wall time (ms per step). "
             f"Measured: {what}. Rule: each span's self time counts once, in the innermost labelled range "
             "around it (`te_npu::quantize`, `te_npu::gemm`, FSDP2's `FSDP::all_gather*` / "
             "`FSDP::post_backward_reduce`; outside them aten GEMMs count as MM-GMM); *not in an op*: wall "
             "time no op covers (Python between ops; device idle), negative where tracks overlap. "
             "Traces and tables: `jobs/profile/<format>/rank<r>/`.", "",
             "| format | step ms | " + " | ".join(_CATEGORY_NAMES[c] for c in CATEGORIES) + " | not in an op |",
             "|---|---|" + "---|" * (len(CATEGORIES) + 1)]
    for f, s in shares.items():
        if "error" in s:
            lines.append(f"| {f} | not measured: {'; '.join(s['error'])[:200]} |" + " |" * (len(CATEGORIES) + 1))
            continue
        cells = [f"{s['percent'][c]:.1f}% ({s['ms_per_step'][c]:.1f})" for c in CATEGORIES]
        lines.append(f"| {f} | {s['wall_ms_per_step']:.1f} | " + " | ".join(cells) + f" | {s['unattributed_percent']:.1f}% |")
    return lines


def _switch_lines(settings: RunSettings, switches: dict) -> list[str]:
    if not switches:
        return []
    lines = ["", "## Reshard and recompute", "",
             f"Each switch flipped against the main phase, same steps 2..{SHORT_STEPS} (same data): mean step time "
             "(rank 0) and global peak memory (the main phase's peak also covers its later steps and the DCP save)."
             + ("" if settings.npu else " On CPU: **emulation numbers** (the emulation's step times on a shared "
                                        "machine, host RSS), nothing about the A5."),
             "", "| format | switch | step ms (main -> flipped) | change | peak GiB (main -> flipped) | change |",
             "|---|---|---|---|---|---|"]
    for key, d in switches.items():
        (base_ms, ms), (base_mem, mem) = d["step_ms"], d["peak_bytes"]
        change = "-" if d["step_time_change"] is None else f"{100 * d['step_time_change']:+.1f}%"
        mem_change = "-" if d["peak_change_bytes"] is None else f"{d['peak_change_bytes'] / 2**20:+.0f} MiB"
        lines.append(f"| {key.split('/')[0]} | {d['switch']} | {base_ms:.1f} -> {ms:.1f} | {change} | "
                     f"{_gib(base_mem)} -> {_gib(mem)} | {mem_change} |")
    return lines


def _memory_lines(memory: dict) -> list[str]:
    if not memory:
        return []
    what = next(iter(memory.values()))["what"]
    since = sorted({x for m in memory.values() for x in m["since"]})
    lines = ["", "## Peak memory per job and phase", "",
             f"`{what}` in GiB, each phase's own peak" + ("" if since == ["phase"] else
                                                           " (host peak since the process began where it could not be reset)")
             + "; global: the largest rank.", "", "| job/phase | per rank | global |", "|---|---|---|"]
    for key, m in memory.items():
        lines.append(f"| {key} | {', '.join(_gib(b) for b in m['per_rank'])} | {_gib(m['global_max'])} |")
    return lines
