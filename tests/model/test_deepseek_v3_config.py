"""DeepseekV3Config: HF config.json reading, overrides and unsupported-field errors; the training
config's ``model`` section (``models.deepseek_v3.model_section``)."""
import json
from pathlib import Path

import pytest

import te_npu
from models.deepseek_v3 import DSV3_16B, DSV3_TINY, from_hf_config
from models.deepseek_v3.config import to_hf_config_dict
from models.deepseek_v3.model_section import HF_DEEPSEEK_V3_FIELDS
from models.deepseek_v3.pretrain import DeepseekV3Task, model_config
from te_npu.training.config import load_config


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
    ("num_nextn_predict_layers", -1), ("num_mtp_layers", -1), ("tie_word_embeddings", True), ("ep_size", 8),
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


# ---- the `model` section of a training config (DeepseekV3Task.model_section) --------------------

TINY_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "dsv3_tiny_mxfp8.yaml"


def _load(*overrides):
    return load_config(TINY_RECIPE, list(overrides), model_section=DeepseekV3Task.model_section)


def test_model_section_hf_override_fields_exist_in_transformers():
    transformers = pytest.importorskip("transformers", reason="cross-check needs transformers")
    import inspect

    hf_cls = transformers.DeepseekV3Config
    known = set(inspect.signature(hf_cls.__init__).parameters) | set(hf_cls().to_dict())
    legacy = {"rope_theta", "rope_scaling", "num_nextn_predict_layers"}
    assert HF_DEEPSEEK_V3_FIELDS - legacy <= known


@pytest.mark.parametrize(("override", "match"), [
    ("model.overrides.num_nextn_predict_layers=-1", r"model \(model\.preset 'dsv3_tiny' \+ model\.overrides\): "
                                                    r"DeepseekV3Config\.num_nextn_predict_layers=-1: must be"),
    ("model.overrides.tie_word_embeddings=true", r"DeepseekV3Config\.tie_word_embeddings=True"),
    ("model.overrides.hidden_act=gelu", r"DeepseekV3Config\.hidden_act='gelu'"),
    ("model.overrides.n_group=3", r"DeepseekV3Config\.n_group=3: must divide n_routed_experts=8"),
], ids=["mtp", "tied", "gelu", "n_group"])
def test_model_section_unsupported_model_fails_at_load(override, match):
    """What the model code would refuse at build time is refused when the config loads."""
    with pytest.raises(te_npu.ConfigError, match=match) as info:
        _load(override)
    assert "\n" not in str(info.value)


def test_model_section_unreadable_hf_config_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(te_npu.ConfigError, match=r"model\.hf_config: cannot read .*"):
        _load("model.preset=null", f"model.hf_config={tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(te_npu.ConfigError, match=r"model \(model\.hf_config .*\): DeepseekV3Config\.model_type"):
        _load("model.preset=null", f"model.hf_config={tmp_path}")


def test_model_section_resolves_to_the_model_config():
    cfg = _load("model.overrides={num_hidden_layers: 2, vocab_size: 512}")
    assert model_config(cfg) == DSV3_TINY.replace(num_hidden_layers=2, vocab_size=512)
    assert cfg.model.validate_16b is False and cfg.model.model_config() == model_config(cfg)
    # a config loaded without the section: the task applies it on first use
    assert model_config(load_config(TINY_RECIPE)) == DSV3_TINY


def test_hf_config_dict_writes_every_field_of_transformers_deepseek_v3_config():
    """An export without a source config.json (the converter's dcp-to-hf) writes every field
    transformers' DeepseekV3Config defines: the model's values, transformers' defaults for the rest."""
    transformers = pytest.importorskip("transformers", reason="the field list is transformers'")
    own = set(transformers.DeepseekV3Config().to_dict()) - set(transformers.PreTrainedConfig().to_dict())
    ours = to_hf_config_dict(DSV3_TINY)
    assert own | {"architectures", "model_type", "dtype", "transformers_version"} == set(ours), (
        sorted(own - set(ours)), sorted(set(ours) - own))
    fields = {k: v for k, v in ours.items() if k not in ("architectures", "model_type", "dtype")}
    theirs = transformers.DeepseekV3Config(**fields)
    for key in ("qk_head_dim", "head_dim", "num_nextn_predict_layers", "hidden_size", "q_lora_rank"):
        assert getattr(theirs, key) == ours[key], key
    defaults = transformers.DeepseekV3Config()
    for key in ("use_cache", "output_router_logits", "pretraining_tp"):  # not carried: transformers' default
        assert ours[key] == getattr(defaults, key), key
    assert from_hf_config(ours) == DSV3_TINY


def test_config_reads_mtp_layers_under_both_hf_names():
    """transformers' default (and DeepSeek-V3's release value) num_nextn_predict_layers=1 loads."""
    config = from_hf_config(to_hf_config_dict(DSV3_TINY), overrides={"num_mtp_layers": 2})
    assert config.num_nextn_predict_layers == 2 and to_hf_config_dict(config)["num_nextn_predict_layers"] == 2
