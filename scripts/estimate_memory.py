"""Per-rank memory of a DeepSeek-V3 recipe, from the real Trainer setup and one step on fake tensors.

    python scripts/estimate_memory.py --config recipes/dsv3_16b_mxfp8.yaml --world 8
    python scripts/estimate_memory.py --config recipes/dsv3_16b_hif8.yaml --world 16 --json out.json --hbm-gb 144   # an Ascend 950DT
    python scripts/estimate_memory.py --config recipes/dsv3_tiny_mxfp8.yaml --world 2 --micro 1 training.seq_len=128
    python scripts/estimate_memory.py --config recipes/dsv3_16b_mxfp8.yaml --world 32 --replicate 4   # HSDP 8 x 4

Runs here, on the CPU, allocating nothing (``te_npu.training.capacity``: FakeTensorMode and
torch's fake process group, rank 0 of ``--world``; ``--replicate R``: HSDP, R replicas of
``--world / R``-rank shard groups, the 2-D mesh the job builds, so the all-reduce across replicas
is counted too; both default to the recipe's ``fsdp_config`` keys): the config checks, the shard plan, FSDP2
on meta, the local shards, masters and moments, the initial values, ``--micro`` micro-batches
(default: the recipe's accumulation) and one optimizer step. Prints bytes per stage and per
category and a fit verdict against ``--hbm-gb`` (default: the NPU's total memory on an NPU, else the
spec's Q3 card, an Ascend A5 with 96 GiB).
``--measure`` runs the same on real CPU tensors and prints each stage's measured peak RSS next
to the estimate (small models only: it allocates rank 0's shards for real).
Exit code: 0 fits, 1 does not fit, 2 configuration error (one line).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.deepseek_v3.model_section import DeepseekV3ModelSection  # noqa: E402
from models.deepseek_v3.pretrain import DeepseekV3Task  # noqa: E402
from te_npu.errors import ConfigError  # noqa: E402
from te_npu.training.capacity import (  # noqa: E402
    A5_Q3_HBM_BYTES, ASCEND_950DT_HBM_GB, default_hbm_bytes, estimate, estimation_overrides)
from te_npu.training.config import load_config  # noqa: E402


def hbm_verdict_bytes(hbm_gb: float | None) -> tuple[int, str]:
    """The HBM the verdict is judged against, and where it came from: ``--hbm-gb`` when given,
    else this NPU's total memory, else the spec's A5 (96 GiB per card)."""
    if hbm_gb is not None:
        return int(hbm_gb * 10**9), "--hbm-gb"
    return default_hbm_bytes()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML recipe, e.g. recipes/dsv3_16b_mxfp8.yaml")
    parser.add_argument("--world", type=int, default=None,
                        help="ranks to plan for (default: the recipe's dp_shard_size x dp_replicate_size)")
    parser.add_argument("--replicate", type=int, default=None,
                        help="HSDP replicas (fsdp_config.dp_replicate_size; default: the recipe's); each "
                             "parameter is sharded over --world / --replicate ranks")
    parser.add_argument("--micro", type=int, default=None,
                        help="micro-batches to run (default: the recipe's accumulation; 2 already give its step peak: "
                             "the second runs with every gradient held, as all later ones do)")
    parser.add_argument("--hbm-gb", type=float, default=None,
                        help="HBM per device in GB (10**9 bytes; default: this NPU's total memory on an NPU, else the "
                             f"spec's Ascend A5, 96 GiB = {A5_Q3_HBM_BYTES / 1e9:.2f} GB; an Ascend 950DT: "
                             f"{ASCEND_950DT_HBM_GB})")
    parser.add_argument("--json", default=None, help="also write the report as JSON here")
    parser.add_argument("--measure", action="store_true",
                        help="run on real CPU tensors instead and read each stage's peak RSS (Linux): checks the estimate")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. training.seq_len=2048")
    args = parser.parse_args(argv)
    hbm_bytes, hbm_source = hbm_verdict_bytes(args.hbm_gb)
    print(f"HBM per device: {hbm_bytes / 2**30:.1f} GiB, from {hbm_source}")
    with tempfile.TemporaryDirectory(prefix="te_npu_estimate_") as workdir:
        try:
            recipe = load_config(args.config, args.overrides, model_section=DeepseekV3ModelSection).fsdp_config
            replicate = args.replicate or recipe.dp_replicate_size
            world = args.world or recipe.dp_shard_size * replicate
            cfg = load_config(args.config, [*args.overrides, *estimation_overrides(world, workdir, replicate)],
                              model_section=DeepseekV3ModelSection)
            report = estimate(cfg, DeepseekV3Task(), world_size=world, micro_batches=args.micro,
                              hbm_bytes=hbm_bytes, config_name=args.config, measure=args.measure)
        except ConfigError as exc:
            print(f"ConfigError: {exc}", file=sys.stderr)
            return 2
    print(report.render())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.as_dict(), f, indent=2)
            f.write("\n")
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
