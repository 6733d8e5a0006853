"""The low-precision scope is exactly the explicit FQN list (spec 1.1 / Q3-04)."""
import pytest
import torch

from models.deepseek_v3 import (DSV3_16B, DSV3_TINY, DeepseekV3ForCausalLM, expected_low_precision_scope,
                                low_precision_scope)


@pytest.mark.parametrize("config", [DSV3_TINY, DSV3_TINY.replace(q_lora_rank=64), DSV3_16B,
                                    DSV3_TINY.replace(num_nextn_predict_layers=2),
                                    DSV3_16B.replace(num_nextn_predict_layers=1)],
                         ids=["tiny", "tiny_q_lora", "16b", "tiny_mtp2", "16b_mtp1"])
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


def test_deepseek_v3_mtp_layer_gemms_are_8bit_and_its_norms_router_stay_high_precision():
    """The MTP layer (model.layers.4 of the tiny with D = 1): attention, experts, shared experts and
    eh_proj in the scope; enorm, hnorm, shared_head.norm, router and the shared embedding / head not."""
    scope = set(expected_low_precision_scope(DSV3_TINY.replace(num_nextn_predict_layers=1)))
    mtp = "model.layers.4"
    assert {f"{mtp}.self_attn.q_proj", f"{mtp}.self_attn.o_proj", f"{mtp}.mlp.experts",
            f"{mtp}.mlp.shared_experts.up_proj", f"{mtp}.eh_proj"} <= scope
    assert scope.isdisjoint([f"{mtp}.enorm", f"{mtp}.hnorm", f"{mtp}.shared_head.norm", f"{mtp}.mlp.gate",
                             "model.embed_tokens", "lm_head"])
    assert len(scope) == 4 * 4 + 3 + 3 * 4 + (4 + 4 + 1)  # + the MTP layer: 4 MLA, experts + 3 shared, eh_proj
