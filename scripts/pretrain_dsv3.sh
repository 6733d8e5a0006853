#!/usr/bin/env bash
# Launch DeepSeek-V3 pretraining with torchrun.
#
#   bash scripts/pretrain_dsv3.sh                         # tiny model, 2 CPU ranks, gloo, MXFP8 emulation
#   RECIPE=recipes/dsv3_tiny_hif8.yaml bash scripts/pretrain_dsv3.sh
#   RECIPE=recipes/dsv3_16b_mxfp8.yaml NPROC=8 bash scripts/pretrain_dsv3.sh   # 8x Ascend A5 (hccl)
#
# Past one node (HSDP: README "Past one node: HSDP"), the same command on every node, each with its
# NODE_RANK (0 .. NNODES-1), all naming node 0 as MASTER_ADDR (its launcher hosts the job's store
# on MASTER_PORT) and sharing checkpoint.dir / logging.dir on one filesystem:
#   NNODES=4 NODE_RANK=<k> MASTER_ADDR=<node 0> NPROC=8 RECIPE=recipes/dsv3_16b_mxfp8.yaml \
#     bash scripts/pretrain_dsv3.sh fsdp_config.dp_shard_size=8 fsdp_config.dp_replicate_size=4
#
# Extra arguments are config overrides, e.g. `training.train_steps=50 logging.dir=runs/try`.
# The recipe is read and validated by te_npu only (models/deepseek_v3/pretrain.py); the
# quantization kernel is a config key too (training.quant_kernel: auto | eager | compiled | native,
# default auto = native C++ kernels for CPU recipes when they build; rank 0 prints the choice),
# e.g. `bash scripts/pretrain_dsv3.sh training.quant_kernel=eager`.
# Exit code: the first failing rank's (0 done, 1 error, 2 configuration error, 3 diverged, 4 stalled
# or a node lost, 128 + signal when interrupted), with a one-line summary instead of torchrun's traceback.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python3 -c "import torch, yaml, einops, numpy, matplotlib" 2>/dev/null; then
  # Fresh machine: install the requirements (the CPU build of torch first, so pip does not pull
  # a multi-GB CUDA build). On an A5 machine install torch / torch-npu yourself beforehand.
  echo "pretrain_dsv3.sh: installing requirements: torch==2.13.0, then te_npu (pip install -e .)"
  python3 -m pip install --quiet torch==2.13.0
  python3 -m pip install --quiet -e .
fi

RECIPE="${RECIPE:-recipes/dsv3_tiny_mxfp8.yaml}"
NPROC="${NPROC:-2}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29517}"

# Each local rank gets an equal share of this node's cores (torchrun's own default is 1 thread per
# rank, with a warning); the same on every node, since each node divides its own cores among its
# NPROC ranks. Two "nodes" on one host (the localhost test) each take the whole host's share: set
# OMP_NUM_THREADS yourself there.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}"

exec python3 -m te_npu.training.launch \
  --nproc_per_node "$NPROC" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  -m models.deepseek_v3.pretrain --config "$RECIPE" "$@"
