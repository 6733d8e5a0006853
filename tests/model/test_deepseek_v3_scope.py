"""The low-precision scope is exactly the explicit FQN list (spec 1.1 / Q3-04)."""
import pytest
import torch

from models.deepseek_v3 import (DSV3_16B, DSV3_TINY, DeepseekV3ForCausalLM, expected_low_precision_scope,
                                low_precision_scope)


@pytest.mark.parametrize("config", [DSV3_TINY, DSV3_TINY.replace(q_lora_rank=64), DSV3_16B],
                         ids=["tiny", "tiny_q_lora", "16b"])
def test_deepseek_v3_low_precision_scope_equals_explicit_list(config):
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    assert low_precision_scope(model) == expected_low_precision_scope(config)


def test_deepseek_v3_low_precision_scope_explicit_names():
    scope = set(expected_low_precision_scope(DSV3_TINY))
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj", "model.layers.1.mlp.experts",
            "model.layers.1.mlp.shared_experts.down_proj", "model.layers.3.self_attn.kv_b_proj"} <= scope
    high_precision = ["model.embed_tokens", "lm_head", "model.layers.1.mlp.gate", "model.norm",
                      "model.layers.0.self_attn.kv_a_layernorm", "model.layers.0.input_layernorm"]
    assert scope.isdisjoint(high_precision)
    assert len(scope) == 4 * 4 + 3 + 3 * 4  # 4 MLA projections per layer; dense MLP; experts + 3 shared per MoE layer
