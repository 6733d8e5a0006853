"""Shared helpers for the DeepSeek-V3 model tests: tiny configs and HF twins."""
import pytest
import torch

from models.deepseek_v3 import DSV3_TINY
from models.deepseek_v3.config import to_hf_config_dict


def parity_config(q_lora_rank):
    """Tiny config with 2 MoE layers and group-limited routing (2 groups, pick 1)."""
    return DSV3_TINY.replace(num_hidden_layers=3, n_group=2, topk_group=1, q_lora_rank=q_lora_rank)


def hf_model_for(config, seed):
    """A random-init transformers DeepseekV3ForCausalLM (fp32, sdpa, default experts impl)
    with a non-zero router correction bias, so selection-only bias use is exercised."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    fields = to_hf_config_dict(config)
    for key in ("architectures", "model_type", "dtype"):
        fields.pop(key)
    # transformers initialises from the global RNG (no generator argument): seed it inside a fork,
    # so the twin is reproducible and no later test inherits the seed
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**fields, attn_implementation="sdpa"))
        with torch.no_grad():
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return model


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20240607)
