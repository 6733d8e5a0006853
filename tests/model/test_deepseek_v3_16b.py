"""The frozen 16B spec: meta build, validation and its failure messages."""
import time

import pytest
import torch

import te_npu
from models.deepseek_v3 import DSV3_16B, DSV3_16B_NUM_PARAMS, DeepseekV3ForCausalLM, validate_16b
from models.deepseek_v3.config import DSV3_16B_MTP_LAYER_PARAMS


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


def test_deepseek_v3_16b_with_one_mtp_layer_validates_with_its_parameter_count():
    """D = 1: the spec plus one MTP layer, counted from the shapes here (not from the model):
    a MoE decoder layer of the 16B plus eh_proj [D, 2D] and three norms [D]."""
    D, E, F, Fs, N = 2048, 64, 1408, 2 * 1408, 16
    attention = N * 128 * D + (3072 + 64) * D + 3072 + N * (64 + 128) * 3072 + D * N * 128
    moe = E * D + E * 2 * F * D + E * D * F + 3 * Fs * D
    mtp_layer = attention + moe + 2 * D + D * 2 * D + 3 * D
    assert DSV3_16B_MTP_LAYER_PARAMS == mtp_layer
    model = _meta_model(DSV3_16B.replace(num_nextn_predict_layers=1))
    validate_16b(model)
    assert sum(p.numel() for p in model.parameters()) == DSV3_16B_NUM_PARAMS + mtp_layer
    assert model.model.layers[28].mlp.gate.weight.dtype == torch.float32  # the MTP router stays FP32 too
    del model.model.layers[28].eh_proj
    with pytest.raises(te_npu.ConfigError, match=r"model\.layers\.28\.eh_proj\.weight"):
        validate_16b(model)
