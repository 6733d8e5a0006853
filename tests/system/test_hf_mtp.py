"""Hugging Face configs that ask for MTP layers (issues 28, 37): transformers' ``DeepseekV3Config``
defaults ``num_nextn_predict_layers`` to 1, as DeepSeek-V3's own config.json has it, but its
``save_pretrained`` writes no MTP tensors. A run whose model has the MTP layer refuses such a
checkpoint, naming the missing tensors; with ``model.overrides.num_nextn_predict_layers=0`` it
loads the main model and trains, one line saying which MTP tensors were left out and that MTP
is not trained; an export writes the model's own field (0: it holds no MTP tensors). Single
process (the 2-rank HF paths: test_hf_in_out.py; MTP tensors loaded: tests/model/test_deepseek_v3_mtp.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from models.deepseek_v3.config import to_hf_config_dict
from models.deepseek_v3.pretrain import model_config
from te_npu.errors import ConfigError
from tests.system import harness as H

transformers = pytest.importorskip("transformers", reason="the checkpoint is written by transformers")

STEPS = 2


def _cfg(workdir, data_dir, hf_dir, *extra):
    return H.st_config("bf16", workdir, data_dir, "training.param_dtype=fp32", f"training.train_steps={STEPS}",
                       "fsdp_config.dp_shard_size=1", "model.preset=null", f"model.hf_config={hf_dir}",
                       f"checkpoint.initial_load_path={hf_dir}", *extra)


@pytest.fixture(scope="module")
def transformers_dir(tmp_path_factory, st_data_dir):
    """``save_pretrained`` of a transformers DeepseekV3ForCausalLM of the test shape whose config
    leaves ``num_nextn_predict_layers`` at transformers' default."""
    work = tmp_path_factory.mktemp("hf_mtp")
    tiny = model_config(H.st_config("bf16", work, st_data_dir))
    fields = {k: v for k, v in to_hf_config_dict(tiny).items()
              if k not in ("architectures", "model_type", "dtype", "num_nextn_predict_layers")}
    config = transformers.DeepseekV3Config(**fields)
    assert config.num_nextn_predict_layers == 1  # transformers' default
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        transformers.DeepseekV3ForCausalLM(config).save_pretrained(work / "hf")
    assert json.loads((work / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    return work / "hf", tiny.num_hidden_layers


def _copy_with_mtp_tensors(source: Path, target: Path, layer: int) -> Path:
    """``source`` plus tensors of DeepSeek-V3's MTP layer ``layer`` (its ``eh_proj``, norms and a
    projection of its decoder block), as a release's checkpoint holds them."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    hidden = tensors["model.norm.weight"].shape[0]
    extra = {f"model.layers.{layer}.eh_proj.weight": torch.zeros(hidden, 2 * hidden),
             f"model.layers.{layer}.enorm.weight": torch.ones(hidden),
             f"model.layers.{layer}.hnorm.weight": torch.ones(hidden),
             f"model.layers.{layer}.self_attn.o_proj.weight": torch.zeros(hidden, hidden)}
    save_file({**tensors, **extra}, target / "model.safetensors", metadata={"format": "pt"})
    return target


def _train(cfg) -> tuple[list[str], list[float]]:
    lines: list[str] = []
    trainer, _ = H._trainer(cfg, lines)
    try:
        trainer.setup(cfg)
        losses = [float(trainer.train_step().lm_loss) for _ in range(STEPS)]
        trainer.save_hf()
    finally:
        trainer.close()
    return lines, losses


def _notes(lines):
    return [line for line in lines if "num_nextn_predict_layers" in line]


def test_transformers_config_with_default_mtp_is_refused_by_a_model_with_the_mtp_layer(transformers_dir, tmp_path,
                                                                                     st_data_dir):
    hf_dir, layers = transformers_dir
    cfg = _cfg(tmp_path, st_data_dir, hf_dir)
    assert model_config(cfg).num_nextn_predict_layers == 1
    trainer, _ = H._trainer(cfg, [])
    try:
        with pytest.raises(ConfigError, match=rf"missing keys: \[model\.layers\.{layers}\.self_attn") as refused:
            trainer.setup(cfg)
        assert str(refused.value).endswith("model.overrides.num_nextn_predict_layers=0 trains without MTP "
                                           "(transformers' DeepseekV3ForCausalLM writes no MTP tensors although its "
                                           "config.json says 1)")
        assert "\n" not in str(refused.value)
    finally:
        trainer.close()


def test_mtp_override_zero_loads_the_main_model_and_says_what_is_left_out(transformers_dir, tmp_path, st_data_dir):
    """``model.overrides.num_nextn_predict_layers=0``: the model has no MTP layers, the checkpoint's
    config.json (which says 1) is not held against it, one line says MTP is not trained; the
    export says 0 (its tensors)."""
    hf_dir, layers = transformers_dir
    cfg = _cfg(tmp_path, st_data_dir, hf_dir, "model.overrides.num_nextn_predict_layers=0")
    assert model_config(cfg).num_nextn_predict_layers == 0
    lines, losses = _train(cfg)
    assert all(math.isfinite(v) for v in losses), losses
    notes = _notes(lines)
    assert len(notes) == 1 and "\n" not in notes[0], lines
    assert f"model.layers.{layers}.*" in notes[0] and "MTP is not trained" in notes[0]
    assert "the checkpoint holds none of them" in notes[0]
    export = json.loads((tmp_path / "ckpt" / "hf" / f"step_{STEPS}" / "config.json").read_text())
    assert export["num_nextn_predict_layers"] == 0


@pytest.mark.slow  # the note's wording and the key plan: tests/distributed/test_hf_layout.py (fast)
def test_mtp_tensors_of_a_release_are_left_out_and_named(transformers_dir, tmp_path, st_data_dir):
    hf_dir, layers = transformers_dir
    with_mtp = _copy_with_mtp_tensors(hf_dir, tmp_path / "with_mtp", layers)
    lines, losses = _train(_cfg(tmp_path / "run", st_data_dir, with_mtp, "model.overrides.num_nextn_predict_layers=0"))
    assert all(math.isfinite(v) for v in losses), losses
    [note] = _notes(lines)
    assert f"left out 4 tensor(s): model.layers.{layers}.* (4)" in note and "MTP is not trained" in note, note
