"""The tiny job with one MTP layer (issue 37), 2 gloo ranks, MXFP8 emulation, FSDP2.

One continuous run (``save_dcp`` after step ``SAVE_AT``, an HF export at the end) and a resume
of it in new processes: the MTP loss falls and is reported beside ``lm loss``; the MTP layer is
its own FSDP2 unit whose 8-bit weights are refreshed once per step; its GEMMs are 8-bit and its
norms / router high precision (Q3-04); the resume is bitwise; the export holds DeepSeek's
layer-``num_hidden_layers`` keys and a run started from it reads them bitwise.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from models.deepseek_v3.config import expected_low_precision_scope
from models.deepseek_v3.pretrain import DeepseekV3Task, model_config
from te_npu.testing.acceptance import rules as R
from te_npu.compat import local_tensor
from te_npu.testing.acceptance.runs import closing, make_trainer, resume_phase, step_record, weight_state
from tests.system import harness as H

pytestmark = pytest.mark.slow  # ~1 min of two CPU ranks; the MTP numerics: tests/model/test_deepseek_v3_mtp.py
STEPS, SAVE_AT = 10, 7
MTP_OVERRIDES = ("model.overrides={num_hidden_layers: 2, n_shared_experts: 2, num_nextn_predict_layers: 1}",
                 "training.param_dtype=fp32", "training.warmup_steps=2", "checkpoint.export_dtype=fp32",
                 # lambda changes before the save: the resumed steps must weigh MTP by the later factor
                 # (the Trainer's step_begin tells the task the resumed step)
                 "model.mtp={loss_scaling_factor: 0.3, loss_scaling_factor_after: 0.1, change_step: 5}")


def _cfg(workdir, data_dir, *extra):
    return H.st_config("mxfp8", workdir, data_dir, *MTP_OVERRIDES, f"training.train_steps={STEPS}", *extra)


def _main(rank, world, workdir, data_dir):
    cfg = _cfg(workdir, data_dir)
    lines: list[str] = []
    trainer, probe = make_trainer(DeepseekV3Task(), lines)
    with closing(trainer):
        trainer.setup(cfg)
        records = []
        for _ in range(STEPS):
            records.append(step_record(trainer.train_step()))
            if trainer.global_step == SAVE_AT:
                trainer.save_dcp(str(Path(workdir) / "dcp"))
        trainer.save_hf()
        result = {"records": records, "probe": probe, "weights": weight_state(trainer), "lines": lines,
                  "masters": {f: local_tensor(m).detach().cpu().clone() for f, m in trainer.optimizer.masters.items()},
                  "units": [n for n, m in trainer.model.named_modules() if isinstance(m, FSDPModule)]}
    return result


def _resume(rank, world, workdir, data_dir):
    return resume_phase(DeepseekV3Task(), _cfg(workdir, data_dir), str(Path(workdir) / "dcp"), STEPS - SAVE_AT)


@pytest.fixture(scope="module")
def mtp_job(tmp_path_factory, st_data_dir):
    work = tmp_path_factory.mktemp("mtp_job")
    main = H.spawn(_main, work, str(st_data_dir))
    resumed = H.spawn(_resume, work, str(st_data_dir))
    return {"work": work, "main": main, "resumed": resumed, "cfg": _cfg(work, st_data_dir)}


def test_mtp_loss_falls_and_is_reported_beside_the_main_loss(mtp_job):
    records = mtp_job["main"][0]["records"]
    mtp = [r["loss_extras"]["mtp_1_loss"] for r in records]
    lm = [r["lm_loss"] for r in records]
    assert mtp[-1] < mtp[0] - 0.3 and lm[-1] < lm[0] - 0.3, (mtp, lm)
    assert all(set(r["loss_extras"]) == {"mtp_1_loss", "balance_loss"} for r in records)
    # (how extras reach the step line, metrics.jsonl and TensorBoard: tests/unit/training/test_metrics_log.py)


def test_mtp_layer_is_8bit_where_the_main_layers_are_and_high_precision_elsewhere(mtp_job):
    config = model_config(mtp_job["cfg"])
    for rank in mtp_job["main"]:
        assert not R.check_scope(rank, expected_low_precision_scope(config))
        assert not R.check_high_precision_pieces(rank, config.num_hidden_layers, config.num_nextn_predict_layers)
        assert "model.layers.2.eh_proj.weight" in rank["weights"]  # an 8-bit, FSDP-sharded weight
        assert not R.check_gathers(rank, "mxfp8", micro_steps=1, reshard=True, world=H.WORLD)  # gathered in 8 bits
        for step in range(STEPS):  # one refresh per 8-bit weight per step, the MTP layer's included
            assert rank["probe"].refresh_counts(step) == dict.fromkeys(rank["weights"], 1)


def test_mtp_layer_is_its_own_fsdp_unit(mtp_job):
    units = mtp_job["main"][0]["units"]
    assert {"model.layers.0", "model.layers.1", "model.layers.2"} <= set(units), units


def test_mtp_job_resumes_bitwise_in_new_processes(mtp_job):
    for cont, res in zip(mtp_job["main"], mtp_job["resumed"]):
        later = cont["records"][SAVE_AT:]
        assert [r["loss_extras"] for r in res["records"]] == [r["loss_extras"] for r in later]
        assert [(r["lm_loss"], r["grad_norm"]) for r in res["records"]] == [(r["lm_loss"], r["grad_norm"]) for r in later]
        for fqn, master in cont["masters"].items():
            assert torch.equal(res["masters"][fqn], master), fqn


def test_mtp_export_holds_deepseek_keys_and_reloads_bitwise(mtp_job, tmp_path, st_data_dir):
    from safetensors.torch import load_file

    export = Path(mtp_job["cfg"].checkpoint.dir) / "hf" / f"step_{STEPS}"
    config = json.loads((export / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 2
    tensors = {}
    for name in os.listdir(export):
        if name.endswith(".safetensors"):
            tensors.update(load_file(export / name))
    layer = {k for k in tensors if k.startswith("model.layers.2.")}
    assert {f"model.layers.2.{k}.weight" for k in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "embed_tokens",
                                                   "shared_head.head")} <= layer
    assert torch.equal(tensors["model.layers.2.shared_head.head.weight"], tensors["lm_head.weight"])
    # a one-rank run started from the export reads every tensor of it bitwise, nothing left out
    cfg = H.st_config("bf16", tmp_path, st_data_dir, "training.param_dtype=fp32", "fsdp_config.dp_shard_size=1",
                      "model.preset=null", f"model.hf_config={export}", f"checkpoint.initial_load_path={export}")
    lines: list[str] = []
    trainer, _ = make_trainer(DeepseekV3Task(), lines)
    try:
        trainer.setup(cfg)
        masters = {f: m.detach() for f, m in trainer.optimizer.masters.items()}
        for fqn in [f for f in masters if f.startswith("model.layers.2.")]:
            assert torch.equal(masters[fqn], _stacked(tensors, fqn)), fqn
    finally:
        trainer.close()
    assert not [line for line in lines if "left out" in line], lines


def _stacked(tensors, fqn):
    """Our (stacked) tensor ``fqn`` from the export's per-expert keys."""
    if fqn.endswith("experts.gate_up_proj"):
        prefix, E = fqn.removesuffix(".gate_up_proj"), 8
        return torch.stack([torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"]])
                            for e in range(E)])
    if fqn.endswith("experts.down_proj"):
        prefix = fqn.removesuffix(".down_proj")
        return torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(8)])
    return tensors[fqn]
