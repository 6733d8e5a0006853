"""The spec's Q3 acceptance matrix (section 17.2, Q3-01..Q3-11) in one command, with its report.

    python scripts/q3_acceptance.py --out runs/q3                       # CPU: tiny recipes, 2 gloo ranks
    python scripts/q3_acceptance.py --out runs/q3 --cases Q3-02 Q3-05 --steps 20
    python scripts/q3_acceptance.py --out runs/q3 --nproc 8 \\
        --recipes bf16=recipes/dsv3_16b_bf16.yaml mxfp8=recipes/dsv3_16b_mxfp8.yaml hif8=recipes/dsv3_16b_hif8.yaml \\
        data.path=/data/pretrain/dsv3_corpus                              # 8x A5 (the default recipes there)

Every case runs the production ``Trainer`` with the ``STProbe`` (``te_npu.testing.PhaseProbe``)
in jobs of ``torchrun`` ranks (``--nproc``; default 8 on an NPU, 2 gloo ranks elsewhere), started
from here, one job per format and phase group, so a crashing or failing case never stops the
others; the resume of Q3-09 runs in fresh processes. The rules are ``te_npu.testing.q3_rules``,
the same functions the system tests assert. Under ``torchrun`` this script is one of the job's
ranks (``--job``). Extra arguments are config overrides applied to every recipe.

Writes into ``--out``: ``report.md`` and ``report.json`` (one row per case: pass / fail / not
judged, with the reasons and evidence files; then spec 17.4's time shares of quant / MM-GMM /
all-gather / reduce-scatter per format, the reshard / recompute differences and every phase's
per-rank and global peak memory), ``environment.json`` (commit, torch / torch_npu / CANN, each
YAML as run, seed, world size), ``curves_loss.png`` / ``curves_grad_norm.png``, and per job
``jobs/<job>/<phase>/rank<r>.json`` (step records, the rules' problems, the module list, the
MM/GMM trace, the FSDP gather trace, HiF8 scale statistics, refresh counts, the phase's peak
memory). With Q3-11 a ``profile`` job runs the timing job's configuration for PROFILE_STEPS
steps under the profiler (``te_npu.testing.step_profile``; Q3-11's own steps stay unprofiled),
its traces and tables in ``jobs/profile/<format>/rank<r>/``. A case
with a verdict in ``cases/<id>.json`` is skipped on a re-run with the same ``--out`` (delete the
file to run it again). Exit code: 0 when no case fails, 1 otherwise, 2 bad arguments or ``--out``
in use, 128 + N interrupted by signal N.

Owned jobs (``te_npu.testing.owned_jobs``): one run per ``--out`` (a lock naming its pid); each
job runs in a process group of its own that dies with this script, whatever signal ends it, and
a re-run first waits for an earlier run's job to be gone. A phase that fails on one rank ends its
job on every rank (``te_npu.training.job.run_job``: no rank left waiting in a collective); the
job is started again for its remaining phases. A phase counts as ended once
``jobs/<job>/<phase>/ended.json`` exists (its job ended, or its own rank failed it); a case is
judged only when every phase it reads ended, so an interrupted case is run again, never
recorded as a failure.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CASES = {
    "Q3-01": "BF16 baseline: >= 20 steps finite, save and resume 5 steps",
    "Q3-02": "MXFP8 end to end: every GEMM role in MXFP8, no high-precision GEMM",
    "Q3-03": "HiF8 end to end: every GEMM role in HiF8, FP32 current scales",
    "Q3-04": "model boundary: TE modules exactly the low-precision scope",
    "Q3-05": "MXFP8 FSDP2: gathers with reshard_after_forward true / false",
    "Q3-06": "HiF8 FSDP2: data + scale gathers, rank scales, expert order",
    "Q3-07": "gradient accumulation: one refresh per weight per optimizer step",
    "Q3-08": "full recompute: no extra refresh or weight quantization",
    "Q3-09": "DCP resume: N + 5 continuous vs saved at N, resumed in fresh processes",
    "Q3-10": "illegal configurations fail in their stage naming key / FQN / shape",
    "Q3-11": "performance: steady tokens/s and step time vs BF16",
}
FORMATS = ("bf16", "mxfp8", "hif8")
PASS, FAIL, NOT_JUDGED = "pass", "fail", "not judged"
SHORT_STEPS = 5  # Q3-05..08 and the resume: "各运行 5 steps"
PERF_WARMUP = {"cpu": 3, "npu": 10}
PERF_STEADY = 20
PROFILE_STEPS = 3  # the profiled job (time shares, spec 17.4): warm-up as PERF_WARMUP, then these

# The system tests' CPU settings (tests/system/harness.py): 2 layers (a dense and a MoE one, every
# TE module kind), 64-token sequences, BF16 parameters as on A5.
CPU_OVERRIDES = ("model.overrides={num_hidden_layers: 2, n_shared_experts: 2}", "training.seq_len=64",
                 "training.micro_batch_size=2", "training.warmup_steps=2", "training.param_dtype=bf16",
                 f"data.max_bytes={2**18}")
MISALIGNED = ("model.validate_16b=false",
              "model.overrides={num_hidden_layers: 2, n_shared_experts: 2, hidden_size: 96, v_head_dim: 48}")
MISALIGNED_FQN, MISALIGNED_SHAPE = "model.layers.0.self_attn.o_proj.weight", "[96, 96]"

# phases of a format's training job: overrides, optimizer steps (None: --steps)
PHASES = {
    "main": (("fsdp_config.reshard_after_forward=true",), None),
    "reshard_false": (("fsdp_config.reshard_after_forward=false",), SHORT_STEPS),
    "accum": (("training.gradient_accumulation_steps=2",), SHORT_STEPS),
    "recompute": (("activation_checkpoint.mode=full",), SHORT_STEPS),
    "misaligned": (MISALIGNED, 0),
}
# case -> the (job, phase, rules) it reads; rules: the q3_rules results of that phase that count
# (None: all of them); a phase's error always counts
_RUN = ("steps", "loss_trend")
_KERNELS = ("gemm_roles", "gemm_counts")
_LIFECYCLE = ("steps", "refreshes", "gemm_counts", "no_low_precision_work")
NEEDS = {
    "Q3-01": [("train-bf16", "main", None), ("resume-bf16", "resume", None)],
    "Q3-02": [("train-mxfp8", "main", _RUN + _KERNELS)],
    "Q3-03": [("train-hif8", "main", _RUN + _KERNELS + ("hif8_scales",))],
    "Q3-04": [("train-mxfp8", "main", ("scope", "high_precision_pieces")),
              ("train-hif8", "main", ("scope", "high_precision_pieces"))],
    "Q3-05": [("train-mxfp8", "main", ("steps", "gathers")), ("train-mxfp8", "reshard_false", ("steps", "gathers"))],
    "Q3-06": [("train-hif8", "main", ("steps", "gathers")), ("train-hif8", "reshard_false", ("steps", "gathers"))],
    "Q3-07": [(f"train-{f}", "accum", _LIFECYCLE) for f in FORMATS],
    "Q3-08": [(f"train-{f}", "recompute", _LIFECYCLE + ("gathers",)) for f in FORMATS],
    "Q3-09": [(f"train-{f}", "main", ("checkpoint_contents",)) for f in FORMATS]
    + [(f"resume-{f}", "resume", None) for f in FORMATS],
    "Q3-10": [("train-mxfp8", "misaligned", None)],
    "Q3-11": [("perf", f, None) for f in FORMATS],
}
# case -> the (job, phase) s its report needs besides the judged ones (a failure there is reported,
# never judged): Q3-11's time shares come from a profiled run apart from its profiling-off timing
REPORTED = {"Q3-11": [("profile", f) for f in FORMATS]}


# ---------------------------------------------------------------- where we are
def on_npu() -> bool:
    try:
        import torch
        import torch_npu  # noqa: F401

        return torch.npu.device_count() > 0
    except Exception:  # noqa: BLE001 - no torch_npu / no device
        return False


def default_recipes(npu: bool) -> dict[str, str]:
    size = "16b" if npu else "tiny"
    return {f: str(REPO / "recipes" / f"dsv3_{size}_{f}.yaml") for f in FORMATS}


def _run_overrides(args, fmt: str, workdir: Path, extra=()) -> list[str]:
    """Overrides that make a recipe one Q3 run: its own folders, no eval / periodic saves / resume."""
    base = list(CPU_OVERRIDES) if not args.npu else []
    return [*base, "training.eval_interval=0", f"logging.dir={workdir / 'logs'}", "logging.plot=false",
            f"checkpoint.dir={workdir / 'ckpt'}", "checkpoint.interval=0", "checkpoint.resume=false",
            *([f"data.cache_dir={Path(args.out) / 'data_cache'}"] if not args.npu else []), *args.overrides, *extra]


def _config(args, fmt: str, workdir: Path, extra=()):
    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.training.config import load_config

    return load_config(args.recipes[fmt], _run_overrides(args, fmt, workdir, extra),
                       model_section=DeepseekV3Task.model_section)


# ---------------------------------------------------------------- evidence of one rank's phase
def _evidence(result: dict) -> dict:
    """What a phase did, as JSON: records, modules, MM/GMM trace, gathers, HiF8 scales, refreshes."""
    probe = result.get("probe")
    out = {"records": result.get("records", []), "lines": result.get("lines", [])[-40:]}
    if probe is None:
        return out
    out["low_precision_modules"] = probe.low_precision_modules
    out["module_types"] = probe.module_types
    out["gemm_trace"] = [{"step": s, "kind": e.kind, "gemm": e.gemm, "format": e.format, "backend": e.backend,
                          "left": list(e.left_shape), "right": list(e.right_shape), "out": str(e.output_dtype)}
                         for s, e in probe.gemm_events if s <= 0]
    out["gemm_counts"] = Counter(f"{e.kind}/{e.gemm}/{e.format}/{e.backend}" for _, e in probe.gemm_events)
    out["gather_trace"] = [{"step": s, "fqn": g.context.param_fqn, "phase": g.context.phase, "fields": list(g.fields),
                            "format": g.format, "local_bytes": g.local_bytes, "gathered_bytes": g.gathered_bytes,
                            "reshard_after_forward": g.context.reshard_after_forward}
                           for s, g in probe.gather_records if s <= 0]
    scales = [(e.format_max, float(e.scale.min()), float(e.scale.max()))
              for _, e in probe.quant_events if e.format == "hif8" and e.scale is not None and e.scale.numel()]
    out["hif8_scales"] = {str(m): {"count": sum(1 for x in scales if x[0] == m),
                                   "min": min(x[1] for x in scales if x[0] == m),
                                   "max": max(x[2] for x in scales if x[0] == m)} for m in {x[0] for x in scales}}
    out["refresh_counts"] = {str(s): sum(c.values()) for s, c in sorted(probe.refreshes.items())}
    out["micro_steps"] = {str(s): n for s, n in sorted(probe.micro_steps.items())}
    out["weights"] = {f: {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in info.items()}
                      for f, info in result.get("weights", {}).items()}
    return out


def _reset_peak_memory(npu: bool) -> bool:
    """Start a phase's peak memory afresh: the device's peak statistics on an NPU, the host's peak
    RSS (Linux ``/proc/self/clear_refs`` 5: VmHWM back to the current RSS). False if the host's
    cannot be reset (its peak is then the process's so far)."""
    if npu:
        import torch

        torch.npu.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_memory(npu: bool, host_reset: bool) -> dict:
    """This phase's peak memory: ``host_peak_rss_bytes`` (VmHWM, since the phase began when
    ``host_reset``, else since the process began) and on an NPU the device's peak allocated /
    reserved bytes (since the phase began)."""
    import resource

    import torch

    peak = {"host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "host_peak_since": "phase" if host_reset else "process"}
    try:
        with open("/proc/self/status") as f:
            hwm = next((line.split()[1] for line in f if line.startswith("VmHWM:")), None)
        if hwm is not None:
            peak["host_peak_rss_bytes"] = int(hwm) * 1024
    except OSError:
        pass
    if npu:
        peak["device_max_allocated_bytes"] = int(torch.npu.max_memory_allocated())
        peak["device_max_reserved_bytes"] = int(torch.npu.max_memory_reserved())
    return peak


def _rules(fmt: str, phase: str, result: dict, cfg, world: int, backend: str, steps: int) -> dict[str, list[str]]:
    """The q3_rules this phase answers (each: its problems)."""
    import torch

    from models.deepseek_v3.config import expected_low_precision_scope
    from models.deepseek_v3.pretrain import model_config
    from te_npu.testing import q3_rules as R

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[cfg.training.param_dtype]
    micro = cfg.training.gradient_accumulation_steps
    recompute = cfg.activation_checkpoint.mode == "full"
    reshard = cfg.fsdp_config.reshard_after_forward
    rules = {"steps": R.check_steps(result, steps)}
    if phase == "main":
        rules["loss_trend"] = R.check_loss_falls(result["records"], min_drop=None)
    if fmt == "bf16":
        rules["no_low_precision_work"] = R.check_no_low_precision_work(result)
        return rules
    rules["gemm_roles"] = R.check_gemm_roles(result, fmt, backend, dtype)
    rules["gemm_counts"] = R.check_gemm_counts(result, micro, recompute)
    rules["refreshes"] = R.check_refreshes(result, fmt, micro, recompute)
    if world > 1:
        rules["gathers"] = R.check_gathers(result, fmt, micro, reshard, world)
    if phase == "main":
        rules["scope"] = R.check_scope(result, expected_low_precision_scope(model_config(cfg)))
        rules["high_precision_pieces"] = R.check_high_precision_pieces(result, model_config(cfg).num_hidden_layers,
                                                                  model_config(cfg).num_nextn_predict_layers)
        if fmt == "hif8":
            rules["hif8_scales"] = R.check_hif8_activation_scales(result)
    return rules


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _phase(args, job: str, phase: str, rank: int, world: int, fn) -> None:
    """Run one phase on this rank, writing ``jobs/<job>/<phase>/rank<r>.json`` (an error is recorded,
    never raised: the next phase still runs)."""
    out = Path(args.out) / "jobs" / job / phase / f"rank{rank}.json"
    host_reset = _reset_peak_memory(args.npu)
    start = time.time()
    try:
        data = fn()
    except Exception as exc:  # noqa: BLE001 - recorded as the phase's failure
        from te_npu.training.job import lost_a_peer

        data = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        data.update(seconds=round(time.time() - start, 1), world=world, memory=_peak_memory(args.npu, host_reset))
        _write(out, data)
        if not lost_a_peer(exc):  # this rank's own failure: the phase ended (a peer's death is not one)
            _write(out.with_name("ended.json"), {"failed_on_rank": rank, "error": data["error"]})
        if world > 1:
            raise  # the job ends on every rank (run_job), none waits in a collective; the orchestrator goes on
        return
    data.update(seconds=round(time.time() - start, 1), world=world, memory=_peak_memory(args.npu, host_reset))
    _write(out, data)


@contextlib.contextmanager
def job_process_group(args):
    """The ranks' process group, for every phase this process runs (each phase's Trainer joins it:
    a group torchrun's store has seen destroyed cannot be made again in the same processes)."""
    import datetime

    import torch
    import torch.distributed as dist

    owned = False
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():
        if args.npu:
            torch.npu.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("hccl" if args.npu else "gloo", timeout=datetime.timedelta(minutes=30))
        owned = True
    yield  # an exception leaves without a barrier: run_job aborts the group, the peers are stopped
    if owned:
        dist.barrier()
        dist.destroy_process_group()


def run_job(args, job: str, phases: list[str]) -> None:
    """One rank's part of a job: ``train-<fmt>`` (phases of PHASES), ``resume-<fmt>``, ``perf``
    (phases: the formats), inside :func:`job_process_group`."""
    with job_process_group(args):
        _run_job(args, job, phases)


def _run_job(args, job: str, phases: list[str]) -> None:
    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.testing import q3_rules as R
    from te_npu.testing.q3_runs import make_trainer, resume_phase, run_phase

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    backend = "npu" if args.npu else "emulation"
    jobdir = Path(args.out) / "jobs" / job
    kind, _, fmt = job.partition("-")
    if kind == "train":
        for phase in phases:
            extra, steps = PHASES[phase]
            steps = args.steps if steps is None else steps

            def train(phase=phase, extra=extra, steps=steps):
                cfg = _config(args, fmt, jobdir / phase, extra)
                if phase == "misaligned":
                    lines: list[str] = []
                    trainer, _ = make_trainer(DeepseekV3Task(), lines)
                    error = None
                    try:
                        trainer.setup(cfg)
                    except Exception as exc:  # noqa: BLE001 - the refusal under test
                        error = str(exc)
                        trainer.abandon()
                    else:
                        trainer.close()
                    problems = R.check_misaligned_shard(error, MISALIGNED_FQN, MISALIGNED_SHAPE, hasattr(trainer, "model"))
                    return {"rules": {"misaligned_shard": problems}, "error_message": error}
                save_at = steps - SHORT_STEPS if phase == "main" and steps > SHORT_STEPS else None
                dcp_dir = str(jobdir / "dcp")
                result = run_phase(DeepseekV3Task(), cfg, steps, save_at=save_at, save_dir=dcp_dir)
                data = {"rules": _rules(fmt, phase, result, cfg, world, backend, steps), **_evidence(result),
                        "save_at": save_at, "config": cfg.to_dict()}
                if save_at is not None:
                    import torch

                    data["rules"]["checkpoint_contents"] = R.check_checkpoint_contents(
                        os.path.join(dcp_dir, f"step_{save_at}"), result, world)
                    torch.save(result["masters"], jobdir / f"masters_rank{rank}.pt")
                    _write(jobdir / f"continuous_rank{rank}.json",
                           {"records": result["records"], "weights": _evidence(result)["weights"]})
                return data

            _phase(args, job, phase, rank, world, train)
    elif kind == "resume":
        def resume():
            import torch

            source = Path(args.out) / "jobs" / f"train-{fmt}"
            continuous = json.loads((source / f"continuous_rank{rank}.json").read_text())
            continuous["masters"] = torch.load(source / f"masters_rank{rank}.pt", weights_only=True)
            cfg = _config(args, fmt, jobdir / "resume")
            save_at = len(continuous["records"]) - SHORT_STEPS
            result = resume_phase(DeepseekV3Task(), cfg, str(source / "dcp"), SHORT_STEPS)
            problems, measured = R.check_resume(continuous, result, save_at)
            return {"rules": {"resume": problems}, "measured": measured, **_evidence(result)}

        _phase(args, job, "resume", rank, world, resume)
    elif kind == "perf":
        for fmt_ in phases:
            _phase(args, job, fmt_, rank, world, lambda f=fmt_: _perf(args, f, jobdir / f))
    elif kind == "profile":
        for fmt_ in phases:
            _phase(args, job, fmt_, rank, world, lambda f=fmt_: _profiled(args, f, jobdir / f, rank))


def _perf(args, fmt: str, workdir: Path) -> dict:
    """Warm-up + steady optimizer steps with no probe subscribed (profiling off), the raw per-step data."""
    import dataclasses

    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.training.trainer import Trainer

    warmup = PERF_WARMUP["npu" if args.npu else "cpu"]
    cfg = _config(args, fmt, workdir)
    lines: list[str] = []
    trainer = Trainer(DeepseekV3Task(), print_fn=lines.append)
    try:
        trainer.setup(cfg)
        records = [dataclasses.asdict(trainer.train_step()) for _ in range(warmup + PERF_STEADY)]
    except BaseException:
        trainer.abandon()
        raise
    trainer.close()
    return {"records": records, "warmup": warmup, "config": cfg.to_dict(), "lines": lines[-10:]}


def _profiled(args, fmt: str, workdir: Path, rank: int) -> dict:
    """The timing job's configuration, warm-up, then PROFILE_STEPS steps under the profiler
    (``te_npu.testing.step_profile``): the time shares of quant / MM-GMM / all-gather /
    reduce-scatter, the trace and table in ``<workdir>/rank<r>/``."""
    import dataclasses

    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.testing.step_profile import profile_steps
    from te_npu.training.trainer import Trainer

    warmup = PERF_WARMUP["npu" if args.npu else "cpu"]
    cfg = _config(args, fmt, workdir)
    lines: list[str] = []
    records: list[dict] = []
    trainer = Trainer(DeepseekV3Task(), print_fn=lines.append)
    try:
        trainer.setup(cfg)
        for _ in range(warmup):
            trainer.train_step()
        profile = profile_steps(lambda: records.append(dataclasses.asdict(trainer.train_step())), PROFILE_STEPS,
                                workdir / f"rank{rank}", npu=args.npu)
    except BaseException:
        trainer.abandon()
        raise
    trainer.close()
    profile["files"] = [f"{fmt}/rank{rank}/{name}" for name in profile["files"]]
    return {"records": records, "warmup": warmup, **profile, "lines": lines[-10:]}


# ---------------------------------------------------------------- orchestration
def _launch(args, folder, job: str, phases: list[str]) -> int | None:
    """Start one job's ranks with torchrun (te_npu's launcher), owned by ``folder``, and wait for
    it; its exit code, None when a signal ended the launcher (interrupted)."""
    cmd = [sys.executable, "-m", "te_npu.training.launch", "--standalone", "--nproc_per_node", str(args.nproc),
           str(Path(__file__).resolve()), "--job", job, "--phases", *phases, "--out", str(args.out),
           "--steps", str(args.steps), "--recipes", *(f"{f}={p}" for f, p in args.recipes.items()),
           "--device-kind", "npu" if args.npu else "cpu", *args.overrides]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if not args.npu:
        env.setdefault("OMP_NUM_THREADS", "1")
    jobdir = Path(args.out) / "jobs" / job
    for phase in phases:  # what an interrupted attempt left of these phases is not evidence
        for stale in (jobdir / phase).glob("*.json"):
            if stale.name == "ended.json" or (stale.name.startswith("rank") and stale.stem[4:].isdigit()):
                stale.unlink()
    if "main" in phases and (jobdir / "dcp").exists():  # an earlier attempt's steps: kept, set aside
        aside = jobdir / f"dcp.before-{time.strftime('%Y%m%d-%H%M%S')}"
        (jobdir / "dcp").rename(aside)
        print(f"q3_acceptance: {job}: moved the steps of an earlier attempt to {aside}", flush=True)
    return folder.run(cmd, Path(args.out) / "jobs" / job / f"launch_{'_'.join(phases)}.log", env=env, cwd=REPO)


def _rank_files(args, job: str, phase: str) -> list[Path]:
    return sorted((Path(args.out) / "jobs" / job / phase).glob("rank*.json"), key=lambda p: int(p.stem[4:]))


def _read(args, job: str, phase: str) -> list[dict] | None:
    files = _rank_files(args, job, phase)
    return [json.loads(p.read_text()) for p in files] if len(files) == args.nproc else None


def _ended(args, job: str, phase: str) -> bool:
    return (Path(args.out) / "jobs" / job / phase / "ended.json").exists()


def _mark_ended(args, job: str, phase: str, **why) -> None:
    _write(Path(args.out) / "jobs" / job / phase / "ended.json", why)


def _illegal_configs(args) -> list[str]:
    from te_npu.testing import q3_rules as R

    problems = []
    for override, key in R.ILLEGAL_CONFIGS:
        problems += R.check_illegal_config(lambda o: _config(args, "mxfp8", Path(args.out) / "illegal", (o,)), override, key)
    return problems


def judge(args, case: str) -> dict:
    """A case's verdict from its jobs' per-rank results."""
    from te_npu.testing import q3_rules as R

    reasons, evidence, measured = [], [], {}
    results = {}
    for job, phase, counted in NEEDS[case]:
        ranks = _read(args, job, phase)
        evidence.append(f"jobs/{job}/{phase}/")
        if ranks is None:
            partial = {int(p.stem[4:]): json.loads(p.read_text()) for p in _rank_files(args, job, phase)}
            reasons += [f"{job}/{phase} rank {r}: {d['error']}" for r, d in partial.items() if "error" in d]
            reasons.append(f"{job}/{phase}: no result from every rank (see jobs/{job}/launch_*.log)")
            continue
        results[(job, phase)] = ranks
        for r, data in enumerate(ranks):
            if "error" in data:
                reasons.append(f"{job}/{phase} rank {r}: {data['error']}")
            for rule, problems in data.get("rules", {}).items():
                if counted is None or rule in counted:
                    reasons += [f"{job}/{phase} rank {r} {rule}: {p}" for p in problems[:3]]
    if case == "Q3-06":
        for phase in ("main", "reshard_false"):
            ranks = results.get(("train-hif8", phase))
            if ranks and all("weights" in d for d in ranks):
                reasons += [f"train-hif8/{phase} ranks: {p}" for p in R.check_hif8_weight_scales(
                    [d["weights"] for d in ranks], args.nproc)]
    if case == "Q3-10":
        reasons += _illegal_configs(args)
    if case == "Q3-09":
        measured = {job: ranks[0].get("measured") for (job, _), ranks in results.items() if job.startswith("resume")}
    if case == "Q3-11" and len(results) == 3 and all("records" in r[0] for r in results.values()):
        measured = R.steady_ratios({f: results[("perf", f)][0]["records"] for f in FORMATS},
                                   results[("perf", "bf16")][0]["warmup"])
    verdict, why = (FAIL, reasons) if reasons else (PASS, [])
    if not reasons and case == "Q3-09" and not all(m and m["bitwise"] for m in measured.values()):
        verdict, why = NOT_JUDGED, ["resume differs from the continuous run (measured in `measured`); the spec's "
                                    "tolerance is not frozen yet (section 17.2)"]
    if case == "Q3-11":
        evidence += [f"jobs/{job}/{phase}/" for job, phase in REPORTED[case]]
    if not reasons and case == "Q3-11":
        if not args.npu:
            verdict, why = NOT_JUDGED, ["emulation: CPU step times say nothing about the A5 kernels (ratios reported)"]
        else:
            bad = [f"{f}: throughput_ratio {m['throughput_ratio']:.3f}, step_time_ratio {m['step_time_ratio']:.3f}"
                   for f, m in measured.items() if f != "bf16" and not (m["throughput_ratio"] >= 1.0
                                                                         and m["step_time_ratio"] <= 1.0)]
            verdict, why = (FAIL, bad) if bad else (PASS, [])
    return {"id": case, "title": CASES[case], "verdict": verdict, "reasons": why, "evidence": evidence,
            "measured": measured}


def _environment(args) -> dict:
    import torch

    from te_npu.selfcheck.environment import gate_report

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    configs = {}
    for f, path in args.recipes.items():
        try:
            configs[f] = _config(args, f, Path(args.out) / "env").to_dict()
        except Exception as exc:  # noqa: BLE001 - reported, the cases will fail on it
            configs[f] = f"{type(exc).__name__}: {exc}"
    gate = gate_report()
    return {"commit": commit, "torch": torch.__version__, "torch_npu": gate["reading"]["torch_npu"],
            "cann": gate["reading"]["cann_version"], "device": gate["reading"]["device_name"],
            "backend": "npu" if args.npu else "emulation", "world_size": args.nproc, "recipes": args.recipes,
            "overrides": args.overrides, "configs_as_run": configs,
            "seed": {f: c["training"]["seed"] for f, c in configs.items() if isinstance(c, dict)}}


def _plot(args) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, name in (("lm_loss", "loss"), ("grad_norm", "grad_norm")):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for f in FORMATS:
            ranks = _read(args, f"train-{f}", "main")
            if ranks and ranks[0].get("records"):
                recs = ranks[0]["records"]
                ax.plot([r["step"] for r in recs], [r[key] for r in recs], label=f)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(key)
        ax.legend()
        fig.tight_layout()
        path = Path(args.out) / f"curves_{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path.name)
    return written


def _memory_key(args) -> str:
    return "device_max_allocated_bytes" if args.npu else "host_peak_rss_bytes"


def _memory(args) -> dict:
    """Per job and phase: per-rank and global peak memory (device bytes allocated on an NPU, host
    peak RSS here), each phase's own peak (reset when it began)."""
    out = {}
    for job_dir in sorted((Path(args.out) / "jobs").glob("*")):
        for phase_dir in sorted(p for p in job_dir.glob("*") if p.is_dir()):
            ranks = _read(args, job_dir.name, phase_dir.name)
            if not ranks:
                continue
            per_rank = [d.get("memory", {}).get(_memory_key(args)) for d in ranks]
            known = [v for v in per_rank if v is not None]
            out[f"{job_dir.name}/{phase_dir.name}"] = {
                "what": _memory_key(args), "per_rank": per_rank, "global_max": max(known) if known else None,
                "since": sorted({d.get("memory", {}).get("host_peak_since", "phase") for d in ranks})}
    return out


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _switches(args, memory: dict) -> dict:
    """Spec 17.4's reshard / recompute differences, from the jobs' own data: per format, the
    phase with the switch flipped (``reshard_after_forward: false``; full recompute) against the
    main phase (``true``; none) over the same steps 2..5 (same data): mean step time (rank 0)
    and global peak memory (the main phase's also covers its later steps and the DCP save)."""
    out = {}
    for f in FORMATS:
        main = _read(args, f"train-{f}", "main")
        if not main or not main[0].get("records"):
            continue
        for phase, switch in (("reshard_false", "reshard_after_forward true -> false"),
                              ("recompute", "activation_checkpoint none -> full")):
            other = _read(args, f"train-{f}", phase)
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


def _time_shares(args) -> dict:
    """Per format: the profiled job's time shares, per rank and their mean over the ranks."""
    from te_npu.testing.time_shares import CATEGORIES

    out = {}
    for f in FORMATS:
        ranks = _read(args, "profile", f)
        if not ranks:
            continue
        errors = [f"rank {r}: {d['error']}" for r, d in enumerate(ranks) if "error" in d]
        if errors:
            out[f] = {"error": errors}
            continue
        shares = [d["shares"] for d in ranks]
        out[f] = {"basis": shares[0]["basis"], "steps": ranks[0]["steps"],
                  "wall_ms_per_step": _mean(s["wall_ms"] for s in shares) / ranks[0]["steps"],
                  "percent": {c: _mean(s["percent"][c] for s in shares) for c in CATEGORIES},
                  "ms_per_step": {c: _mean(s["ms"][c] for s in shares) / ranks[0]["steps"] for c in CATEGORIES},
                  "unattributed_percent": _mean(s["unattributed_percent"] for s in shares),
                  "per_rank": shares, "files": [f"jobs/profile/{name}" for d in ranks for name in d["files"]]}
    return out


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}"


def _report_sections(args, memory: dict, switches: dict, shares: dict) -> list[str]:
    """report.md's sections of spec 17.4: time shares, reshard / recompute, peak memory."""
    from te_npu.testing.time_shares import CATEGORIES

    names = {"quant": "quant", "mm_gmm": "MM-GMM", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
             "other": "other"}
    lines = []
    if shares:
        basis = {s.get("basis") for s in shares.values() if "basis" in s}
        what = ("device busy time per category (NPU kernels and HCCL tasks, by the host range that launched them)"
                if basis == {"device"} else
                "host self time of the ops under each range: **emulation numbers** (the CPU emulation's "
                "quantization and GEMMs, nothing about the A5 kernels)")
        lines += ["", "## Time shares (section 17.4)", "",
                  f"{PROFILE_STEPS} profiled steps per format after the timing job's warm-up, in a run apart from "
                  f"Q3-11's (profiling off there), mean over the ranks: percent of step wall time (ms per step). "
                  f"Measured: {what}. Rule: each span's self time counts once, in the innermost labelled range "
                  "around it (`te_npu::quantize`, `te_npu::gemm`, FSDP2's `FSDP::all_gather*` / "
                  "`FSDP::post_backward_reduce`; outside them aten GEMMs count as MM-GMM); *not in an op*: wall "
                  "time no op covers (Python between ops; device idle), negative where tracks overlap. "
                  "Traces and tables: `jobs/profile/<format>/rank<r>/`.", "",
                  "| format | step ms | " + " | ".join(names[c] for c in CATEGORIES) + " | not in an op |",
                  "|---|---|" + "---|" * (len(CATEGORIES) + 1)]
        for f, s in shares.items():
            if "error" in s:
                lines.append(f"| {f} | not measured: {'; '.join(s['error'])[:200]} |" + " |" * (len(CATEGORIES) + 1))
                continue
            cells = [f"{s['percent'][c]:.1f}% ({s['ms_per_step'][c]:.1f})" for c in CATEGORIES]
            lines.append(f"| {f} | {s['wall_ms_per_step']:.1f} | " + " | ".join(cells)
                         + f" | {s['unattributed_percent']:.1f}% |")
    if switches:
        lines += ["", "## Reshard and recompute (section 17.4)", "",
                  f"Each switch flipped against the main phase, same steps 2..{SHORT_STEPS} (same data): mean step time "
                  "(rank 0) and global peak memory (the main phase's peak also covers its later steps and the DCP save)."
                  + ("" if args.npu else " On CPU: **emulation numbers** (the emulation's step times on a shared "
                                         "machine, host RSS), nothing about the A5."),
                  "", "| format | switch | step ms (main -> flipped) | change | peak GiB (main -> flipped) | change |",
                  "|---|---|---|---|---|---|"]
        for key, d in switches.items():
            (base_ms, ms), (base_mem, mem) = d["step_ms"], d["peak_bytes"]
            change = "-" if d["step_time_change"] is None else f"{100 * d['step_time_change']:+.1f}%"
            mem_change = "-" if d["peak_change_bytes"] is None else f"{d['peak_change_bytes'] / 2**20:+.0f} MiB"
            lines.append(f"| {key.split('/')[0]} | {d['switch']} | {base_ms:.1f} -> {ms:.1f} | {change} | "
                         f"{_gib(base_mem)} -> {_gib(mem)} | {mem_change} |")
    if memory:
        what = next(iter(memory.values()))["what"]
        since = sorted({x for m in memory.values() for x in m["since"]})
        lines += ["", "## Peak memory per job and phase", "",
                  f"`{what}` in GiB, each phase's own peak" + ("" if since == ["phase"] else
                                                                " (host peak since the process began where it could not be reset)")
                  + "; global: the largest rank.", "", "| job/phase | per rank | global |", "|---|---|---|"]
        for key, m in memory.items():
            lines.append(f"| {key} | {', '.join(_gib(b) for b in m['per_rank'])} | {_gib(m['global_max'])} |")
    return lines


def write_report(args, verdicts: list[dict]) -> int:
    env = _environment(args)
    _write(Path(args.out) / "environment.json", env)
    curves = _plot(args)
    memory = _memory(args)
    switches = _switches(args, memory)
    shares = _time_shares(args)
    report = {"tool": "scripts/q3_acceptance.py", "environment": "environment.json", "curves": curves,
              "memory": memory, "reshard_recompute": switches, "time_shares": shares, "cases": verdicts,
              "summary": dict(Counter(v["verdict"] for v in verdicts))}
    _write(Path(args.out) / "report.json", report)
    lines = [f"# Q3 acceptance ({env['backend']}, {args.nproc} ranks, commit {str(env['commit'])[:12]})", "",
             f"torch {env['torch']}, torch_npu {env['torch_npu']}, CANN {env['cann']}, device {env['device']}; "
             f"recipes: " + ", ".join(f"{f} `{os.path.relpath(p, REPO)}`" for f, p in args.recipes.items()), "",
             "| case | what | verdict | reasons | evidence |", "|---|---|---|---|---|"]
    for v in verdicts:
        reasons = "<br>".join(v["reasons"][:4]) + (f"<br>... {len(v['reasons']) - 4} more" if len(v["reasons"]) > 4 else "")
        lines.append(f"| {v['id']} | {v['title']} | **{v['verdict']}** | {reasons} | {', '.join(v['evidence'][:3])} |")
    for v in verdicts:
        if v["measured"]:
            lines += ["", f"{v['id']} measured: `{json.dumps(v['measured'], default=str)}`"]
    lines += _report_sections(args, memory, switches, shares)
    lines += ["", f"Curves: {', '.join(curves)}. Environment (each YAML as run, seed, versions): environment.json."]
    (Path(args.out) / "report.md").write_text("\n".join(lines) + "\n")
    return 0 if all(v["verdict"] != FAIL for v in verdicts) else 1


def _todo(args) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """(cases to judge, cases finished before, job -> phases still to run), jobs in run order."""
    out = Path(args.out)
    todo = [c for c in args.cases if not (out / "cases" / f"{c}.json").exists()]
    needed: dict[str, list[str]] = {}
    for case in todo:
        for job, phase in [(j, p) for j, p, _ in NEEDS[case]] + REPORTED.get(case, []):
            if not _ended(args, job, phase) and phase not in needed.setdefault(job, []):
                needed[job].append(phase)
    order = sorted(needed, key=lambda j: (j.startswith("resume"), j.startswith(("perf", "profile")), j))  # resume after train
    return todo, [c for c in args.cases if c not in todo], {j: needed[j] for j in order if needed[j]}


def _judge_all(args, todo: list[str]) -> int:
    out = Path(args.out)
    for case in todo:
        if not all(_ended(args, j, p) for j, p, _ in NEEDS[case]):
            print(f"q3_acceptance: {case} not judged: its jobs were interrupted (a re-run runs them)", flush=True)
            continue
        verdict = judge(args, case)
        _write(out / "cases" / f"{case}.json", verdict)
        first = f": {verdict['reasons'][0]}" if verdict["reasons"] else ""
        print(f"q3_acceptance: {case} {verdict['verdict']}{first}", flush=True)
    verdicts = [json.loads((out / "cases" / f"{c}.json").read_text()) for c in args.cases
                if (out / "cases" / f"{c}.json").exists()]
    code = write_report(args, verdicts)
    print(f"q3_acceptance: report {out / 'report.md'} and {out / 'report.json'}", flush=True)
    return code


def in_torchrun(args) -> int:
    """Started as a rank by ``torchrun`` itself: every rank runs the jobs' phases in this process
    (Q3-09's resume in the same processes, with a fresh Trainer), then rank 0 judges and reports."""
    todo, skipped, needed = _todo(args)
    with job_process_group(args):
        for job, phases in needed.items():
            run_job(args, job, phases)
    if int(os.environ.get("RANK", 0)) != 0:
        return 0
    deadline = time.time() + 600  # the other ranks' last files
    while time.time() < deadline and any(_read(args, j, p) is None for j, ps in needed.items() for p in ps):
        time.sleep(2)
    for job, phases in needed.items():
        for phase in phases:
            if _read(args, job, phase) is not None:
                _mark_ended(args, job, phase, exit=0)
    return _judge_all(args, todo)


def orchestrate(args) -> int:
    from te_npu.testing.owned_jobs import JobFolder, terminate_on_sigterm

    terminate_on_sigterm()  # SIGTERM ends the running job first (the owner pipe covers SIGKILL)
    with JobFolder(args.out) as folder:
        todo, skipped, needed = _todo(args)
        if skipped:
            print(f"q3_acceptance: {', '.join(skipped)} finished in {args.out} before; skipped", flush=True)
        for job, phases in needed.items():
            _run_until_ended(args, folder, job, phases)
        return _judge_all(args, todo)


def _run_until_ended(args, folder, job: str, phases: list[str]) -> None:
    """Launch ``job`` for ``phases``; a phase that failed ended the job, so launch it again for the
    phases after it. Phases of a launch that a signal ended stay un-ended (re-run later)."""
    while phases:
        start = time.time()
        code = _launch(args, folder, job, phases)
        print(f"q3_acceptance: job {job} ({', '.join(phases)}) "
              f"{'interrupted by a signal' if code is None else f'exit {code}'} in {time.time() - start:.0f} s",
              flush=True)
        if code is None:
            return
        for phase in phases:
            if not _ended(args, job, phase) and _read(args, job, phase) is not None:
                _mark_ended(args, job, phase, exit=code)
        left = [p for p in phases if not _ended(args, job, p)]
        if left == phases:  # the job ended before any phase did: the first one is its failure
            _mark_ended(args, job, left[0], exit=code, note="the job ended before every rank wrote this phase")
            left = left[1:]
        phases = left


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=[], metavar="FMT=PATH",
                   help="bf16= mxfp8= hif8= YAML recipes (default: the 16B recipes on an NPU, the tiny ones elsewhere)")
    p.add_argument("--out", default="runs/q3_acceptance", help="report folder (a re-run skips its finished cases)")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), metavar="Q3-NN")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps of the main runs (>= 20 for the spec)")
    p.add_argument("--nproc", type=int, default=None, help="ranks per job (default: 8 on an NPU, 2 elsewhere)")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)  # a torchrun rank of one job
    p.add_argument("--phases", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--device-kind", choices=("npu", "cpu"), default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="config overrides for every recipe, e.g. data.path=/data/corpus")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.npu = args.device_kind == "npu" if args.device_kind else on_npu()
    recipes = default_recipes(args.npu)
    for item in args.recipes:
        fmt, sep, path = item.partition("=")
        if not sep or fmt not in FORMATS:
            print(f"q3_acceptance: --recipes takes bf16=PATH mxfp8=PATH hif8=PATH, got {item!r}", file=sys.stderr)
            return 2
        recipes[fmt] = str(Path(path).resolve())
    args.recipes = recipes
    args.out = str(Path(args.out).resolve())
    args.nproc = args.nproc or (int(os.environ["WORLD_SIZE"]) if args.job else (8 if args.npu else 2))
    if args.job:  # one rank of a job: fails together with its peers, dies with its launcher
        from te_npu.training.job import run_job as run_rank

        return run_rank(lambda stop: run_job(args, args.job, args.phases))
    if "WORLD_SIZE" in os.environ:
        return in_torchrun(args)
    from te_npu.errors import ConfigError

    try:
        return orchestrate(args)
    except ConfigError as exc:
        print(f"q3_acceptance: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
