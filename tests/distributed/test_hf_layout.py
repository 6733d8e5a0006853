"""HF key planning (``te_npu.distributed.storage.hf_layout``): both expert layouts, every misfit listed, file packing."""
from __future__ import annotations

import pytest
import torch

from models.deepseek_v3.hf_mapping import HF_KEY_MAP
from te_npu.distributed.storage.hf_checkpoint import _local_piece
from te_npu.distributed.storage.hf_layout import HFStoredTensor, plan_hf_read, plan_hf_write
from te_npu.errors import ConfigError

E, F, D = 4, 8, 16
SHAPES = {
    "model.norm.weight": (D,),
    "model.layers.1.mlp.experts.gate_up_proj": (E, 2 * F, D),
    "model.layers.1.mlp.experts.down_proj": (E, D, F),
    "model.layers.1.mlp.gate.weight": (E, D),
}


def _stored(shapes, dtype=torch.bfloat16):
    return {k: HFStoredTensor(tuple(s), dtype) for k, s in shapes.items()}


def _per_expert(drop=()):
    keys = {"model.norm.weight": (D,), "model.layers.1.mlp.gate.weight": (E, D)}
    for e in range(E):
        prefix = f"model.layers.1.mlp.experts.{e}"
        keys.update({f"{prefix}.gate_proj.weight": (F, D), f"{prefix}.up_proj.weight": (F, D),
                     f"{prefix}.down_proj.weight": (D, F)})
    return {k: v for k, v in keys.items() if k not in drop}


def test_hf_layout_reads_stacked_experts_under_their_own_names():
    plan = plan_hf_read(SHAPES, _stored(SHAPES), HF_KEY_MAP, where="t")
    assert all(pieces is None for pieces in plan.values())


def test_hf_layout_reads_per_expert_keys_as_row_ranges_of_the_stack():
    plan = plan_hf_read(SHAPES, _stored(_per_expert()), HF_KEY_MAP, where="t")
    gate_up = plan["model.layers.1.mlp.experts.gate_up_proj"]
    assert [(p.key, p.expert, p.rows) for p in gate_up[2:4]] == [
        ("model.layers.1.mlp.experts.1.gate_proj.weight", 1, (0, F)),
        ("model.layers.1.mlp.experts.1.up_proj.weight", 1, (F, 2 * F)),
    ]
    assert {p.shape for p in plan["model.layers.1.mlp.experts.down_proj"]} == {(D, F)}
    assert plan["model.norm.weight"] is None


def test_hf_layout_lists_every_misfit_in_one_error():
    stored = _stored(_per_expert(drop=["model.layers.1.mlp.experts.2.up_proj.weight"]))
    stored["model.norm.weight"] = HFStoredTensor((D + 1,), torch.bfloat16)
    stored["model.layers.1.mlp.gate.weight"] = HFStoredTensor((E, D), torch.float8_e4m3fn)
    stored["model.layers.1.mlp.gate.weight_scale_inv"] = HFStoredTensor((1,), torch.float32)
    with pytest.raises(ConfigError) as info:
        plan_hf_read(SHAPES, stored, HF_KEY_MAP, where="checkpoint.initial_load_path")
    message = str(info.value)
    assert message.startswith("checkpoint.initial_load_path: the checkpoint does not match the model")
    assert "1 missing keys: [model.layers.1.mlp.experts.2.up_proj.weight]" in message
    assert "1 unexpected keys: [model.layers.1.mlp.gate.weight_scale_inv]" in message
    assert f"model.norm.weight: checkpoint [{D + 1}], model [{D}]" in message
    assert "model.layers.1.mlp.gate.weight: torch.float8_e4m3fn" in message


def test_hf_layout_absent_stack_names_both_layouts():
    stored = _stored({k: v for k, v in SHAPES.items() if "down_proj" not in k})
    with pytest.raises(ConfigError, match=r"experts\.down_proj \(or per expert: model\.layers\.1\.mlp\.experts\.0\."):
        plan_hf_read(SHAPES, stored, HF_KEY_MAP, where="t")


def test_hf_layout_write_packs_files_in_order_and_keeps_the_router_fp32():
    entries = plan_hf_write(SHAPES, HF_KEY_MAP, dtype=torch.bfloat16, max_shard_bytes=3 * F * D * 2)
    assert len(entries) == 2 + 3 * E
    assert [e.file_index for e in entries] == sorted(e.file_index for e in entries)
    by_file = {}
    for e in entries:
        by_file[e.file_index] = by_file.get(e.file_index, 0) + torch.Size(e.shape).numel() * e.dtype.itemsize
    assert max(by_file.values()) <= 3 * F * D * 2 and len(by_file) > 1
    dtypes = {e.key: e.dtype for e in entries}
    assert dtypes["model.layers.1.mlp.gate.weight"] == torch.float32
    assert dtypes["model.layers.1.mlp.experts.0.gate_proj.weight"] == torch.bfloat16
    stacked = plan_hf_write(SHAPES, HF_KEY_MAP, dtype=torch.bfloat16, max_shard_bytes=2**30, per_expert=False)
    assert [e.key for e in stacked] == list(SHAPES)


