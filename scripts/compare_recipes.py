"""Compare the BF16 / MXFP8 / HiF8 tiny DeepSeek-V3 recipes on the same data and seed.

    python scripts/compare_recipes.py --steps 300 --eval-interval 50 --out runs/compare_recipes \\
        --report-md docs/compare_recipes.md --report-png docs/compare_recipes.png

For each recipe (``recipes/dsv3_tiny_<x>.yaml``):

1. **Training** through the production entry, 2 ranks:
   ``python -m torch.distributed.run --nproc_per_node 2 -m models.deepseek_v3.pretrain
   --config recipes/dsv3_tiny_<x>.yaml <overrides>`` with its own ``logging.dir`` /
   ``checkpoint.dir`` under ``--out``; the same seed, data and batch order for every recipe.
   Curves, validation loss, tokens/s, step time and peak memory come from its ``metrics.jsonl``.
2. **Profiling** (a separate short run, same config): this script re-launched under
   ``torch.distributed.run`` with ``--profile-worker`` builds the production ``Trainer``, runs
   ``--profile-warmup`` steps, then ``--profile-steps`` steps through
   ``te_npu.testing.step_profile.profile_steps`` (torch.profiler; te_npu's own ``te_npu::quantize``
   / ``te_npu::gemm`` ranges and FSDP2's ranges) and reports ``te_npu.testing.time_shares``: the one
   definition of time shares, the acceptance report's (quant / MM-GMM / all-gather /
   reduce-scatter / other, each op's self time in the innermost labelled range around it; see
   docs/benchmarks-and-reports.md), mean of the ranks. The trainer's ``te_npu.events`` (a subscriber
   passed as ``Trainer(..., subscribers=...)``) give the counts per profiled step: 8-bit GEMMs,
   quantizations, all-gathers of quantized weights and their bytes, weight refreshes.
3. **Routing** of held-out text by each run's final checkpoint (``scripts/routing_report.py``).

Then it writes a Markdown report and a PNG (loss curves train + val, throughput, time shares); with
``mxfp8_mtp`` and ``mxfp8`` both run, a section on multi-token prediction.

Everything here runs on CPU: MXFP8 and HiF8 GEMMs and quantizations are *emulated* (exact
decode + FP32 matmul), so they are slower than BF16 by construction; the throughput numbers
measure the emulation, not Ascend kernels (the acceptance's performance criteria, Q3-11 in
docs/a5.md, need A5 hardware).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = ("bf16", "mxfp8", "hif8", "mxfp8_floor", "mxfp8_no_balance", "mxfp8_mtp")
# run name -> (recipe file stem, extra overrides): mxfp8 is the default (round-up, scale_alg: ceil)
# scale rule; mxfp8_floor the same recipe with the OCP floor rule chosen explicitly;
# mxfp8_no_balance the same recipe with DeepSeek-V3's expert balancing switched off; mxfp8_mtp is its
# own recipe file (dsv3_tiny_mxfp8_mtp.yaml: mxfp8 plus one multi-token-prediction layer)
VARIANTS = {"mxfp8_floor": ("mxfp8", ["low_precision.scale_alg=floor"]),
            "mxfp8_no_balance": ("mxfp8", ["model.load_balance.bias_update_rate=0",
                                           "model.load_balance.seq_aux_loss_coeff=0"])}
DEFAULT_MODEL_OVERRIDES = ""
SHARE_NAMES = {"quant": "quant", "mm_gmm": "MM-GMM", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
               "other": "other"}
"""Column names of ``te_npu.testing.time_shares.CATEGORIES`` (the acceptance report's names)."""
ACCEPT_GAP = 0.05  # the acceptance: final validation loss within 5% of BF16


# ---------------------------------------------------------------------------------------------
# command lines
# ---------------------------------------------------------------------------------------------


def run_overrides(args, recipe: str, run_dir: Path, steps: int, *, eval_interval: int) -> list[str]:
    """Config overrides for one run (training or profiling) of ``recipe`` into ``run_dir``."""
    out = [
        f"training.train_steps={steps}",
        f"training.eval_interval={eval_interval}",
        f"logging.dir={run_dir}",
        f"checkpoint.dir={run_dir / 'checkpoints'}",
        "checkpoint.resume=false",
        "checkpoint.interval=0",
        "logging.plot=false",
    ]
    if args.model_overrides:
        out.append(f"model.overrides={args.model_overrides}")
    return out + VARIANTS.get(recipe, (recipe, []))[1] + list(args.set)


def recipe_file(name: str) -> Path:
    """``recipes/dsv3_tiny_<x>.yaml`` of run ``name`` (a variant's base recipe)."""
    return REPO / "recipes" / f"dsv3_tiny_{VARIANTS.get(name, (name, []))[0]}.yaml"


def torchrun(nproc: int, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
            "--master_addr", "127.0.0.1", "--master_port", str(port)]


def launch(cmd: list[str], log_path: Path, threads: int) -> float:
    """Run ``cmd`` in the repo root, output to ``log_path``; returns wall seconds (raises on failure)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n--- {log_path} (tail) ---\n{tail}")
    return time.perf_counter() - start


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# profiling worker (runs inside torch.distributed.run)
# ---------------------------------------------------------------------------------------------

class EventCounts:
    """A ``te_npu.events`` subscriber counting, per optimizer step, what the step did."""

    def __init__(self) -> None:
        self.steps: list = []

    def __call__(self, event) -> None:
        from collections import Counter

        from te_npu import events

        if isinstance(event, events.StepBeginEvent):
            self.steps.append(Counter())
        elif self.steps:
            counts = self.steps[-1]
            counts[type(event).__name__] += 1
            if isinstance(event, events.FSDPGatherEvent):
                counts["quantized_gather_bytes"] += event.gathered_bytes


def profile_worker(args) -> int:
    """One rank of the profiling run: the production ``Trainer``, ``--profile-warmup`` steps, then
    ``--profile-steps`` steps through ``te_npu.testing.step_profile.profile_steps`` (the acceptance
    report's profiler and time shares); writes ``<profile-dir>/profile_rank<r>.json`` and the rank's
    trace and table under ``<profile-dir>/rank<r>/``."""
    import dataclasses

    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.testing.step_profile import profile_steps
    from te_npu.training.config import load_config
    from te_npu.training.trainer import Trainer

    run_dir = Path(args.profile_dir)
    steps = args.profile_warmup + args.profile_steps
    cfg = load_config(recipe_file(args.profile_worker),
                      run_overrides(args, args.profile_worker, run_dir, steps, eval_interval=0),
                      model_section=DeepseekV3Task.model_section)
    counts = EventCounts()
    trainer = Trainer(DeepseekV3Task(), print_fn=lambda *_: None, subscribers=[counts])
    try:
        trainer.setup(cfg)
        for _ in range(args.profile_warmup):
            trainer.train_step()
        records: list[dict] = []
        profile = profile_steps(lambda: records.append(dataclasses.asdict(trainer.train_step())), args.profile_steps,
                                run_dir / f"rank{trainer.rank}")
        result = {"rank": trainer.rank, **profile, "step_ms": [r["elapsed_ms"] for r in records],
                  "events_per_step": [dict(c) for c in counts.steps[args.profile_warmup:]]}
        (run_dir / f"profile_rank{trainer.rank}.json").write_text(json.dumps(result, indent=1))
    finally:
        trainer.close()
    return 0


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def summarize(records: list[dict], skip: int) -> dict:
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "val"]
    steady = train[skip:] or train
    last_k = train[-10:]
    return {
        "steps": len(train),
        "final_train": float(train[-1]["lm_loss"]),
        "final_train_mean10": sum(float(r["lm_loss"]) for r in last_k) / len(last_k),
        "final_val": float(val[-1]["lm_loss"]) if val else float("nan"),
        "val_step": val[-1]["step"] if val else None,
        "tokens_per_s": sum(float(r["tokens_per_s"]) for r in steady) / len(steady),
        "step_ms": sum(float(r["elapsed_ms"]) for r in steady) / len(steady),
        "peak_mem_mb": max(float(r["peak_mem_mb"]) for r in train if r.get("peak_mem_mb") is not None),
        "finite": all(math.isfinite(float(r["lm_loss"])) and math.isfinite(float(r["grad_norm"])) for r in train),
        "skipped": int(train[-1].get("skipped_iterations", 0)),
        "global_batch": train[-1].get("global_batch_size"),
    }


def read_profile(run_dir: Path) -> dict | None:
    """The profiling run's time shares, mean over its ranks (``te_npu.testing.time_shares.mean_over_ranks``);
    None when it left no ``profile_rank*.json`` of the current layout (one with ``shares``)."""
    from te_npu.testing.time_shares import mean_over_ranks

    ranks = [json.loads(f.read_text()) for f in sorted(run_dir.glob("profile_rank*.json"))]
    if not ranks or any("shares" not in r for r in ranks):
        return None
    return {**mean_over_ranks([r["shares"] for r in ranks], ranks[0]["steps"]), "ranks": len(ranks)}


def plot(out_png: Path, runs: dict, summaries: dict, profiles: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from te_npu.training.metrics.plots import series

    colors = {"bf16": "tab:blue", "mxfp8": "tab:orange", "hif8": "tab:green", "mxfp8_floor": "tab:red",
              "mxfp8_no_balance": "tab:purple", "mxfp8_mtp": "tab:brown"}
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0, 0]
    for name, records in runs.items():
        steps, raw = series(records, "train", "lm_loss")
        _, smooth = series(records, "train", "lm_loss", smooth=0.9)
        ax.plot(steps, raw, color=colors[name], alpha=0.2, linewidth=0.8)
        ax.plot(steps, smooth, color=colors[name], linewidth=1.5, label=f"{name} train (EMA 0.9)")
        vsteps, vvalues = series(records, "val", "lm_loss")
        ax.plot(vsteps, vvalues, color=colors[name], linestyle="--", marker="o", markersize=4, label=f"{name} val")
    ax.set_title("lm loss (train: raw + EMA; val: dashed)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.legend(fontsize=8)

    ax = axes[0, 1]
    base = runs.get("bf16")
    if base is not None:
        bsteps, bvals = series(base, "val", "lm_loss")
        ref = dict(zip(bsteps, bvals))
        for name, records in runs.items():
            if name == "bf16":
                continue
            steps, values = series(records, "val", "lm_loss")
            pts = [(s, 100 * (v - ref[s]) / ref[s]) for s, v in zip(steps, values) if s in ref]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[name], marker="o", label=name)
        ax.axhspan(-100 * ACCEPT_GAP, 100 * ACCEPT_GAP, color="grey", alpha=0.15, label="±5% acceptance band")
        ax.axhline(0, color="black", linewidth=0.8)
    ax.set_title("validation loss gap vs BF16 (%)")
    ax.set_xlabel("iteration")
    ax.legend(fontsize=8)

    ax = axes[1, 0]
    for name, records in runs.items():
        steps, values = series(records, "train", "tokens_per_s")
        ax.plot(steps, values, color=colors[name], linewidth=1.0, label=f"{name} ({summaries[name]['tokens_per_s']:.0f} tok/s)")
    ax.set_title("tokens/s (CPU emulation; not NPU performance)")
    ax.set_xlabel("iteration")
    ax.legend(fontsize=8)

    ax = axes[1, 1]
    from te_npu.testing.time_shares import CATEGORIES

    names = [n for n in runs if profiles.get(n)]
    bottom = [0.0] * len(names)
    for category in CATEGORIES:
        values = [profiles[n]["percent"][category] for n in names]
        if category == "other" or not any(values):
            continue
        ax.bar(names, values, bottom=bottom, label=SHARE_NAMES[category])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.bar(names, [100 - b for b in bottom], bottom=bottom, color="lightgrey", label="other + not in an op")
    ax.tick_params(axis="x", labelrotation=20)
    ax.set_title("time shares: % of profiled step wall time, mean of ranks")
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def _gap_by_step(runs: dict) -> list[str]:
    """Validation loss gap vs BF16 at every evaluation (shows whether a gap grows with training)."""
    val = {n: {r["step"]: float(r["lm_loss"]) for r in recs if r.get("kind") == "val"} for n, recs in runs.items()}
    others = [n for n in runs if n != "bf16"]
    if "bf16" not in val or not others:
        return []
    out = ["Validation loss gap vs BF16 at each evaluation:", "",
           "| step | bf16 val | " + " | ".join(f"{n} gap" for n in others) + " |",
           "|---" * (2 + len(others)) + "|"]
    for step, ref in sorted(val["bf16"].items()):
        gaps = [f"{100 * (val[n][step] - ref) / ref:+.2f}%" if step in val[n] else "—" for n in others]
        out.append(f"| {step} | {ref:.4f} | " + " | ".join(gaps) + " |")
    return out + [""]


def _routing_table(routing: dict, cfg_dict: dict) -> list[str]:
    """Per run and MoE layer: the expert loads of the final checkpoint on held-out text
    (``scripts/routing_report.py``)."""
    if not routing:
        return []
    t, lb = cfg_dict["training"], cfg_dict["model"].get("load_balance", {})
    lines = ["## Expert routing on held-out text", "",
             f"Each run's final checkpoint routes 32 validation batches ({t['micro_batch_size']} x {t['seq_len']} "
             "tokens) in evaluation mode, bias included (`scripts/routing_report.py`). Balancing as shipped: "
             f"`model.load_balance` bias_update_rate {lb.get('bias_update_rate')}, seq_aux_loss_coeff "
             f"{lb.get('seq_aux_loss_coeff')}; `mxfp8_no_balance` switches both off.", "",
             "| run | layer | coefficient of variation | busiest / mean | idlest / mean | experts < 10 % of mean |",
             "|---|---|---|---|---|---|"]
    for name, layers in routing.items():
        for label, r in layers.items():
            lines.append(f"| {name} | {label} | {r['load_cv']:.2f} | {r['load_max']:.2f} | {r['load_min']:.2f} | "
                         f"{r['experts_under_10pct']} |")
    return lines + [""]


def _mean(records: list[dict], key: str) -> float:
    return sum(float(r[key]) for r in records) / len(records)


def _mtp_section(runs: dict, summaries: dict, run: str = "mxfp8_mtp", base: str = "mxfp8") -> list[str]:
    """The MTP run against the same recipe without MTP: validation ``lm_loss`` (the main next-token loss
    alone, comparable across D) and the MTP depths' losses at every evaluation, their training means."""
    if run not in runs or base not in runs:
        return []
    val = {n: {r["step"]: r for r in runs[n] if r.get("kind") == "val"} for n in (run, base)}
    train = [r for r in runs[run] if r.get("kind") == "train"]
    depths = sorted(k for k in (train[-1] if train else {}) if k.startswith("mtp_") and k.endswith("_loss"))
    if not depths:
        return []
    config = next((r["config"] for r in runs[run] if r.get("kind") == "config"), {})
    weights = ", ".join(f"{k} {v}" for k, v in config.get("model", {}).get("mtp", {}).items()) or "?"
    lines = ["", f"## Multi-token prediction: {run} against {base}", "",
             f"`{run}` runs `{recipe_file(run).relative_to(REPO)}`: the `{base}` recipe plus "
             f"`model.overrides.num_nextn_predict_layers` = {len(depths)} and the MTP loss weight (`model.mtp`: "
             f"{weights}; docs/pretraining.md#multi-token-prediction); same "
             "seed, data and batch order. Validation `lm loss` is the main next-token loss alone, so it reads beside "
             f"the D = 0 run; `mtp k loss` is depth k's (it predicts `t[i + 1 + k]` from `t[<= i + k]`, knowing k "
             "tokens more than the main head, so it sits below the main loss once trained).", "",
             f"| step | {base} val lm loss | {run} val lm loss | {run} vs {base} | "
             + " | ".join(f"{run} val {d.replace('_', ' ')}" for d in depths) + " |",
             "|---|---|---|---|" + "---|" * len(depths)]
    for step, r in sorted(val[run].items()):
        b = val[base].get(step)
        ref = f"{float(b['lm_loss']):.4f}" if b else "—"
        gap = f"{pct((float(r['lm_loss']) - float(b['lm_loss'])) / float(b['lm_loss']))}" if b else "—"
        lines.append(f"| {step} | {ref} | {float(r['lm_loss']):.4f} | {gap} | "
                     + " | ".join(f"{float(r[d]):.4f}" if d in r else "—" for d in depths) + " |")
    first, last = train[:10], train[-10:]
    base_last = [r for r in runs[base] if r.get("kind") == "train"][-10:]
    lines += ["", "Training, mean of the first and last 10 steps: "
              + "; ".join(f"`{d.replace('_', ' ')}` {_mean(first, d):.2f} -> {_mean(last, d):.2f}" for d in depths)
              + f"; `lm loss` {_mean(first, 'lm_loss'):.2f} -> {_mean(last, 'lm_loss'):.4f} "
              f"({base}: {_mean(base_last, 'lm_loss'):.4f}). Step time {summaries[run]['step_ms']:.0f} ms against "
              f"{summaries[base]['step_ms']:.0f} ms without MTP (the same shared machine; MTP's FLOPs: "
              "`models/deepseek_v3/flops.py`, one more MoE layer, `eh_proj` and a second head)."]
    return lines


def _time_shares_table(args, summaries: dict, profiles: dict) -> list[str]:
    """The time shares section: ``te_npu.testing.time_shares`` of each recipe's profiling run, mean of
    its ranks, under the acceptance report's rule and column names."""
    from te_npu.testing.time_shares import CATEGORIES

    lines = [
        "## Time shares (te_npu.testing.time_shares)",
        "",
        f"A separate run per recipe (same config): {args.profile_warmup} warm-up steps, then {args.profile_steps} "
        "steps profiled by `te_npu.testing.step_profile` (torch.profiler, CPU activities), the acceptance report's "
        "profiler and rule (docs/benchmarks-and-reports.md): each op's self time counts once, in the innermost "
        "labelled range around it (`te_npu::quantize` -> quant, `te_npu::gemm` -> MM-GMM, FSDP2's "
        "`FSDP::all_gather*` -> all-gather, `FSDP::post_backward_reduce` / `_rs_wait` -> reduce-scatter); outside "
        "every range aten GEMMs (`mm`, `addmm`, `matmul`, `linear`, `_grouped_mm`: the BF16 TE modules, lm_head, "
        "router) count as MM-GMM, core attention does not; everything else (optimizer, norms, all-reduces of "
        "grad norm / HiF8 amax / loss, ...) is other. A cell reads percent of the profiled step wall time (ms per "
        "step), mean of the 2 ranks; *not in an op*: wall time no op covers (Python between ops). Host self time "
        "of the CPU emulation: **emulation numbers**. With gloo on 2 busy cores the collectives also absorb "
        "waiting for the slower rank. The last column is the busy time of gloo's own worker threads (the "
        "transfers; `comm_threads_ms`), not counted in the other columns: the step's thread waits for them "
        "inside the FSDP ranges. Profiler overhead inflates everything a little.",
        "",
        "| recipe | profiled ms/step | " + " | ".join(SHARE_NAMES[c] for c in CATEGORIES)
        + " | not in an op | collective threads (not counted) |",
        "|---|---|" + "---|" * (len(CATEGORIES) + 2),
    ]
    for name in summaries:
        p = profiles.get(name)
        if not p:
            lines.append(f"| {name} | (not profiled) |" + " |" * (len(CATEGORIES) + 2))
            continue
        cells = [f"{p['percent'][c]:.1f}% ({p['ms_per_step'][c]:.0f})" for c in CATEGORIES]
        threads = ", ".join(f"{n} {v:.1f}%" for n, v in p["comm_threads_percent"].items()) or "-"
        lines.append(f"| {name} | {p['wall_ms_per_step']:.0f} | " + " | ".join(cells)
                     + f" | {p['unattributed_percent']:.1f}% | {threads} |")
    return lines


def _wall(walls: dict, name: str) -> str:
    w = walls.get(name)
    if not isinstance(w, dict):
        return "? | ?"
    return f"{w['wall_s']:.0f} | {w['load_start']:.1f} / {w['load_end']:.1f}"


def pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def write_report(args, out_md: Path, out_png: Path, runs: dict, summaries: dict, profiles: dict, walls: dict,
                 cfg_dict: dict, routing: dict | None = None) -> str:
    t = cfg_dict["training"]
    base = summaries.get("bf16")
    lines = [
        "# BF16 (high-precision baseline) vs MXFP8 (round-up and floor scales) vs HiF8: tiny DeepSeek-V3 on CPU (emulation)",
        "",
        f"Generated by `python scripts/compare_recipes.py {' '.join(args.command)}` on {time.strftime('%Y-%m-%d')}.",
        "",
        "**Everything below is CPU emulation.** MXFP8 / HiF8 quantization and GEMMs run in "
        "`te_npu.ops.emulation` (bit-exact decode, FP32 matmul); 2 gloo ranks on a 2-core CPU "
        "shared with other jobs. Loss numbers are the numerics of the formats; time, throughput and "
        "memory numbers describe the emulation, not Ascend A5 kernels, so the acceptance's performance "
        "criteria (Q3-11, docs/a5.md) cannot be judged here.",
        "",
        "## Setup",
        "",
        f"- Recipes: `recipes/dsv3_tiny_{{bf16,mxfp8,hif8}}.yaml` (identical except `low_precision`), "
        f"launched with `python -m torch.distributed.run --nproc_per_node 2 -m models.deepseek_v3.pretrain`. "
        "`mxfp8` computes E8M0 scales with the default round-up rule (`low_precision.scale_alg: ceil`); "
        "`mxfp8_floor` is the same recipe with `low_precision.scale_alg=floor` (the OCP rule, te_npu's "
        "default before issue 26); `mxfp8_mtp` is `recipes/dsv3_tiny_mxfp8_mtp.yaml` (mxfp8 plus one "
        "multi-token-prediction layer; its own section below).",
        f"- Overrides for every recipe: `{' '.join(run_overrides(args, 'x', Path('<out>/<recipe>'), args.steps, eval_interval=args.eval_interval))}`.",
        f"- Model: `dsv3_tiny` preset + `model.overrides={args.model_overrides or '{}'}` "
        f"({cfg_dict['model']['overrides']}).",
        f"- Data: {cfg_dict['data']['kind']} corpus, byte-level (vocab 256), max_bytes {cfg_dict['data']['max_bytes']}, "
        f"validation = held-out files ({cfg_dict['data']['val_fraction']:.0%}), `eval_steps` {t['eval_steps']} batches per rank.",
        f"- Same seed ({t['seed']}), same batch order for all recipes: micro batch {t['micro_batch_size']} x seq_len "
        f"{t['seq_len']} x 2 ranks x accumulation {t['gradient_accumulation_steps']} = "
        f"{t['micro_batch_size'] * t['seq_len'] * 2 * t['gradient_accumulation_steps']} tokens per step; "
        f"{args.steps} steps; lr {t['lr']} -> {t['min_lr']} {t['lr_schedule']}, warmup {t['warmup_steps']}.",
        f"- Parameter dtype: `training.param_dtype: {t['param_dtype']}` (the tiny recipes' CPU choice). The "
        f"`bf16` recipe is the high-precision baseline: its TE modules compute in the parameter dtype "
        f"({t['param_dtype']} here), while MXFP8 / HiF8 run every TE GEMM (fprop, dgrad, wgrad) in 8 bits; "
        "embedding, lm_head, router, norms and core attention stay high precision in all three.",
        "",
        "## Results",
        "",
        "| recipe | final val loss | gap vs BF16 | final train loss (mean last 10) | gap vs BF16 | "
        "tokens/s | mean step time (ms) | peak RSS rank 0 (MiB) | finite / skipped | wall (s) | host load avg start / end |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        if base and name != "bf16":
            dv, dt = s["final_val"] - base["final_val"], s["final_train_mean10"] - base["final_train_mean10"]
            gap_v = f"{dv:+.4f} ({pct(dv / base['final_val'])})"
            gap_t = f"{dt:+.4f} ({pct(dt / base['final_train_mean10'])})"
        else:
            gap_v = gap_t = "—"
        lines.append(
            f"| {name} | {s['final_val']:.4f} | {gap_v} | {s['final_train_mean10']:.4f} | {gap_t} | "
            f"{s['tokens_per_s']:.0f} | {s['step_ms']:.0f} | {s['peak_mem_mb']:.0f} | "
            f"{'yes' if s['finite'] else 'NO'} / {s['skipped']} | {_wall(walls, name)} |"
        )
    skip = args.skip_steps
    lines += [
        "",
        f"Final validation loss: the evaluation at the last step ({base['val_step'] if base else '?'}). Throughput "
        f"and step time: mean over steps {skip + 1}..{args.steps} (the first {skip} excluded), from each run's "
        "`metrics.jsonl` (`tokens_per_s`, `elapsed_ms` as the Trainer logs them). Peak memory: on CPU the "
        "Trainer logs rank 0's process max RSS (`peak_memory_mb`), which includes the Python/torch runtime; "
        "there is no device-memory counter to read.",
        "",
    ]
    if base:
        lines += ["Throughput and step-time ratios against BF16 (Q3-11's, docs/a5.md; emulation, informative only):",
                  "",
                  "| recipe | throughput_ratio (>= 1.0 on A5) | step_time_ratio (<= 1.0 on A5) |", "|---|---|---|"]
        for name, s in summaries.items():
            if name != "bf16":
                lines.append(f"| {name} | {s['tokens_per_s'] / base['tokens_per_s']:.3f} | {s['step_ms'] / base['step_ms']:.3f} |")
        lines.append("")
    lines += [
        "## Acceptance: final validation loss within 5% of BF16",
        "",
    ]
    verdicts = []
    if base:
        for name, s in summaries.items():
            if name == "bf16":
                continue
            gap = abs(s["final_val"] - base["final_val"]) / base["final_val"]
            ok = gap <= ACCEPT_GAP and s["finite"]
            verdicts.append(ok)
            lines.append(f"- **{name}**: |{s['final_val']:.4f} - {base['final_val']:.4f}| / {base['final_val']:.4f} "
                         f"= {100 * gap:.2f}% -> {'PASS' if ok else 'FAIL'}")
        lines += ["", f"Overall: **{'holds' if verdicts and all(verdicts) else 'does NOT hold'}** for this run.", ""]
        lines += _gap_by_step(runs)
    lines += [
        *_routing_table(routing or {}, cfg_dict),
    ]
    lines += _time_shares_table(args, summaries, profiles)
    lines += _mtp_section(runs, summaries)
    lines += [
        "",
        "## Plot",
        "",
        f"![loss curves, gap, throughput, time shares]({os.path.relpath(out_png, out_md.parent)})",
        "",
        "## What this does not measure",
        "",
        "- NPU kernel speed, HBM traffic, and device memory (emulation on CPU; Q3-11 needs A5).",
        "- The 16B model (this is the tiny preset; the acceptance runs the 16B model, docs/a5.md).",
        "- Statistical spread: one seed per recipe; the gaps include run-to-run noise of a single seed.",
        "- Reshard / recompute switches (all runs: `reshard_after_forward: true`, recompute off).",
        "",
    ]
    text = "\n".join(lines)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(text)
    return text


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per recipe (default: the recipes' 300)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "compare_recipes", help="run directories")
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"comma list out of {','.join(RECIPES)}")
    p.add_argument("--eval-interval", type=int, default=None, help="validation interval (default: steps // 5)")
    p.add_argument("--skip-steps", type=int, default=None, help="steps excluded from throughput (default: max(5, steps // 10))")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--profile-warmup", type=int, default=2)
    p.add_argument("--model-overrides", default=DEFAULT_MODEL_OVERRIDES,
                   help="model.overrides for every recipe, e.g. '{num_hidden_layers: 2}' (default: none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override (repeatable)")
    p.add_argument("--report-md", type=Path, default=None, help="default: <out>/compare_recipes.md")
    p.add_argument("--report-png", type=Path, default=None, help="default: <out>/compare_recipes.png")
    p.add_argument("--report-only", action="store_true", help="rebuild the report from existing runs in --out")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    p.add_argument("--profile-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--profile-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.eval_interval is None:
        args.eval_interval = max(1, args.steps // 5)
    if args.skip_steps is None:
        args.skip_steps = max(5, args.steps // 10)
    return args


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO))
    args = parse_args(argv)
    if args.profile_worker:
        return profile_worker(args)
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = set(recipes) - set(RECIPES)
    if unknown:
        raise SystemExit(f"--recipes: unknown {sorted(unknown)}; choose from {RECIPES}")
    out = args.out.resolve()
    md = (args.report_md or out / "compare_recipes.md").resolve()
    png = (args.report_png or out / "compare_recipes.png").resolve()
    walls_file = out / "walls.json"
    walls: dict[str, dict] = json.loads(walls_file.read_text()) if walls_file.exists() else {}
    passthrough = [a for a in args.argv if a != "--report-only"]
    if not args.report_only:
        for name in recipes:
            run_dir = out / name
            config = recipe_file(name)
            if (run_dir / "metrics.jsonl").exists():
                (run_dir / "metrics.jsonl").unlink()  # the logger appends; start clean
            cmd = torchrun(2, free_port()) + ["-m", "models.deepseek_v3.pretrain", "--config", str(config),
                                              *run_overrides(args, name, run_dir, args.steps, eval_interval=args.eval_interval)]
            print(f"[{name}] training {args.steps} steps -> {run_dir}", flush=True)
            load_start = os.getloadavg()[0]
            wall = launch(cmd, run_dir / "train.log", args.threads)
            walls[name] = {"wall_s": wall, "load_start": load_start, "load_end": os.getloadavg()[0],
                           "finished": time.strftime("%H:%M:%S")}
            print(f"[{name}] done in {wall:.0f} s; routing held-out text", flush=True)
            launch([sys.executable, str(REPO / "scripts" / "routing_report.py"), "--config", str(config),
                    "--json", str(run_dir / "routing.json"),
                    *run_overrides(args, name, run_dir, args.steps, eval_interval=args.eval_interval)],
                   run_dir / "routing.log", args.threads)
            print(f"[{name}] profiling {args.profile_steps} steps", flush=True)
            prof_dir = out / name / "profile"
            cmd = torchrun(2, free_port()) + [str(Path(__file__).resolve()), *passthrough,
                                              "--profile-worker", name, "--profile-dir", str(prof_dir)]
            launch(cmd, prof_dir / "profile.log", args.threads)
            walls_file.write_text(json.dumps(walls, indent=1))
        (out / "command.json").write_text(json.dumps(args.argv))

    command_file = out / "command.json"
    args.command = json.loads(command_file.read_text()) if command_file.exists() else args.argv
    from te_npu.training.config import load_config
    from te_npu.training.metrics.log import read_metrics

    runs = {name: read_metrics(out / name / "metrics.jsonl") for name in recipes}
    routing = {name: json.loads((out / name / "routing.json").read_text()) for name in recipes
               if (out / name / "routing.json").exists()}
    summaries = {name: summarize(records, args.skip_steps) for name, records in runs.items()}
    profiles = {name: read_profile(out / name / "profile") for name in recipes}
    cfg = load_config(recipe_file(recipes[0]),
                      run_overrides(args, recipes[0], out / recipes[0], args.steps, eval_interval=args.eval_interval))
    title = (f"tiny DeepSeek-V3, {args.steps} steps, 2 CPU ranks (MXFP8/HiF8 emulated) - "
             f"{cfg.tokens_per_step} tokens/step")
    plot(png, runs, summaries, profiles, title)
    text = write_report(args, md, png, runs, summaries, profiles, walls, cfg.to_dict(), routing)
    print(text)
    print(f"wrote {md} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
