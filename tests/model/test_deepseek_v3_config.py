"""DeepseekV3Config: HF config.json reading, overrides and unsupported-field errors."""
import json

import pytest

import te_npu
from models.deepseek_v3 import DSV3_16B, DSV3_TINY, from_hf_config
from models.deepseek_v3.config import to_hf_config_dict


def test_config_from_hf_json_round_trip(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config_dict(DSV3_16B)))
    assert from_hf_config(tmp_path) == DSV3_16B
    assert from_hf_config(tmp_path / "config.json", overrides={"num_hidden_layers": 2}).num_hidden_layers == 2


def test_config_reads_legacy_rope_and_original_deepseek_keys():
    raw = {**to_hf_config_dict(DSV3_TINY), "rope_theta": 50000.0, "rope_scaling": None, "scoring_func": "sigmoid",
           "topk_method": "noaux_tc", "ep_size": 1, "moe_layer_freq": 1, "aux_loss_alpha": 0.001}
    raw.pop("rope_parameters")
    assert from_hf_config(raw).rope_theta == 50000.0


def test_config_tiny_dims_are_multiples_of_64():
    c = DSV3_TINY
    dims = [c.hidden_size, c.intermediate_size, c.moe_intermediate_size * c.n_shared_experts, c.moe_intermediate_size,
            c.kv_lora_rank, c.kv_lora_rank + c.qk_rope_head_dim, c.num_attention_heads * c.qk_head_dim,
            c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.num_attention_heads * c.v_head_dim]
    assert all(d % 64 == 0 for d in dims), dims
    assert c.vocab_size >= 256 and c.num_hidden_layers - c.first_k_dense_replace >= 2


@pytest.mark.parametrize("field, value", [
    ("num_nextn_predict_layers", 1), ("num_mtp_layers", 1), ("tie_word_embeddings", True), ("ep_size", 8),
    ("pretraining_tp", 2), ("scoring_func", "softmax"), ("hidden_act", "gelu"), ("rope_interleave", False),
    ("rope_parameters", {"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0}),
    ("rope_scaling", {"type": "yarn", "factor": 40.0}), ("num_key_value_heads", 8), ("quantization_config", {}),
], ids=lambda v: str(v)[:24])
def test_config_unsupported_field_fails_naming_it(field, value):
    name = {"num_mtp_layers": "num_nextn_predict_layers", "rope_parameters": "rope_scaling"}.get(field, field)
    with pytest.raises(te_npu.ConfigError, match=name):
        from_hf_config(to_hf_config_dict(DSV3_TINY), overrides={field: value})


def test_config_unknown_key_fails():
    with pytest.raises(te_npu.ConfigError, match="hidden_sise"):
        from_hf_config(to_hf_config_dict(DSV3_TINY), overrides={"hidden_sise": 64})
