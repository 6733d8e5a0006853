"""FSDP2, FP32-master optimizer and DCP checkpoints for models with 8-bit TE weights.

``checkpoint`` is Transformer Engine's ``te.distributed.checkpoint``: the activation checkpoint
(``te_npu.checkpoint``). The DCP checkpoints (model / optimizer on disk) are
``te_npu.distributed.storage.dcp``; everything else on disk (the folder, its lock and
manifests, the metadata reader, disk space, Hugging Face directories) is in
``te_npu.distributed.storage`` too. Here: ``mesh``, ``process_group``, ``fsdp`` (the 8-bit
all-gather extension), ``sharding`` (the shard plan and FSDP2 units) and ``optim`` (the
FP32-master optimizer).

Importing this package installs the FSDP2 all-gather extension on ``MXFP8Tensor`` and
``HiF8Tensor`` (the tensor layer imports nothing from here).
"""
from te_npu.activation_checkpoint import checkpoint  # TE's te.distributed.checkpoint (activation recompute)
from te_npu.distributed import storage
from te_npu.distributed.fsdp import (
    FSDPGatherContext,
    HiF8GatherSchema,
    MXFP8GatherSchema,
    install_fsdp_extension,
)
from te_npu.distributed.optim import (
    MasterWeightOptimizer,
    StepResult,
    finalize_low_precision_weights,
    global_grad_norm,
    refresh_low_precision_weights,
)
from te_npu.distributed.sharding import (
    FSDPUnit,
    ShardPlan,
    layer_units,
    plan_shards,
    shard_model,
    te_module_units,
    validate_parallel_config,
)
from te_npu.tensor import HiF8Tensor, MXFP8Tensor

install_fsdp_extension(MXFP8Tensor, MXFP8GatherSchema())
install_fsdp_extension(HiF8Tensor, HiF8GatherSchema())

__all__ = [
    "checkpoint",
    "storage",
    "FSDPGatherContext",
    "MXFP8GatherSchema",
    "HiF8GatherSchema",
    "install_fsdp_extension",
    "MasterWeightOptimizer",
    "StepResult",
    "finalize_low_precision_weights",
    "global_grad_norm",
    "refresh_low_precision_weights",
    "FSDPUnit",
    "ShardPlan",
    "layer_units",
    "plan_shards",
    "shard_model",
    "te_module_units",
    "validate_parallel_config",
]
