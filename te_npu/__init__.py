"""te_npu: Transformer-Engine-style MXFP8 / HiF8 training for Ascend NPUs (emulated on CPU/CUDA)."""
from te_npu.autocast import (
    autocast,
    fp8_autocast,
    fp8_model_init,
    get_autocast_recipe,
    is_autocast_enabled,
    quantized_model_init,
)
from te_npu.activation_checkpoint import checkpoint, is_recomputing
from te_npu.errors import ConfigError, LowPrecisionUnavailableError
from te_npu.formats import Format, QuantizationRole
from te_npu.modules import TEGroupedLinear, TEGroupedSwiGLUExperts, TELinear, TEModule, assign_fqns
from te_npu import events, functional, moe, recipe
from te_npu.ops import (
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_hif8_available,
    is_mxfp8_available,
    is_nvfp4_available,
)
from te_npu.quantize_weights import quantize_weights_
from te_npu.recipe import HiF8CurrentScalingRecipe, MXFP8BlockRecipe, recipe_from_config
from te_npu import distributed  # TE's te.distributed (te.distributed.checkpoint), FSDP2, checkpoints

__all__ = [
    "autocast",
    "fp8_autocast",
    "quantized_model_init",
    "fp8_model_init",
    "checkpoint",
    "is_recomputing",
    "recipe",
    "events",
    "distributed",
    "is_autocast_enabled",
    "get_autocast_recipe",
    "ConfigError",
    "LowPrecisionUnavailableError",
    "Format",
    "QuantizationRole",
    "MXFP8BlockRecipe",
    "HiF8CurrentScalingRecipe",
    "recipe_from_config",
    "TELinear",
    "TEGroupedLinear",
    "TEGroupedSwiGLUExperts",
    "TEModule",
    "assign_fqns",
    "functional",
    "moe",
    "quantize_weights_",
    "is_mxfp8_available",
    "is_hif8_available",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_nvfp4_available",
    "is_bf16_available",
]
