"""Q3-10 (docs/a5.md, acceptance matrix): every illegal configuration fails before a model is built, naming the key.

Config-only rows go through the production entry (``models.deepseek_v3.pretrain.main`` ->
``load_config``) and through ``Trainer.setup`` with a build-counting task. The misaligned-shard
row needs 2 ranks and lives in ``test_q3_training.py``.
"""
from __future__ import annotations

import pytest
import torch

from models.deepseek_v3.pretrain import DeepseekV3Task, main
from te_npu.errors import ConfigError
from te_npu.training.config import load_config
from te_npu.training.trainer import Trainer
from te_npu.testing.acceptance import rules as R
from tests.system import harness as H

ILLEGAL = list(R.ILLEGAL_CONFIGS)  # (override, the key the error names): te_npu.testing.acceptance.rules


class CountingTask(DeepseekV3Task):
    """The production task, counting ``build`` calls (to prove nothing was built)."""

    builds = 0

    def build(self, cfg, dtype):
        CountingTask.builds += 1
        return super().build(cfg, dtype)


@pytest.fixture
def counting_task():
    CountingTask.builds = 0
    return CountingTask()


def _overrides(tmp_path, data_dir, *extra):
    return H.st_overrides("mxfp8", tmp_path, data_dir, *extra)


@pytest.mark.parametrize("override, key", ILLEGAL, ids=[o.split("=")[0] + "=" + o.split("=", 1)[1][:24] for o, _ in ILLEGAL])
def test_q3_10_illegal_config_fails_in_load_config(tmp_path, capsys, override, key):
    def load(extra):
        load_config(H.RECIPES["mxfp8"], _overrides(tmp_path, tmp_path / "data", extra),
                    model_section=DeepseekV3Task.model_section)

    assert not R.check_illegal_config(load, override, key)
    assert R.check_illegal_config(load, "training.seed=3", key)  # the rule fails on a legal config
    # the production entry fails the same way, before a Trainer exists: one line, exit code 2
    argv = ["--config", str(H.RECIPES["mxfp8"]), *_overrides(tmp_path, tmp_path / "data", override)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ConfigError: ") and key in err and err.count("\n") == 1, err
    assert not (tmp_path / "logs").exists()


def _setup_error(cfg, task) -> str:
    with pytest.raises(ConfigError) as info:
        Trainer(task, print_fn=lambda *_: None).setup(cfg)
    assert task.builds == 0, "the model was built before the configuration error"
    return str(info.value)


@pytest.mark.parametrize("override, key", [("model.preset=dsv3_671b", "model.preset"),
                                           ("model.validate_16b=true", "model.validate_16b")])
def test_q3_10_model_section_loaded_as_written_fails_in_setup_before_build(tmp_path, counting_task, override, key):
    """A config loaded without the task's model section: ``setup`` applies it before anything else."""
    cfg = load_config(H.RECIPES["mxfp8"], _overrides(tmp_path, tmp_path / "data", override))
    assert key in _setup_error(cfg, counting_task)
    assert not (tmp_path / "logs").exists()


def test_q3_10_dp_shard_size_must_match_world_size(tmp_path, counting_task, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not torch.distributed.is_initialized()
    cfg = load_config(H.RECIPES["mxfp8"], _overrides(tmp_path, tmp_path / "data"))  # dp_shard_size 2
    message = _setup_error(cfg, counting_task)  # launched as a single process: world size 1
    assert "fsdp_config.dp_shard_size" in message and "1 launched rank" in message


def test_q3_10_hsdp_layout_must_multiply_to_the_world_size(tmp_path, counting_task, monkeypatch):
    """HSDP: ``dp_shard_size x dp_replicate_size`` must be the world size; the one line names both keys
    and the launched ranks, before any process group or model exists (the launcher's ``WORLD_SIZE``)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert not torch.distributed.is_initialized()
    cfg = load_config(H.RECIPES["mxfp8"], _overrides(tmp_path, tmp_path / "data", "fsdp_config.dp_replicate_size=3"))
    message = _setup_error(cfg, counting_task)
    assert "\n" not in message and not torch.distributed.is_initialized()
    assert "fsdp_config.dp_shard_size x fsdp_config.dp_replicate_size: 2 x 3 = 6" in message
    assert "4 launched rank(s) (the world size)" in message
    assert load_config(H.RECIPES["mxfp8"], _overrides(tmp_path, tmp_path / "data",
                                                      "fsdp_config.dp_replicate_size=2")).global_batch_size == 2 * 2 * 2


@pytest.mark.parametrize("resume, kind", [("true", "missing"), ("true", "file"), ("true", "not_dcp_dir"),
                                          ("auto", "file"), ("auto", "not_dcp_dir")])
def test_q3_10_non_dcp_resume_path_fails_before_build(tmp_path, counting_task, monkeypatch, kind, resume):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if kind == "missing":
        path = tmp_path / "nothing_here"
    elif kind == "file":
        path = tmp_path / "model.pt"
        torch.save({"w": torch.zeros(2)}, path)
    else:
        path = tmp_path / "torch_ckpt"
        path.mkdir()
        torch.save({"w": torch.zeros(2)}, path / "model.pt")
        (path / "latest").write_text("model.pt")  # looks like a te_npu dir, holds no DCP
    cfg = load_config(H.RECIPES["mxfp8"], _overrides(
        tmp_path, tmp_path / "data", f"checkpoint.resume={resume}", f"checkpoint.dir={path}",
        "fsdp_config.dp_shard_size=1"))
    message = _setup_error(cfg, counting_task)
    assert "checkpoint.dir" in message and str(path) in message
