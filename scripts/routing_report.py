#!/usr/bin/env python
"""How a trained DeepSeek-V3 routes held-out text: per MoE layer, the expert loads of its top-k
picks as routed (bias included) on the run's validation split.

    python scripts/routing_report.py --config recipes/dsv3_tiny_mxfp8.yaml [--checkpoint DIR] \\
        [--batches 32] [--json routing.json] [key=value ...]

The checkpoint (default: the config's ``checkpoint.dir``, its ``latest``) is read through the
DCP -> Hugging Face conversion (FP32 masters) into one unsharded model on the CPU, which runs
``--batches`` validation batches of the config's micro batch and sequence length in evaluation
mode, under the config's low-precision recipe. Printed per layer (and written with ``--json``):
coefficient of variation of the expert loads, busiest / idlest expert over the mean, experts
under 10 % of the mean, the bias range. Exit 2 on a bad config or checkpoint, as the job.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the run's YAML recipe")
    parser.add_argument("--checkpoint", help="checkpoint.dir of the run or a step_N dir (default: the config's)")
    parser.add_argument("--batches", type=int, default=32, help="validation batches to route")
    parser.add_argument("--json", help="write the per-layer figures here")
    parser.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    return parser.parse_args(argv)


def held_out_routing(args: argparse.Namespace) -> dict:
    """Per MoE layer label -> its routing figures on the validation batches (and the tokens routed)."""
    import torch

    import te_npu
    from models.deepseek_v3.balance_step import ExpertLoadBalancer
    from models.deepseek_v3.hf_mapping import load_hf_checkpoint
    from models.deepseek_v3.load_balance import routing_figures
    from models.deepseek_v3.model import TopKRouter
    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.training.config import load_config
    from te_npu.training.data import build_splits, validation_batches
    from te_npu.training.hf.convert import dcp_to_hf

    task = DeepseekV3Task()
    cfg = load_config(args.config, args.overrides, model_section=task.model_section)
    t = cfg.training
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_hf(cfg, task, args.checkpoint or cfg.checkpoint.dir, f"{tmp}/hf", dtype="fp32", progress=False)
        model = task.build(cfg, torch.float32)
        load_hf_checkpoint(model, f"{tmp}/hf")
    model.eval()
    routers = ExpertLoadBalancer.routers_of(model, TopKRouter)
    counts = {label: torch.zeros(router.e_score_correction_bias.numel(), dtype=torch.int64) for label, router in routers}
    def count(label):
        def hook(module, args, out) -> None:  # out: (weights [T, K], expert ids [T, K])
            counts[label] += torch.bincount(out[1].flatten(), minlength=counts[label].numel())
        return hook

    for label, router in routers:
        router.register_forward_hook(count(label))
    val = build_splits(cfg.data, task.vocab_size(cfg)).val
    batches = validation_batches(val, t.micro_batch_size, t.seq_len, num_batches=args.batches, seed=t.seed,
                                 vocab_size=task.vocab_size(cfg))
    recipe = cfg.low_precision.recipe
    tokens = 0
    with torch.no_grad(), te_npu.autocast(enabled=recipe is not None, recipe=recipe):
        for input_ids, _ in batches:
            model(input_ids)
            tokens += input_ids.numel()
    figures = routing_figures(torch.stack(list(counts.values())))
    return {label: {"load_cv": f.load_cv, "load_max": f.load_max, "load_min": f.load_min,
                    "experts_under_10pct": f.experts_under_10pct, "tokens": tokens,
                    "bias_min": float(router.e_score_correction_bias.min()),
                    "bias_max": float(router.e_score_correction_bias.max())}
            for (label, router), f in zip(routers, figures)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from te_npu.training.job import run_job

    def body(stop) -> None:
        report = held_out_routing(args)
        print("| layer | coefficient of variation | busiest / mean | idlest / mean | experts < 10 % of mean | bias range |")
        print("|---|---|---|---|---|---|")
        for label, r in report.items():
            print(f"| {label} | {r['load_cv']:.2f} | {r['load_max']:.2f} | {r['load_min']:.2f} | "
                  f"{r['experts_under_10pct']} | [{r['bias_min']:+.3f}, {r['bias_max']:+.3f}] |")
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))

    return run_job(body)


if __name__ == "__main__":
    sys.exit(main())
