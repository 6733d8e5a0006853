#!/usr/bin/env python
"""Plot several training runs into one PNG: loss (train + val), grad norm, tokens/s, lr.

    python scripts/plot_runs.py runs/dsv3_tiny_bf16 runs/dsv3_tiny_mxfp8 runs/dsv3_tiny_hif8 --out runs.png

Each argument is a run directory holding ``metrics.jsonl`` (or the jsonl file itself); the
legend names runs by directory name unless ``--labels`` is given.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from te_npu.training.metrics.plots import plot_runs, read_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (or metrics.jsonl files)")
    parser.add_argument("--out", type=Path, default=Path("runs.png"), help="output PNG (default: runs.png)")
    parser.add_argument("--labels", nargs="+", help="legend names, one per run (default: directory names)")
    parser.add_argument("--jsonl-name", default="metrics.jsonl", help="metrics file name inside each run dir")
    parser.add_argument("--smooth", type=float, default=0.0, help="EMA factor in [0, 1) for the train loss")
    parser.add_argument("--title", help="figure title")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        parser.error(f"--labels needs {len(args.runs)} names, got {len(args.labels)}")
    if not 0.0 <= args.smooth < 1.0:
        parser.error("--smooth must be in [0, 1)")
    names = args.labels or [(p.parent if p.is_file() else p).name for p in args.runs]
    runs = [(name, read_run(path, args.jsonl_name)) for name, path in zip(names, args.runs)]
    out = plot_runs(runs, args.out, args.smooth, args.title)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
