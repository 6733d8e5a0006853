"""Ours versus transformers' DeepseekV3ForCausalLM: logits, loss, gradients, checkpoints (CPU, fp32)."""
import pytest
import torch

import te_npu
from models.deepseek_v3 import DeepseekV3ForCausalLM, from_hf_state_dict, load_hf_checkpoint, save_hf_checkpoint
from models.deepseek_v3.hf_mapping import load_state_dict_strict_, to_hf_state_dict
from tests.model.conftest import hf_model_for, parity_config

pytest.importorskip("transformers", reason="parity needs transformers")

Q_LORA = pytest.mark.parametrize("q_lora_rank", [None, 64], ids=["q_proj", "q_lora"])


def _batch(gen, vocab):
    ids = torch.randint(0, vocab, (2, 24), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100
    return ids, labels


def _ours_from_hf(hf, config):
    ours = DeepseekV3ForCausalLM(config, seed=1)
    load_state_dict_strict_(ours, from_hf_state_dict(hf.state_dict()))
    return ours


@Q_LORA
def test_deepseek_v3_logits_loss_grads_versus_hf(gen, q_lora_rank):
    config = parity_config(q_lora_rank)
    hf = hf_model_for(config, seed=0)
    assert hf.config._experts_implementation == "grouped_mm"  # HF's default experts path on this torch
    ours = _ours_from_hf(hf, config)
    ids, labels = _batch(gen, config.vocab_size)

    hf_out, our_out = hf(input_ids=ids, labels=labels), ours(ids, labels=labels)
    assert (our_out.logits - hf_out.logits).abs().max().item() <= 1e-5
    torch.testing.assert_close(our_out.loss, hf_out.loss, rtol=1e-6, atol=1e-6)

    hf_out.loss.backward()
    our_out.loss.backward()
    hf_params = dict(hf.named_parameters())
    assert set(hf_params) == {n for n, _ in ours.named_parameters()}
    for name, p in ours.named_parameters():
        ref = hf_params[name].grad
        assert p.grad is not None and ref is not None, name
        rel = (p.grad - ref).norm() / ref.norm().clamp_min(1e-30)
        assert rel.item() <= 1e-5, f"{name}: relative grad error {rel.item():.2e}"


@Q_LORA
def test_deepseek_v3_export_loads_into_hf(gen, tmp_path, q_lora_rank):
    """HF -> ours -> save_hf_checkpoint -> HF from_pretrained: bit-identical HF logits, and
    within parity tolerance of ours."""
    from transformers import DeepseekV3ForCausalLM as HFModel

    config = parity_config(q_lora_rank)
    hf = hf_model_for(config, seed=3)
    ours = _ours_from_hf(hf, config)
    save_hf_checkpoint(ours, tmp_path, max_shard_bytes=2**20)  # force a sharded checkpoint
    assert (tmp_path / "model.safetensors.index.json").exists()
    reloaded, info = HFModel.from_pretrained(tmp_path, output_loading_info=True, attn_implementation="sdpa")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids, _ = _batch(gen, config.vocab_size)
    with torch.no_grad():
        reloaded_logits = reloaded(input_ids=ids).logits
        assert torch.equal(reloaded_logits, hf(input_ids=ids).logits)
        assert (reloaded_logits - ours(ids).logits).abs().max().item() <= 1e-5


def test_deepseek_v3_hf_save_pretrained_loads_into_ours(gen, tmp_path):
    config = parity_config(64)
    hf = hf_model_for(config, seed=5)
    hf.save_pretrained(tmp_path)
    ours = DeepseekV3ForCausalLM(config, seed=1)
    load_hf_checkpoint(ours, tmp_path)
    ids, _ = _batch(gen, config.vocab_size)
    with torch.no_grad():
        assert (ours(ids).logits - hf(input_ids=ids).logits).abs().max().item() <= 1e-5


def test_deepseek_v3_state_dict_layouts_round_trip():
    config = parity_config(None)
    state = DeepseekV3ForCausalLM(config, seed=2).state_dict()
    per_expert = to_hf_state_dict(state, per_expert=True)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in per_expert
    assert not any(k.endswith("experts.gate_up_proj") for k in per_expert)
    back = from_hf_state_dict(per_expert)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_deepseek_v3_load_rejects_unknown_and_missing_keys():
    import te_npu

    config = parity_config(None)
    model = DeepseekV3ForCausalLM(config, seed=2)
    state = to_hf_state_dict(model.state_dict(), per_expert=True)
    state["model.layers.1.mlp.extra.weight"] = torch.zeros(1)
    del state["model.layers.2.mlp.experts.3.down_proj.weight"]
    with pytest.raises(te_npu.ConfigError, match=r"experts\.3\.down_proj"):
        load_state_dict_strict_(model, from_hf_state_dict(state))
    state["model.layers.2.mlp.experts.3.down_proj.weight"] = torch.zeros(128, 64)
    del state["model.norm.weight"]
    with pytest.raises(te_npu.ConfigError, match=r"model\.norm\.weight.*mlp\.extra\.weight"):
        load_state_dict_strict_(model, from_hf_state_dict(state))


def test_mtp_state_dict_round_trip_writes_and_skips_the_copies_as_the_checkpoint_does(tmp_path):
    """With one MTP layer the per-expert dict holds DeepSeek's copies of the shared embedding and head
    (the keys and values ``save_hf_checkpoint`` writes); reading it back skips them and round-trips."""
    from safetensors.torch import load_file

    from models.deepseek_v3.hf_mapping import mtp_key_map

    config = parity_config(None).replace(num_nextn_predict_layers=1)
    model = DeepseekV3ForCausalLM(config, seed=3)
    state = model.state_dict()
    key_map = mtp_key_map(config)
    per_expert = to_hf_state_dict(state, per_expert=True, key_map=key_map)
    assert torch.equal(per_expert["model.layers.3.embed_tokens.weight"], state["model.embed_tokens.weight"])
    assert torch.equal(per_expert["model.layers.3.shared_head.head.weight"], state["lm_head.weight"])
    save_hf_checkpoint(model, tmp_path, dtype=torch.float32)
    on_disk = {k: v for f in sorted(tmp_path.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert on_disk.keys() == per_expert.keys()
    assert all(torch.equal(on_disk[k], per_expert[k]) for k in on_disk)
    back = from_hf_state_dict(per_expert, key_map=key_map)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(te_npu.ConfigError, match=r"unexpected keys.*layers\.3\.embed_tokens"):
        load_state_dict_strict_(model, from_hf_state_dict(per_expert))  # without the map the copies are extra
