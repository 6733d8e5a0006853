"""Hugging Face weights in and out of the production Trainer on 2 gloo ranks (issue 12).

One spawned 2-rank job (``_hf_job``) runs, in fresh Trainers of the same process group:

- ``fp32``: BF16-baseline recipe with FP32 parameters, started from a ``save_pretrained``
  directory (per-expert keys, sharded with an index); 5 steps; the end of training writes the
  DCP step and an HF export (``last_save_format: hf``); then ``scripts/convert_checkpoint.py
  dcp-to-hf`` exports the saved step, and ``hf-to-dcp`` turns the HF directory into a step-0
  DCP checkpoint that a third Trainer resumes from;
- ``mxfp8`` / ``hif8``: the 8-bit recipes, FP32 parameters, started from a stacked single-file
  directory (``save_original_format=False``) / the per-expert shards; one step each.

The parent holds the transformers model and checks the numbers against it.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models.deepseek_v3.hf_mapping import from_hf_state_dict
from models.deepseek_v3.pretrain import model_config
from te_npu.errors import ConfigError
from tests.model.conftest import hf_model_for
from tests.system import harness as H

pytest.importorskip("transformers", reason="HF round trips need transformers")

STEPS = 5
HF_SEED = 11


def _cfg(fmt, workdir, data_dir, *extra):
    return H.st_config(fmt, workdir, data_dir, "training.param_dtype=fp32", f"training.train_steps={STEPS}", *extra)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _masters_and_buffers(trainer):
    from te_npu.training.hf.weights import training_tensors

    return {k: _full(v).detach().clone() for k, v in training_tensors(trainer.model, trainer.optimizer).items()}


def _first_batch(trainer):
    """The first micro-batch ``train`` will draw (the batcher is rewound after peeking)."""
    state = trainer.batcher.state_dict()
    batch = next(trainer.batcher)
    trainer.batcher.load_state_dict(state)
    return batch


def _hf_job(rank, world, workdir, data_dir, dirs):
    sys.path.insert(0, str(H.REPO / "scripts"))
    import convert_checkpoint

    work = Path(workdir)
    out = {}
    # ---- fp32: start from per-expert sharded HF, train, export two ways, convert back -------------
    cfg = _cfg("bf16", work / "fp32", data_dir, f"checkpoint.initial_load_path={dirs['per_expert']}",
               "checkpoint.last_save_format=hf", "checkpoint.export_dtype=fp32")
    lines: list[str] = []
    trainer, _ = H._trainer(cfg, lines)
    try:
        trainer.setup(cfg)
        out["fp32_start"] = _masters_and_buffers(trainer)
        out["fp32_reads"] = trainer.hf_read_report
        out["fp32_batch"] = _first_batch(trainer)
        out["fp32_records"] = [H._record(r) for r in trainer.train()]
        ids = torch.arange(48).remainder(model_config(cfg).vocab_size).view(2, 24)
        with torch.no_grad():
            out["fp32_logits"] = trainer.model(ids).logits.clone()
        out["eval_ids"] = ids
        out["fp32_lines"] = lines
    finally:
        trainer.close()
    overrides = [*H.st_overrides("bf16", work / "fp32", data_dir), "training.param_dtype=fp32"]
    convert_checkpoint.main(["dcp-to-hf", "--config", str(H.RECIPES["bf16"]), "--checkpoint", str(cfg.checkpoint.dir),
                             "--out", str(work / "converted"), "--dtype", "fp32", "--max-shard-mb", "1",
                             "--no-progress", *overrides])
    convert_checkpoint.main(["hf-to-dcp", "--config", str(H.RECIPES["bf16"]), "--hf", dirs["per_expert"],
                             "--out", str(work / "from_hf"), "--no-progress", *overrides])
    cfg = _cfg("bf16", work / "resumed", data_dir, f"checkpoint.dir={work / 'from_hf'}", "checkpoint.resume=true")
    trainer, _ = H._trainer(cfg, [])
    try:
        trainer.setup(cfg)
        out["from_hf_step"] = trainer.global_step
        out["from_hf_start"] = _masters_and_buffers(trainer)
    finally:
        trainer.close()
    # ---- 8-bit: MXFP8 from the stacked single file, HiF8 from the per-expert shards --------------
    for fmt, layout in (("mxfp8", "stacked"), ("hif8", "per_expert")):
        cfg = _cfg(fmt, work / fmt, data_dir, f"checkpoint.initial_load_path={dirs[layout]}")
        trainer, _ = H._trainer(cfg, [])
        try:
            trainer.setup(cfg)
            out[f"{fmt}_start"] = _masters_and_buffers(trainer)
            out[f"{fmt}_batch"] = _first_batch(trainer)
            out[f"{fmt}_record"] = H._record(trainer.train_step())
        finally:
            trainer.close()
    return out


@pytest.fixture(scope="module")
def hf_job(tmp_path_factory, st_data_dir):
    work = tmp_path_factory.mktemp("hf_job")
    config = model_config(_cfg("bf16", work, st_data_dir))
    hf = hf_model_for(config, seed=HF_SEED)
    dirs = {"per_expert": str(work / "hf_per_expert"), "stacked": str(work / "hf_stacked")}
    hf.save_pretrained(dirs["per_expert"], max_shard_size="300KB")
    hf.save_pretrained(dirs["stacked"], save_original_format=False)
    _add_source_fields(Path(dirs["per_expert"]))
    ranks = H.spawn(_hf_job, work, str(st_data_dir), dirs)
    return {"work": work, "hf": hf, "dirs": dirs, "ranks": ranks, "config": config}


SOURCE_FIELDS = {"bos_token_id": 3, "eos_token_id": 4, "max_position_embeddings": 4096, "use_cache": False,
                 "num_nextn_predict_layers": 1}
SOURCE_FILES = {"tokenizer.json": '{"model": {"type": "BPE"}}', "tokenizer_config.json": '{"model_max_length": 4096}'}


def _add_source_fields(path: Path) -> None:
    """What a published checkpoint has and the recipe does not know: token ids, context length,
    generation defaults, a tokenizer."""
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **SOURCE_FIELDS}))
    for name, text in SOURCE_FILES.items():
        (path / name).write_text(text)
    assert (path / "generation_config.json").is_file()  # save_pretrained writes it


def _hf_loss(hf, batch):
    input_ids, labels = batch
    with torch.no_grad():
        logits = hf(input_ids=input_ids).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).item()


def _hf_truth(hf):
    return {k: v.detach() for k, v in from_hf_state_dict(hf.state_dict()).items()}


@pytest.mark.parametrize("phase", ["fp32", "mxfp8", "hif8", "from_hf"])
def test_hf_start_masters_equal_hf_weights_bitwise(hf_job, phase):
    truth = _hf_truth(hf_job["hf"])
    for rank in hf_job["ranks"]:
        start = rank[f"{phase}_start"]
        assert start.keys() == truth.keys()
        for fqn, value in truth.items():
            assert start[fqn].dtype == torch.float32 and torch.equal(start[fqn], value), fqn
    assert any(v.abs().sum() > 0 for k, v in truth.items() if k.endswith("e_score_correction_bias"))


def test_hf_start_first_step_loss_equals_hf_fp32(hf_job):
    ranks = hf_job["ranks"]
    ours = ranks[0]["fp32_records"][0]["lm_loss"]
    theirs = sum(_hf_loss(hf_job["hf"], r["fp32_batch"]) for r in ranks) / len(ranks)
    assert abs(ours - theirs) <= 1e-5, (ours, theirs)
    assert [r["step"] for r in ranks[0]["fp32_records"]] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("fmt", ["mxfp8", "hif8"])
def test_hf_start_first_step_loss_8bit_within_two_percent(hf_job, fmt):
    ranks = hf_job["ranks"]
    ours = ranks[0][f"{fmt}_record"]["lm_loss"]
    theirs = sum(_hf_loss(hf_job["hf"], r[f"{fmt}_batch"]) for r in ranks) / len(ranks)
    assert ours != theirs and abs(ours - theirs) <= 0.02 * theirs, (ours, theirs)


def test_hf_start_each_rank_reads_only_its_shards(hf_job):
    """DCP's plan: dim-0 shards of every parameter and whole experts of the rank, nothing twice."""
    ranks, config = hf_job["ranks"], hf_job["config"]
    experts_per_rank = config.n_routed_experts // H.WORLD
    total = ranks[0]["fp32_reads"].checkpoint_bytes
    replicated = 0
    for rank, result in enumerate(ranks):
        report = result["fp32_reads"]
        for read in report.reads:
            if ".mlp.experts." in read.key:  # per-expert key: read whole, by its owner only
                expert = int(read.key.split(".mlp.experts.")[1].split(".")[0])
                assert expert // experts_per_rank == rank, read
                assert all(o == 0 for o in read.offsets), read
            elif read.key.endswith("e_score_correction_bias"):  # a buffer: replicated, read by both
                replicated += read.nbytes if rank == 0 else 0
            else:  # an FSDP dim-0 shard
                assert read.offsets[0] == rank * read.lengths[0], read
                assert read.offsets[1:] == (0,) * (len(read.offsets) - 1)
        assert report.bytes_read < 0.55 * total, (rank, report.bytes_read, total)
    assert sum(r["fp32_reads"].bytes_read for r in ranks) == total + replicated


