#!/usr/bin/env python
"""Convert DeepSeek-V3 checkpoints: a run's DCP step <-> a Hugging Face safetensors directory.

    # DCP -> HF (latest step of a run, or one step directory), bf16, 5000 MiB files
    python scripts/convert_checkpoint.py dcp-to-hf --config recipes/dsv3_tiny_mxfp8.yaml \\
        --checkpoint runs/dsv3_tiny_mxfp8/checkpoints --out runs/dsv3_tiny_mxfp8/hf --dtype bf16
    # HF -> DCP: a step-0 te_npu checkpoint that `checkpoint.resume: true` continues from
    python scripts/convert_checkpoint.py hf-to-dcp --config recipes/dsv3_16b_mxfp8.yaml \\
        --hf /models/deepseek-v3-16b --out runs/dsv3_16b_mxfp8/checkpoints
    # either one on several ranks (each holds and reads 1/N of every evenly divisible tensor)
    torchrun --nproc-per-node 8 scripts/convert_checkpoint.py dcp-to-hf ...

The model is the one ``--config`` (the run's YAML; trailing ``key=value`` overrides as in
pretraining) describes. DCP -> HF writes the FP32 masters cast to ``--dtype`` (the router stays
FP32, as in transformers), per-expert keys (``--stacked-experts`` for transformers' in-memory
layout), ``config.json`` and ``model.safetensors.index.json``; the result loads with
``transformers.DeepseekV3ForCausalLM.from_pretrained``. Conversion runs on CPU (gloo).
When the config names the HF directory the run started from (``checkpoint.initial_load_path``),
the export carries its ``config.json`` fields and copies its tokenizer files.

Errors are one line: a bad argument, config or input (``ConfigError``) exits 2, anything else 1
with its traceback, as a training job (``te_npu.training.job.run_job``).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    to_hf = sub.add_parser("dcp-to-hf", help="a te_npu DCP checkpoint -> a Hugging Face directory")
    to_hf.add_argument("--checkpoint", required=True, help="checkpoint.dir of a run (its `latest`) or a step_N dir")
    to_hf.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="tensor dtype on disk")
    to_hf.add_argument("--max-shard-mb", type=int, default=5000, help="largest output file, MiB")
    to_hf.add_argument("--stacked-experts", action="store_true",
                       help="write experts stacked (gate_up_proj [E, 2F, D]) instead of per expert")
    to_hf.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    to_dcp = sub.add_parser("hf-to-dcp", help="a Hugging Face directory -> a te_npu DCP checkpoint at step 0")
    to_dcp.add_argument("--hf", required=True, help="HF directory: config.json + *.safetensors (+ index)")
    for p in (to_hf, to_dcp):
        p.add_argument("--config", required=True, help="the run's YAML recipe (its `model` section is used)")
        p.add_argument("--out", required=True, help="output directory")
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
        p.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from te_npu.training.job import run_job

    return run_job(lambda stop: _convert(args))


def _convert(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.training.config import load_config
    from te_npu.training.hf.convert import dcp_to_hf, hf_to_dcp

    # config errors (the model section's too) surface before any rank starts work
    cfg = load_config(args.config, args.overrides, model_section=DeepseekV3Task.model_section)
    owns_group = not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if owns_group:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.direction == "dcp-to-hf":
        report = dcp_to_hf(cfg, DeepseekV3Task(), args.checkpoint, args.out, dtype=args.dtype,
                           max_shard_mb=args.max_shard_mb, per_expert=not args.stacked_experts,
                           overwrite=args.overwrite, progress=not args.no_progress)
        if rank == 0:
            print(f"convert_checkpoint: wrote {report.directory}: {len(report.files)} file(s), "
                  f"{report.num_tensors} tensors, {report.total_bytes / 2**20:.1f} MiB ({args.dtype})"
                  f"{'; it completes the interrupted export left in ' + report.directory + '.tmp' if report.completed else ''}")
            if report.kept:
                print(f"convert_checkpoint: kept {', '.join(report.kept)} in {report.directory}: not written by the "
                      "earlier export it replaces, so left as it was")
    else:
        path = hf_to_dcp(cfg, DeepseekV3Task(), args.hf, args.out, progress=not args.no_progress)
        if rank == 0:
            print(f"convert_checkpoint: wrote {path} (step 0; resume with checkpoint.dir={args.out} "
                  "checkpoint.resume=true)")
    if owns_group:  # the success path only: a failure leaves through run_job (no barrier)
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
