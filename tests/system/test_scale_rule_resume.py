"""The MXFP8 scale rule of a run: logged, recorded in each checkpoint, and a resume under the
other rule says so in one line and continues (its weights then carry the run's rule).

One gloo rank, the ST tiny model: train 2 steps with ``low_precision.scale_alg: floor`` and save,
then resume with the default (ceil) for one more step.
"""
from __future__ import annotations

import json

import pytest

from te_npu.compat import local_tensor
from te_npu.tensor import MXFP8Tensor
from tests.distributed.harness import run_ranks
from tests.system.harness import st_config


def _worker(rank, world, result_dir, workdir, data_dir, overrides, steps):
    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.training.trainer import Trainer

    lines: list[str] = []
    cfg = st_config("mxfp8", workdir, data_dir, "fsdp_config.dp_shard_size=1", *overrides)
    trainer = Trainer(DeepseekV3Task(), print_fn=lines.append)
    try:
        trainer.setup(cfg)
        for _ in range(steps):
            trainer.train_step()
        trainer.save_dcp()
        rules = {type(local_tensor(p)).__name__: local_tensor(p).quantizer.scale_alg
                 for _, p in trainer.model.named_parameters() if isinstance(local_tensor(p), MXFP8Tensor)}
        return {"lines": lines, "rules": rules, "step": trainer.global_step}
    finally:
        trainer.close()


@pytest.mark.slow  # three tiny-model setups (minutes on a shared CPU); the note itself: tests/unit/test_recipe.py
def test_scale_rule_is_logged_recorded_and_a_resume_under_the_other_rule_says_so(tmp_path, st_data_dir):
    for run in ("floor", "ceil", "same"):
        (tmp_path / run).mkdir()
    (floor,) = run_ranks(_worker, 1, tmp_path / "floor", str(tmp_path), str(st_data_dir),
                         ["low_precision.scale_alg=floor"], 2)
    assert floor["rules"] == {"MXFP8Tensor": "floor"}
    assert any(line.startswith(" low precision: mxfp8_e4m3 (MXFP8BlockRecipe, scale_alg=floor") for line in floor["lines"])
    info = json.loads((tmp_path / "ckpt" / "step_2" / "te_npu.json").read_text())
    assert info["low_precision"] == {"format": "mxfp8_e4m3", "scale_alg": "floor"}

    (ceil,) = run_ranks(_worker, 1, tmp_path / "ceil", str(tmp_path), str(st_data_dir), ["checkpoint.resume=true"], 1)
    notes = [line for line in ceil["lines"] if "scale_alg" in line and "note:" in line]
    assert notes == [" note: checkpoint step_2 was trained with MXFP8 scale_alg=floor; this run continues with "
                     "scale_alg=ceil (low_precision.scale_alg)"]
    assert any("resumed from checkpoint at iteration 2" in line for line in ceil["lines"])
    assert ceil["step"] == 3 and ceil["rules"] == {"MXFP8Tensor": "ceil"}
    info = json.loads((tmp_path / "ckpt" / "step_3" / "te_npu.json").read_text())
    assert info["low_precision"] == {"format": "mxfp8_e4m3", "scale_alg": "ceil"}

    (same,) = run_ranks(_worker, 1, tmp_path / "same", str(tmp_path), str(st_data_dir), ["checkpoint.resume=true"], 1)
    assert not [line for line in same["lines"] if "note: checkpoint" in line]  # same rule: nothing to say
