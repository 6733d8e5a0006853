"""The acceptance matrix (Q3-01..Q3-11, docs/a5.md, acceptance matrix) in one command, with its report.

    python scripts/q3_acceptance.py --out runs/q3                       # CPU: tiny recipes, 2 gloo ranks
    python scripts/q3_acceptance.py --out runs/q3 --cases Q3-02 Q3-05 --steps 20
    python scripts/q3_acceptance.py --out runs/q3 --nproc 8 \\
        --recipes bf16=recipes/dsv3_16b_bf16.yaml mxfp8=recipes/dsv3_16b_mxfp8.yaml hif8=recipes/dsv3_16b_hif8.yaml \\
        data.path=/data/pretrain/dsv3_corpus                              # 8x A5 (the default recipes there)

Every case runs the production ``Trainer`` with the ``PhaseProbe`` (``te_npu.testing.phase_probe``)
in jobs of ``torchrun`` ranks (``--nproc``; default 8 on an NPU, 2 gloo ranks elsewhere), started
from here, one job per format and phase group, so a crashing or failing case never stops the
others; the resume of Q3-09 runs in fresh processes. This script parses the command line and
launches the jobs; the phases, rules, verdicts and report are ``te_npu.testing.acceptance`` (its
``rules`` are the same functions the system tests assert). Under ``torchrun`` this script is one
of the job's ranks (``--job``). Extra arguments are config overrides applied to every recipe.

Writes into ``--out``: ``report.md`` and ``report.json`` (one row per case: pass / fail / not
judged, with the reasons and evidence files; then the time shares of quant / MM-GMM /
all-gather / reduce-scatter per format, the reshard / recompute differences and every phase's
per-rank and global peak memory), ``environment.json`` (commit, torch / torch_npu / CANN, each
YAML as run, seed, world size), ``curves_loss.png`` / ``curves_grad_norm.png``, and per job
``jobs/<job>/<phase>/rank<r>.json`` (step records, the rules' problems, the module list, the
MM/GMM trace, the FSDP gather trace, HiF8 scale statistics, refresh counts, the phase's peak
memory). With Q3-11 a ``profile`` job runs the timing job's configuration for 3
steps (``PROFILE_STEPS``) under the profiler (``te_npu.testing.step_profile``; Q3-11's own steps stay unprofiled),
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
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models.deepseek_v3.config import expected_low_precision_scope  # noqa: E402
from models.deepseek_v3.pretrain import DeepseekV3Task, model_config  # noqa: E402
from te_npu.testing.acceptance.matrix import CASES  # noqa: E402
from te_npu.testing.acceptance.run_config import FORMATS, AcceptanceModel, RunSettings  # noqa: E402

DEEPSEEK_V3 = AcceptanceModel(
    DeepseekV3Task, expected_scope=lambda cfg: expected_low_precision_scope(model_config(cfg)),
    layers=lambda cfg: (model_config(cfg).num_hidden_layers, model_config(cfg).num_nextn_predict_layers))


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


def _launch(settings: RunSettings, folder, job: str, phases: list[str]) -> int | None:
    """Start one job's ranks with torchrun (te_npu's launcher), each running this script with
    ``--job``, owned by ``folder``, and wait: its exit code, None when a signal ended the launcher."""
    cmd = [sys.executable, "-m", "te_npu.training.launch", "--standalone", "--nproc_per_node", str(settings.nproc),
           str(Path(__file__).resolve()), "--job", job, "--phases", *phases, "--out", str(settings.out),
           "--steps", str(settings.steps), "--recipes", *(f"{f}={p}" for f, p in settings.recipes.items()),
           "--device-kind", "npu" if settings.npu else "cpu", *settings.overrides]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if not settings.npu:
        env.setdefault("OMP_NUM_THREADS", "1")
    return folder.run(cmd, settings.out / "jobs" / job / f"launch_{'_'.join(phases)}.log", env=env, cwd=REPO)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=[], metavar="FMT=PATH",
                   help="bf16= mxfp8= hif8= YAML recipes (default: the 16B recipes on an NPU, the tiny ones elsewhere)")
    p.add_argument("--out", default="runs/q3_acceptance", help="report folder (a re-run skips its finished cases)")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), metavar="Q3-NN")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps of the main runs (>= 20 for Q3-01..03)")
    p.add_argument("--nproc", type=int, default=None, help="ranks per job (default: 8 on an NPU, 2 elsewhere)")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)  # a torchrun rank of one job
    p.add_argument("--phases", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--device-kind", choices=("npu", "cpu"), default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="config overrides for every recipe, e.g. data.path=/data/corpus")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    npu = args.device_kind == "npu" if args.device_kind else on_npu()
    recipes = default_recipes(npu)
    for item in args.recipes:
        fmt, sep, path = item.partition("=")
        if not sep or fmt not in FORMATS:
            print(f"q3_acceptance: --recipes takes bf16=PATH mxfp8=PATH hif8=PATH, got {item!r}", file=sys.stderr)
            return 2
        recipes[fmt] = str(Path(path).resolve())
    nproc = args.nproc or (int(os.environ["WORLD_SIZE"]) if args.job else (8 if npu else 2))
    settings = RunSettings(out=Path(args.out).resolve(), recipes=recipes, npu=npu, nproc=nproc, steps=args.steps,
                           overrides=tuple(args.overrides), cases=tuple(args.cases), model=DEEPSEEK_V3, repo=REPO)
    if args.job:  # one rank of a job: fails together with its peers, dies with its launcher
        from te_npu.testing.acceptance.rank_phases import run_rank_job
        from te_npu.training.job import run_job

        return run_job(lambda stop: run_rank_job(settings, args.job, args.phases))
    from te_npu.testing.acceptance.orchestration import in_torchrun, orchestrate

    if "WORLD_SIZE" in os.environ:
        return in_torchrun(settings)
    from te_npu.errors import ConfigError

    try:
        return orchestrate(settings, lambda folder, job, phases: _launch(settings, folder, job, phases))
    except ConfigError as exc:
        print(f"q3_acceptance: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
