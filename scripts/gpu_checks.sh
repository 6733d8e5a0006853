#!/usr/bin/env bash
# One prepared run of every GPU check (for a lent CUDA machine; the product never needs one):
# CUDA ops and kernel tests (tests/unit/ops, kernels included), then the quantization / linear / MoE benchmarks, eager and torch.compile'd
# quantization side by side. About 5-8 minutes on one H200 (first compiles included).
#   bash scripts/gpu_checks.sh [outdir]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-runs/gpu_checks}}"
mkdir -p "$out"
export PYTHONPATH=.
run() { echo "== $*" | tee -a "$out/summary.txt"; "$@" 2>&1 | tee "$out/$(echo "$*" | tr -c 'a-zA-Z0-9' '_' | cut -c1-80).log" | tail -25 >> "$out/summary.txt"; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/summary.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/summary.txt"
run python -m pytest -q tests/unit/ops tests/unit/functional/test_no_host_syncs.py -k "cuda" -m "slow or not slow"
run python scripts/bench_quant.py --device cuda --modes eager,compile
run python scripts/bench_linear.py --device cuda --tokens 4096 --baselines BF16 --quant-kernel eager
run python scripts/bench_linear.py --device cuda --tokens 4096 --baselines BF16 --quant-kernel compiled
run python scripts/bench_moe.py --device cuda --tokens 8192 --dtype bfloat16
cat "$out/summary.txt"