@pytest.mark.parametrize("export", ["converted", "trainer"])
def test_hf_export_loads_in_transformers_with_our_logits(hf_job, export):
    from transformers import DeepseekV3ForCausalLM as HFModel

    work = hf_job["work"]
    path = work / "converted" if export == "converted" else work / "fp32" / "ckpt" / "hf" / f"step_{STEPS}"
    if export == "converted":
        assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1
    assert json.loads((path / "config.json").read_text())["dtype"] == "float32"
    assert not (Path(str(path) + ".tmp")).exists() and not (path / "sharded").exists()
    model, info = HFModel.from_pretrained(path, output_loading_info=True, attn_implementation="sdpa")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    rank0 = hf_job["ranks"][0]
    with torch.no_grad():
        logits = model(input_ids=rank0["eval_ids"]).logits
    assert (logits - rank0["fp32_logits"]).abs().max().item() <= 1e-5
    assert not torch.equal(rank0["fp32_logits"], hf_job["hf"](input_ids=rank0["eval_ids"]).logits)  # it trained


def test_hf_trainer_export_carries_the_sources_config_fields_and_files(hf_job):
    work, source = hf_job["work"], Path(hf_job["dirs"]["per_expert"])
    export = work / "fp32" / "ckpt" / "hf" / f"step_{STEPS}"
    config = json.loads((export / "config.json").read_text())
    kept = {k: v for k, v in SOURCE_FIELDS.items() if k != "num_nextn_predict_layers"}
    assert {k: config[k] for k in kept} == kept, config  # not the recipe's 0 / 1 / 512 / true
    assert config["num_nextn_predict_layers"] == 0  # the export's own tensors: the model has no MTP layer
    assert config["dtype"] == "float32" and config["num_hidden_layers"] == hf_job["config"].num_hidden_layers
    for name in [*SOURCE_FILES, "generation_config.json"]:
        assert (export / name).read_bytes() == (source / name).read_bytes(), name
    record = json.loads((export / "te_npu_export.json").read_text())
    assert record["step"] == STEPS and record["lineage"]
    converted = json.loads((work / "converted" / "config.json").read_text())  # no source named: the model's own
    assert converted["max_position_embeddings"] == hf_job["config"].max_position_embeddings


