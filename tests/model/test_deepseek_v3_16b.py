"""The frozen 16B spec: meta build, validation and its failure messages."""
import time

import pytest
import torch

import te_npu
from models.deepseek_v3 import DSV3_16B, DSV3_16B_NUM_PARAMS, DeepseekV3ForCausalLM, validate_16b


def _meta_model(config):
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(config, dtype=torch.bfloat16)


def test_deepseek_v3_16b_builds_on_meta_and_validates():
    start = time.perf_counter()
    model = _meta_model(DSV3_16B)
    assert time.perf_counter() - start < 10.0
    assert all(p.is_meta for p in model.parameters())
    validate_16b(model)
    assert sum(p.numel() for p in model.parameters()) == DSV3_16B_NUM_PARAMS == 16_585_005_056
    experts = model.model.layers[1].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (64, 2816, 2048) and tuple(experts.down_proj.shape) == (64, 2048, 1408)
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # router stays FP32


@pytest.mark.parametrize("field, value", [
    ("moe_intermediate_size", 1536), ("num_hidden_layers", 27), ("first_k_dense_replace", 2),
    ("n_routed_experts", 32), ("kv_lora_rank", 512), ("q_lora_rank", 1536), ("vocab_size", 129280),
], ids=lambda v: str(v))
def test_deepseek_v3_16b_changed_field_fails_naming_it(field, value):
    model = _meta_model(DSV3_16B.replace(**{field: value}))
    with pytest.raises(te_npu.ConfigError, match=field):
        validate_16b(model)


def test_deepseek_v3_16b_structural_mismatch_names_parameter():
    model = _meta_model(DSV3_16B)
    with torch.device("meta"):
        model.model.layers[3].self_attn.o_proj = te_npu.TELinear(2048, 1024, params_dtype=torch.bfloat16, bias=False)
    with pytest.raises(te_npu.ConfigError, match=r"model\.layers\.3\.self_attn\.o_proj\.weight"):
        validate_16b(model)
    model = _meta_model(DSV3_16B)
    del model.model.layers[27]
    with pytest.raises(te_npu.ConfigError, match="27 decoder layers"):
        validate_16b(model)
