"""DeepSeek-V3 built from te_npu modules, HF-compatible names and checkpoints."""
from models.deepseek_v3.config import (
    DSV3_16B,
    DSV3_16B_NUM_PARAMS,
    DSV3_TINY,
    DeepseekV3Config,
    expected_low_precision_scope,
    from_hf_config,
    validate_16b,
)
from models.deepseek_v3.hf_mapping import (
    from_hf_state_dict,
    load_hf_checkpoint,
    save_hf_checkpoint,
    to_hf_state_dict,
)
from models.deepseek_v3.model import CausalLMOutput, DeepseekV3ForCausalLM, low_precision_scope, materialize_

__all__ = [
    "DeepseekV3Config", "from_hf_config", "DSV3_16B", "DSV3_16B_NUM_PARAMS", "DSV3_TINY", "validate_16b",
    "expected_low_precision_scope", "DeepseekV3ForCausalLM", "CausalLMOutput", "materialize_",
    "low_precision_scope", "to_hf_state_dict", "from_hf_state_dict", "load_hf_checkpoint", "save_hf_checkpoint",
]