def test_hf_resume_from_converted_step_zero(hf_job):
    assert [r["from_hf_step"] for r in hf_job["ranks"]] == [0, 0]


# ---- bad inputs: single process, fail before anything is built ------------------------------------


def _setup_error(cfg) -> tuple[str, bool]:
    trainer, _ = H._trainer(cfg, [])
    try:
        with pytest.raises(ConfigError) as info:
            trainer.setup(cfg)
        return str(info.value), hasattr(trainer, "model")
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, st_data_dir):
    """A per-expert single-file HF directory of the test model, and a fresh copy for each edit."""
    import shutil

    work = tmp_path_factory.mktemp("hf_bad")
    hf = hf_model_for(model_config(_cfg("bf16", work, st_data_dir)), seed=HF_SEED)
    hf.save_pretrained(work / "good")

    def copy(name):
        shutil.copytree(work / "good", work / name)
        return work / name

    return copy


def _single_cfg(tmp_path, data_dir, path, *extra):
    return _cfg("bf16", tmp_path, data_dir, "fsdp_config.dp_shard_size=1", f"checkpoint.initial_load_path={path}",
                *extra)


def _edit_tensors(path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_hf_start_rejects_a_config_of_another_model(hf_dir, tmp_path, st_data_dir):
    path = hf_dir("wrong_config")
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (path / "config.json").write_text(json.dumps(config))
    message, built = _setup_error(_single_cfg(tmp_path, st_data_dir, path))
    assert "checkpoint.initial_load_path" in message and "num_hidden_layers = 3" in message, message
    assert not built


def test_hf_start_rejects_a_missing_expert(hf_dir, tmp_path, st_data_dir):
    path = hf_dir("missing_expert")
    _edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.experts.3.down_proj.weight"))
    message, built = _setup_error(_single_cfg(tmp_path, st_data_dir, path))
    assert "1 missing keys: [model.layers.1.mlp.experts.3.down_proj.weight]" in message, message
    assert not built


def test_hf_start_rejects_a_wrong_shape(hf_dir, tmp_path, st_data_dir):
    path = hf_dir("wrong_shape")
    _edit_tensors(path, lambda t: t.update({"model.norm.weight": torch.ones(64)}))
    message, built = _setup_error(_single_cfg(tmp_path, st_data_dir, path))
    assert "model.norm.weight: checkpoint [64], model [128]" in message, message
    assert not built


def test_hf_start_rejects_a_file(hf_dir, tmp_path, st_data_dir):
    path = hf_dir("a_file") / "model.safetensors"
    message, built = _setup_error(_single_cfg(tmp_path, st_data_dir, path))
    assert message.startswith("checkpoint.initial_load_path:") and "is not a directory" in message, message
    assert not built


def test_hf_start_is_ignored_when_the_run_resumes(tmp_path, st_data_dir):
    """``resume: auto`` with the run's own ``latest`` wins; the HF path is not even opened."""
    cfg = _cfg("bf16", tmp_path, st_data_dir, "fsdp_config.dp_shard_size=1")
    trainer, _ = H._trainer(cfg, [])
    try:
        trainer.setup(cfg)
        trainer.save_dcp()
    finally:
        trainer.close()
    cfg = _cfg("bf16", tmp_path, st_data_dir, "fsdp_config.dp_shard_size=1", "checkpoint.resume=auto",
               f"checkpoint.initial_load_path={tmp_path / 'no_such_dir'}")
    lines: list[str] = []
    trainer, _ = H._trainer(cfg, lines)
    try:
        trainer.setup(cfg)
    finally:
        trainer.close()
    assert any("resumed from checkpoint at iteration 0" in line for line in lines), lines
    assert not any("Hugging Face" in line for line in lines), lines


def test_hf_start_config_keys_are_validated(tmp_path, st_data_dir):
    with pytest.raises(ConfigError, match=r"checkpoint\.initial_load_format: 'dcp' is not supported"):
        _cfg("bf16", tmp_path, st_data_dir, "checkpoint.initial_load_format=dcp")
    with pytest.raises(ConfigError, match=r"checkpoint\.export_dtype: 'fp8' is not supported"):
        _cfg("bf16", tmp_path, st_data_dir, "checkpoint.export_dtype=fp8")


# ---- nothing outside the run's own files is replaced; bad files are named ---------------------------


def test_hf_export_dir_holding_the_source_is_refused_before_the_build(hf_dir, tmp_path, st_data_dir):
    """The issue's case: the export would have replaced the source directory (exit 0, files gone)."""
    path = hf_dir("export_over_source")
    (path / "tokenizer.json").write_text("{}")
    before = sorted(os.listdir(path))
    message, built = _setup_error(_single_cfg(tmp_path, st_data_dir, path, "checkpoint.last_save_format=hf",
                                              f"checkpoint.export_dir={path}"))
    assert message.startswith("checkpoint.export_dir: ") and "not an export of this run" in message, message
    assert "config.json" in message and not built
    assert sorted(os.listdir(path)) == before


def test_hf_export_dir_that_cannot_be_written_is_refused_before_the_build(hf_dir, tmp_path, st_data_dir):
    (tmp_path / "a_file").write_text("x")
    message, built = _setup_error(_single_cfg(tmp_path, st_data_dir, hf_dir("unwritable"),
                                              "checkpoint.last_save_format=hf",
                                              f"checkpoint.export_dir={tmp_path / 'a_file' / 'hf'}"))
    assert message.startswith("checkpoint.export_dir: ") and "is not writable" in message, message
    assert not built


@pytest.mark.parametrize("damage", ["safetensors_header", "safetensors_truncated", "config_json", "index_json"])
def test_hf_start_names_a_damaged_file_in_one_line(hf_dir, tmp_path, st_data_dir, damage):
    if damage == "index_json":  # a sharded directory, which has an index
        path = tmp_path / "sharded"
        hf_model_for(model_config(_cfg("bf16", tmp_path, st_data_dir)), seed=HF_SEED).save_pretrained(
            path, max_shard_size="300KB")
    else:
        path = hf_dir(f"damaged_{damage}")
    victim = {"safetensors_header": "model.safetensors", "safetensors_truncated": "model.safetensors",
              "config_json": "config.json", "index_json": "model.safetensors.index.json"}[damage]
    data = (path / victim).read_bytes()
    if damage == "safetensors_header":
        data = data[:8] + b"\xff" * 16 + data[24:]
    elif damage == "safetensors_truncated":
        data = data[: len(data) // 2]
    else:
        data = data[: len(data) // 2]  # a JSON file cut short
    (path / victim).write_bytes(data)
    message, built = _setup_error(_single_cfg(tmp_path, st_data_dir, path))
    assert message.startswith("checkpoint.initial_load_path: ") and str(path / victim) in message, message
    assert "\n" not in message and not built


def test_hf_to_dcp_refuses_a_folder_holding_a_run(hf_dir, tmp_path, st_data_dir):
    """The issue's case: step_0 written into a run's folder became its latest (resume: auto restarted from HF)."""
    from models.deepseek_v3.pretrain import DeepseekV3Task
    from te_npu.distributed.storage import dcp
    from te_npu.training.hf.convert import hf_to_dcp

    cfg = _cfg("bf16", tmp_path, st_data_dir, "fsdp_config.dp_shard_size=1", "training.train_steps=2")
    trainer, _ = H._trainer(cfg, [])
    try:
        trainer.setup(cfg)
        trainer.train()
    finally:
        trainer.close()
    run = cfg.checkpoint.dir
    with pytest.raises(ConfigError, match=r"--out: .* already holds a run's checkpoints \(step_2, latest\)"):
        hf_to_dcp(cfg, DeepseekV3Task(), str(hf_dir("for_convert")), run, progress=False)
    assert dcp.latest_checkpoint(run).endswith("step_2") and dcp.list_steps(run) == [2]
    fresh = hf_to_dcp(cfg, DeepseekV3Task(), str(hf_dir("for_convert_2")), str(tmp_path / "new"), progress=False)
    assert dcp.step_info(fresh)["lineage"] != dcp.step_info(os.path.join(run, "step_2"))["lineage"]
