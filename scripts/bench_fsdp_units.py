"""FSDP2 unit plans on the tiny DeepSeek-V3 job: collectives per optimizer step and step time.

    python scripts/bench_fsdp_units.py [--recipes bf16,mxfp8,hif8] [--steps 6] [--warmup 2]

For each recipe the production ``Trainer`` runs the tiny recipe (``recipes/dsv3_tiny_<x>.yaml``,
2 gloo ranks under ``torch.distributed.run``) twice, same seed and data:

* ``module`` (the baseline, the plan before issue 13): every TE module its own FSDP2 unit
  (``te_npu.distributed.te_module_units``), the rest with the root;
* ``layer`` (the trainer's plan): one unit per decoder layer (``layer_units``, torchtitan's).

After ``--warmup`` steps it counts, per optimizer step, the collectives FSDP2 and the optimizer
issue (``torch.distributed`` entry points wrapped for the run: all-gathers, reduce-scatters,
all-reduces) and the step time, and checks that both plans give the same losses bit for bit.
Printed: counts and times per plan and the ratio layer / module measured in the same run.
Times are CPU emulation on gloo, not A5 numbers (where fewer, larger collectives matter more).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLLECTIVES = {
    "all_gather": ("all_gather_single", "all_gather_into_tensor", "all_gather"),
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter"),
    "all_reduce": ("all_reduce",),
}


def _count_collectives(counter: Counter) -> None:
    """Wrap ``torch.distributed``'s collective entry points so each call adds to ``counter``."""
    import torch.distributed as dist

    for kind, names in COLLECTIVES.items():
        for name in names:
            original = getattr(dist, name, None)
            if original is None:
                continue

            def counted(*args, _original=original, _kind=kind, **kwargs):
                counter[_kind] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)  # FSDP2 and te_npu call them as ``dist.<name>``


def worker(args) -> int:
    """Inside ``torch.distributed.run``: one (recipe, plan) run; rank 0 writes the JSON result."""
    import torch

    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.distributed import te_module_units
    from te_npu.training import trainer as trainer_module
    from te_npu.training.config import load_config

    if args.plan == "module":  # the previous plan: every TE module its own unit
        trainer_module.layer_units = lambda model, layer_types, apart=(): te_module_units(model)
    out = Path(args.out)
    steps = args.warmup + args.steps
    cfg = load_config(REPO / "recipes" / f"dsv3_tiny_{args.recipe}.yaml", [
        f"training.train_steps={steps}", "training.eval_interval=0", f"training.quant_kernel={args.quant_kernel}",
        f"logging.dir={out / 'logs'}", f"checkpoint.dir={out / 'ckpt'}", "checkpoint.resume=false",
        "checkpoint.interval=0", "logging.plot=false",
    ], model_section=DeepseekV3Task.model_section)
    trainer = trainer_module.Trainer(DeepseekV3Task(), print_fn=lambda *_: None)
    counter: Counter = Counter()
    try:
        trainer.setup(cfg)
        units = len(trainer.shard_plan.units) if trainer.shard_plan is not None else 0
        losses = [float(trainer.train_step().lm_loss) for _ in range(args.warmup)]
        _count_collectives(counter)
        per_step, times = [], []
        for _ in range(args.steps):
            counter.clear()
            start = time.perf_counter()
            losses.append(float(trainer.train_step().lm_loss))
            times.append(time.perf_counter() - start)
            per_step.append(dict(counter))
        if trainer.rank == 0:
            (out / "result.json").write_text(json.dumps({
                "units": units, "losses": [l.hex() for l in losses], "per_step": per_step, "step_s": times,
                "threads": torch.get_num_threads(),
            }))
    finally:
        trainer.close()
    return 0


def run(recipe: str, plan: str, args, root: Path) -> dict:
    out = root / f"{recipe}_{plan}"
    out.mkdir(parents=True, exist_ok=True)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(port), str(Path(__file__).resolve()),
           "--worker", "--recipe", recipe, "--plan", plan, "--out", str(out), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--quant-kernel", args.quant_kernel]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{recipe}/{plan} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads((out / "result.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="bf16,mxfp8,hif8")
    p.add_argument("--steps", type=int, default=6, help="measured optimizer steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    p.add_argument("--quant-kernel", default="eager", help="training.quant_kernel for both plans")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--recipe", help=argparse.SUPPRESS)
    p.add_argument("--plan", choices=("module", "layer"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    print(f"tiny DeepSeek-V3, 2 gloo ranks, {args.threads} thread(s) each, {args.steps} steps after {args.warmup}; "
          "per optimizer step (rank 0): all-gathers / reduce-scatters / all-reduces, median step time")
    with tempfile.TemporaryDirectory(prefix="bench_fsdp_units_") as tmp:
        for recipe in args.recipes.split(","):
            rows = {plan: run(recipe, plan, args, Path(tmp)) for plan in ("module", "layer")}
            same = rows["module"]["losses"] == rows["layer"]["losses"]
            stats = {}
            for plan, r in rows.items():
                counts = {k: statistics.mean(s.get(k, 0) for s in r["per_step"]) for k in COLLECTIVES}
                stats[plan] = (counts, statistics.median(r["step_s"]))
                print(f"{recipe:<6} {plan:<7} units {r['units']:3d}  "
                      + "  ".join(f"{k} {v:6.1f}" for k, v in counts.items())
                      + f"  step {stats[plan][1] * 1e3:8.1f} ms", flush=True)
            (mc, mt), (lc, lt) = stats["module"], stats["layer"]
            ratios = "  ".join(f"{k} {lc[k] / mc[k]:.2f}x" if mc[k] else f"{k} -" for k in COLLECTIVES)
            print(f"{recipe:<6} layer/module  {ratios}  step time {lt / mt:.2f}x  losses bitwise equal: {same}",
                  flush=True)
            if not same:
                print(f"{recipe}: the plans' losses differ: {rows['module']['losses']} vs {rows['layer']['losses']}")
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