def test_hf_layout_shard_that_splits_an_expert_is_refused():
    piece = HF_KEY_MAP.pieces("model.layers.1.mlp.experts.gate_up_proj", (E, 2 * F, D))[0]
    local = torch.zeros(E, F // 2, D)  # a (hypothetical) shard holding half the gate rows of each expert
    with pytest.raises(ConfigError, match="splits it; per-expert keys need whole experts"):
        _local_piece(local, (0, 0, 0), (E, 2 * F, D), piece, "t")
    assert _local_piece(torch.zeros(E // 2, 2 * F, D), (E // 2, 0, 0), (E, 2 * F, D), piece, "t") is None


def test_hf_layout_16b_save_pretrained_keys_fit_the_16b_model():
    """The 16B recipe's path: a per-expert (``save_pretrained``) 16B checkpoint's keys and shapes
    match the model built on meta, and its config.json passes the adapter (no data involved)."""
    from models.deepseek_v3 import DSV3_16B, DeepseekV3ForCausalLM
    from models.deepseek_v3.config import to_hf_config_dict
    from models.deepseek_v3.hf_mapping import DeepseekV3HFAdapter, to_hf_state_dict

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(DSV3_16B, dtype=torch.bfloat16)
    state = model.state_dict()
    per_expert = to_hf_state_dict(state, per_expert=True)
    on_disk = {k: HFStoredTensor(tuple(t.shape), torch.bfloat16) for k, t in per_expert.items()}
    assert sum(k.endswith("experts.63.down_proj.weight") for k in on_disk) == DSV3_16B.num_hidden_layers - 1
    plan = plan_hf_read({k: tuple(t.shape) for k, t in state.items()}, on_disk, HF_KEY_MAP, where="16b")
    assert sum(p is not None for p in plan.values()) == 2 * (DSV3_16B.num_hidden_layers - 1)
    DeepseekV3HFAdapter(DSV3_16B).check_config({**to_hf_config_dict(DSV3_16B), "max_position_embeddings": 163840})
    with pytest.raises(ConfigError, match=r"kv_lora_rank = 512 \(the model has 3072\)"):
        DeepseekV3HFAdapter(DSV3_16B).check_config({**to_hf_config_dict(DSV3_16B), "kv_lora_rank": 512})


def test_mtp_layers_of_the_checkpoint_are_left_out_by_a_model_without_them_in_one_line():
    """A model with num_nextn_predict_layers = 0 reading a checkpoint whose config.json declares 1:
    DeepSeek-V3's MTP layer (``model.layers.{num_hidden_layers}.*``) is skipped instead of refused
    as unexpected; the note names it and says MTP is not trained. Without the declaration the
    tensors are unexpected."""
    from models.deepseek_v3.config import DSV3_TINY
    from models.deepseek_v3.hf_mapping import mtp_key_map
    from te_npu.distributed.storage.hf_layout import left_out_note

    config = DSV3_TINY.replace(num_hidden_layers=2)
    key_map = mtp_key_map(config, checkpoint_mtp_layers=1)
    mtp = {"model.layers.2.eh_proj.weight": (D, 2 * D), "model.layers.2.enorm.weight": (D,)}
    stored = _stored({**_per_expert(), **mtp, "model.layers.3.enorm.weight": (D,)})
    with pytest.raises(ConfigError, match=r"1 unexpected keys: \[model\.layers\.3\.enorm\.weight\]"):
        plan_hf_read(SHAPES, stored, key_map, where="x")  # only the declared MTP layer is left out
    stored.pop("model.layers.3.enorm.weight")
    plan_hf_read(SHAPES, stored, key_map, where="x")
    note = left_out_note(stored, key_map, where="ckpt")
    assert note == ("ckpt: num_nextn_predict_layers=1 in the checkpoint, 0 in the model: the MTP layer tensors "
                    "(model.layers.2.*) are not read, MTP is not trained (the main model is); left out 2 tensor(s): "
                    "model.layers.2.* (2)")
    assert left_out_note(_stored(_per_expert()), key_map, where="ckpt").endswith("the checkpoint holds none of them")
    assert left_out_note(stored, mtp_key_map(config), where="ckpt") is None  # no MTP layers: nothing said
    with pytest.raises(ConfigError, match="2 unexpected keys"):
        plan_hf_read(SHAPES, stored, mtp_key_map(config), where="x")


def test_mtp_copies_of_embedding_and_head_are_written_back_and_read_as_the_shared_ones():
    """A model with an MTP layer: DeepSeek's ``model.layers.{n}.embed_tokens`` / ``shared_head.head``
    are copies; an export writes the shared tensors under them too (right after the source), a
    read takes the shared ones and says so in one line; a checkpoint without them still fits."""
    from models.deepseek_v3.config import DSV3_TINY
    from models.deepseek_v3.hf_mapping import mtp_key_map
    from te_npu.distributed.storage.hf_layout import left_out_note

    key_map = mtp_key_map(DSV3_TINY.replace(num_hidden_layers=2, num_nextn_predict_layers=1))
    shapes = {"model.embed_tokens.weight": (32, D), "model.layers.2.enorm.weight": (D,), "lm_head.weight": (32, D)}
    entries = plan_hf_write(shapes, key_map, dtype=torch.bfloat16, max_shard_bytes=2**30)
    assert [(e.key, e.fqn) for e in entries] == [
        ("model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("model.layers.2.embed_tokens.weight", "model.embed_tokens.weight"),
        ("model.layers.2.enorm.weight", "model.layers.2.enorm.weight"),
        ("lm_head.weight", "lm_head.weight"), ("model.layers.2.shared_head.head.weight", "lm_head.weight")]
    stored = _stored({e.key: e.shape for e in entries})
    assert all(p is None for p in plan_hf_read(shapes, stored, key_map, where="x").values())
    note = left_out_note(stored, key_map, where="ckpt")
    assert note.startswith("ckpt: num_nextn_predict_layers=1: the MTP layers' embed_tokens / shared_head.head are "
                           "DeepSeek's copies") and note.endswith("(2 stored)") and "left out" not in note
    without = {k: v for k, v in stored.items() if "layers.2.embed" not in k and "shared_head.head" not in k}
    plan_hf_read(shapes, without, key_map, where="x")
    assert left_out_note(without, key_map, where="ckpt") is None
