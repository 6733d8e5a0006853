#!/usr/bin/env bash
# The acceptance matrix (Q3-01..Q3-11, docs/a5.md, acceptance matrix) in one command; see scripts/q3_acceptance.py.
#
#   bash scripts/q3_acceptance.sh                          # CPU: tiny recipes, 2 gloo ranks per job, runs/q3_acceptance
#   NPROC=8 bash scripts/q3_acceptance.sh --out runs/q3_a5 data.path=/data/pretrain/dsv3_corpus   # 8x Ascend A5
#   bash scripts/q3_acceptance.sh --cases Q3-02 Q3-09 --steps 20
#
# Each job's ranks are started with torchrun (te_npu.training.launch) by the script itself; on an
# NPU the 16B recipes are the default. Writes <out>/report.md, report.json, environment.json,
# curves_*.png and jobs/<job>/<phase>/rank<r>.json. A re-run with the same --out skips finished
# cases. Exit code: 0 no case failed, 1 some case failed, 2 bad arguments.
set -euo pipefail
cd "$(dirname "$0")/.."

ARGS=()
if [ -n "${NPROC:-}" ]; then
  ARGS+=(--nproc "$NPROC")
fi
exec python3 scripts/q3_acceptance.py "${ARGS[@]}" "$@"
