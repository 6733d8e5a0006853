"""Config schema: every illegal row fails before any model is built, naming its key path.

The recipes are DeepSeek-V3's, so they load with its ``model`` section (``load``), as the
production entry loads them; ``load_config`` without one keeps that section as written.
"""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from models.deepseek_v3.model_section import DeepseekV3ModelSection
from te_npu import ConfigError, HiF8CurrentScalingRecipe, MXFP8BlockRecipe, recipe_from_config
from te_npu.distributed import validate_parallel_config
from te_npu.training.config import BACKENDS_BY_DEVICE, TrainingConfig, load_config
from te_npu.training.schema import yaml_load

REPO = Path(__file__).resolve().parents[3]
RECIPES = sorted((REPO / "recipes").glob("dsv3_*.yaml"))
TINY = REPO / "recipes" / "dsv3_tiny_mxfp8.yaml"


def load(source, overrides=None):
    """``load_config`` as ``models.deepseek_v3.pretrain`` calls it (the task's model section)."""
    return load_config(source, overrides, model_section=DeepseekV3ModelSection)


# (override, key path the error must name): spec section 15 rows and schema rules
ILLEGAL = [
    ("low_precision.format=fp16", "low_precision.format"),
    ("low_precision={enabled: true, format: hif8, scaling: delayed}", "low_precision.scaling"),
    ("low_precision={enabled: false, format: hif8, scaling: delayed}", "low_precision.scaling"),
    ("low_precision={enabled: true, format: mxfp8_e4m3, scaling: current}", "low_precision.scaling"),
    ("low_precision={enabled: true, format: hif8, scaling: mx_block}", "low_precision.scaling"),
    ("low_precision.margin=0", "low_precision.margin"),
    ("low_precision.enabled=yes", "low_precision.enabled"),
    ("low_precision={enabled: true, format: hif8, scaling: current, scale_alg: floor}", "low_precision.scale_alg"),
    ("low_precision={enabled: false, format: hif8, scaling: current, scale_alg: ceil}", "low_precision.scale_alg"),
    ("low_precision.scale_alg=round", "low_precision.scale_alg"),
    ("fsdp_config.comm_fusion=true", "fsdp_config.comm_fusion"),
    ("parallel.tensor_parallel_size=2", "parallel.tensor_parallel_size"),
    ("parallel.context_parallel_size=2", "parallel.context_parallel_size"),
    ("parallel.expert_parallel_size=8", "parallel.expert_parallel_size"),
    ("parallel.pipeline_parallel_size=2", "parallel.pipeline_parallel_size"),
    ("checkpoint.format=torch_save", "checkpoint.format"),
    ("activation_checkpoint.mode=selective", "activation_checkpoint.mode"),
    ("training.gradient_accumulation_steps=0", "training.gradient_accumulation_steps"),
    ("fsdp_config.dp_shard_size=0", "fsdp_config.dp_shard_size"),
    ("training.micro_batch_size=0", "training.micro_batch_size"),
    ("training.adam_beta2=1.0", "training.adam_beta2"),
    ("training.lr=0", "training.lr"),
    ("training.min_lr=1.0", "training.min_lr"),
    ("training.lr_schedule=step", "training.lr_schedule"),
    ("training.device=tpu", "training.device"),
    ("training.backend=nccl", "training.backend"),
    ("training.param_dtype=fp16", "training.param_dtype"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last"),
    ("data.kind=bin", "data.path"),
    ("data.path=/tmp/x", "data.path"),
    ("data.val_fraction=0.9", "data.val_fraction"),
    ("logging.metrics_jsonl=sub/metrics.jsonl", "logging.metrics_jsonl"),
    ("model.preset=dsv3_671b", "model.preset"),
    ("model.validate_16b=true", "model.validate_16b"),
    ("model.hf_config=/nonexistent/config.json", "model.preset / model.hf_config"),
    ("model.overrides.hidden_sise=64", "model.overrides.hidden_sise"),
    ("training.seq_len=33", "training.micro_batch_size x training.seq_len"),  # MXFP8: 4 x 33 tokens % 32
    ("training.loss_spike_factor=0.5", "training.loss_spike_factor"),
    ("training.max_consecutive_skipped_steps=-1", "training.max_consecutive_skipped_steps"),
    ("checkpoint.load_step=-2", "checkpoint.load_step"),
    ("checkpoint.dir=''", "checkpoint.dir"),
]


@pytest.mark.parametrize(("override", "path"), ILLEGAL, ids=[o for o, _ in ILLEGAL])
def test_config_illegal_value_names_key_path(override, path):
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        load(TINY, [override])


TYPE_ERRORS = [
    ("training.train_steps=true", "training.train_steps", "an integer"),
    ("training.seed=1.5", "training.seed", "an integer"),
    ("training.lr=fast", "training.lr", "a number"),
    ("training.clip_grad=false", "training.clip_grad", "a number"),
    ("fsdp_config.reshard_after_forward=1", "fsdp_config.reshard_after_forward", "true/false"),
    ("checkpoint.resume=yes", "checkpoint.resume", "'auto'"),
    ("checkpoint.dir=[a, b]", "checkpoint.dir", "a string"),
    ("model.overrides=[1]", "model.overrides", "a mapping"),
    ("training=5", "training", "a mapping"),
]


@pytest.mark.parametrize(("override", "path", "expected"), TYPE_ERRORS, ids=[o for o, *_ in TYPE_ERRORS])
def test_config_wrong_type_names_key_path(override, path, expected):
    with pytest.raises(ConfigError, match=rf"{path.replace('.', '[.]')}: expected .*{expected}"):
        load(TINY, [override])


@pytest.mark.parametrize(
    ("override", "path"),
    [("trainer.steps=1", "trainer"), ("training.foo=1", "training.foo"), ("data.extra.deep=1", "data.extra")],
)
def test_config_unknown_key_fails_at_any_depth(override, path):
    with pytest.raises(ConfigError, match=rf"{path.replace('.', '[.]')}: unknown key"):
        load(TINY, [override])


def test_config_unknown_nested_key_in_yaml_file(tmp_path):
    text = TINY.read_text().replace("  comm_fusion: false\n", "  comm_fusion: false\n  bucket_mb: 25\n")
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"fsdp_config\.bucket_mb: unknown key"):
        load(tmp_path / "c.yaml")


def test_config_overrides_are_yaml_typed():
    cfg = load(
        TINY,
        [
            "training.train_steps=10",
            "training.lr=1e-3",
            "checkpoint.resume=false",
            "data.shuffle=false",
            "logging.dir=runs/x",
            "model.overrides.hidden_size=64",
            "model.overrides.q_lora_rank=null",
            "low_precision={enabled: true, format: hif8, scaling: current}",
        ],
    )
    assert cfg.training.train_steps == 10 and cfg.training.lr == 1e-3
    assert cfg.checkpoint.resume is False and cfg.data.shuffle is False and cfg.logging.dir == "runs/x"
    assert dict(cfg.model.overrides) == {"hidden_size": 64, "q_lora_rank": None}
    assert cfg.low_precision.recipe == HiF8CurrentScalingRecipe()


@pytest.mark.parametrize("bad", ["training.lr", "=3", "training..lr=3", "training.lr.x=3"])
def test_config_malformed_override_fails(bad):
    with pytest.raises(ConfigError):
        load(TINY, [bad])


def test_config_yaml_12_scalars():
    assert yaml_load("a: off\nb: yes\nc: 3e-3\nd: true\ne: 7\nf: 1.0e-8") == {
        "a": "off", "b": "yes", "c": 3e-3, "d": True, "e": 7, "f": 1e-8,
    }


def test_config_unquoted_off_is_recompute_off(tmp_path):
    (tmp_path / "c.yaml").write_text(TINY.read_text().replace('mode: "off"', "mode: off"))
    assert load(tmp_path / "c.yaml").activation_checkpoint.mode == "off"


def test_config_input_dict_not_mutated():
    raw = yaml_load(TINY.read_text())
    snapshot = repr(raw)
    load(raw, ["training.train_steps=3", "model.overrides.vocab_size=512"])
    assert repr(raw) == snapshot


def test_config_is_frozen():
    cfg = load(TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.lr = 1.0
    with pytest.raises(TypeError):
        cfg.model.overrides["hidden_size"] = 1


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_config_recipe_loads_and_round_trips(path):
    cfg = load(path)
    assert load(cfg.to_dict()) == cfg
    expected = {"bf16": None, "mxfp8": MXFP8BlockRecipe(), "hif8": HiF8CurrentScalingRecipe()}[path.stem.split("_")[2]]
    assert cfg.low_precision.recipe == expected
    assert cfg.checkpoint.format == "dcp" and not cfg.fsdp_config.comm_fusion


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_config_low_precision_scale_alg_chooses_the_mxfp8_scale_rule(rule):
    cfg = load(TINY, [f"low_precision.scale_alg={rule}"])
    assert cfg.low_precision.recipe == MXFP8BlockRecipe(scale_alg=rule)
    assert load(cfg.to_dict()) == cfg
    assert load(TINY).low_precision.recipe.scale_alg == "ceil"  # not written: the default


def test_config_recipes_count_and_variants_differ_only_in_low_precision():
    assert [p.stem for p in RECIPES if p.stem.count("_") == 2] == [
        f"dsv3_{s}_{v}" for s in ("16b", "tiny") for v in ("bf16", "hif8", "mxfp8")]
    for size in ("16b", "tiny"):
        dicts = []
        for variant in ("bf16", "mxfp8", "hif8"):
            d = load(REPO / "recipes" / f"dsv3_{size}_{variant}.yaml").to_dict()
            d.pop("low_precision")
            for section in ("checkpoint", "logging"):  # run directories embed the run name
                d[section]["dir"] = d[section]["dir"].replace(f"dsv3_{size}_{variant}", "<run>")
            dicts.append(d)
        assert dicts[0] == dicts[1] == dicts[2]


def test_config_recipe_sizes():
    big, tiny = load(REPO / "recipes/dsv3_16b_mxfp8.yaml"), load(TINY)
    assert (big.model.preset, big.model.validate_16b, big.fsdp_config.dp_shard_size) == ("dsv3_16b", True, 8)
    assert (big.training.device, big.training.resolved_backend, big.training.seq_len) == ("npu", "hccl", 4096)
    assert big.data.kind == "bin" and big.training.lr == 4.2e-4 and big.training.warmup_steps == 2000
    assert (tiny.model.preset, tiny.training.device, tiny.training.resolved_backend) == ("dsv3_tiny", "cpu", "gloo")
    assert (tiny.fsdp_config.dp_shard_size, tiny.training.seq_len, tiny.training.micro_batch_size) == (2, 256, 4)
    assert tiny.data.kind == "stdlib" and tiny.checkpoint.dir == "runs/dsv3_tiny_mxfp8/checkpoints"
    assert tiny.global_batch_size == 8 and tiny.tokens_per_step == 2048


def test_config_load_does_not_touch_npu_or_models():
    # A fresh interpreter: other tests in this process may already have imported models/.
    code = (
        "import sys\n"
        "from te_npu.training.config import load_config\n"
        f"load_config({str(REPO / 'recipes/dsv3_16b_hif8.yaml')!r})\n"
        "assert 'torch_npu' not in sys.modules, 'torch_npu imported'\n"
        "assert not any(m == 'models' or m.startswith('models.') for m in sys.modules), 'models imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_config_hf_config_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = load(TINY, ["model.preset=null", f"model.hf_config={tmp_path}"])
    assert cfg.model.hf_config == str(tmp_path) and cfg.model.validate_16b is False


def test_config_load_step_needs_resume():
    with pytest.raises(ConfigError, match=r"checkpoint\.load_step: 4 needs checkpoint\.resume"):
        load(TINY, ["checkpoint.resume=false", "checkpoint.load_step=4"])
    assert load(TINY, ["checkpoint.load_step=4"]).checkpoint.load_step == 4


def test_config_token_rule_only_for_block_formats():
    assert load(TINY, ["training.seq_len=33", "low_precision.enabled=false"]).training.seq_len == 33
    hif8 = "low_precision={enabled: true, format: hif8, scaling: current}"
    assert load(TINY, ["training.seq_len=33", hif8]).training.seq_len == 33


@pytest.mark.parametrize(("text", "match"), [
    ("training:\n  lr: [1\n", r"is not valid YAML \(line \d+, column \d+\)"),
    ("", r"model\.preset / model\.hf_config"),
    ("\x00\x00", r"not valid YAML|cannot be read"),
])
def test_config_bad_files_are_one_line_config_errors(tmp_path, text, match):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        load(tmp_path / "c.yaml")
    assert "\n" not in str(info.value)


def test_config_file_without_training_section_uses_defaults(tmp_path):
    (tmp_path / "c.yaml").write_text("model:\n  preset: dsv3_tiny\n")
    cfg = load(tmp_path / "c.yaml")
    assert cfg.training.device == "cpu" and cfg.checkpoint.verify_checksums and not cfg.checkpoint.save_on_sigterm


def test_config_without_model_section_keeps_it_as_written():
    cfg = load_config(TINY, ["model.preset=dsv3_671b"])  # nothing here knows which presets exist
    assert {k: v for k, v in cfg.model.items() if k != "load_balance"} == {"preset": "dsv3_671b", "overrides": {}}
    assert load_config(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match=r"model\.preset: expected 'dsv3_16b' or 'dsv3_tiny' or null, got 'dsv3_671"):
        cfg.with_model_section(DeepseekV3ModelSection)
    typed = load_config(TINY).with_model_section(DeepseekV3ModelSection)
    assert typed == load(TINY) and typed.with_model_section(DeepseekV3ModelSection) is typed


@pytest.mark.parametrize(("override", "rule"), [
    ("parallel.tensor_parallel_size=2", lambda: validate_parallel_config(tensor_parallel=2)),
    ("parallel.pipeline_parallel_size=4", lambda: validate_parallel_config(pipeline_parallel=4)),
    ("fsdp_config.comm_fusion=true", lambda: validate_parallel_config(comm_fusion=True)),
    ("low_precision={enabled: false, format: hif8, scaling: delayed}",
     lambda: recipe_from_config({"enabled": False, "format": "hif8", "scaling": "delayed"}, check_disabled=True)),
    ("low_precision.margin=0", lambda: recipe_from_config({"enabled": True, "format": "mxfp8_e4m3",
                                                           "scaling": "mx_block", "margin": 0})),
], ids=["tp", "pp", "comm_fusion", "disabled-combination", "unknown-key"])
def test_config_fail_fast_rule_has_one_source(override, rule):
    """The config refuses a spec-15 row with the very error of the function the runtime calls."""
    with pytest.raises(ConfigError) as from_config:
        load(TINY, [override])
    with pytest.raises(ConfigError) as from_rule:
        rule()
    assert str(from_config.value) == str(from_rule.value)


def test_config_backend_map_covers_every_device():
    from typing import get_args, get_type_hints

    hints = get_type_hints(TrainingConfig)
    assert set(BACKENDS_BY_DEVICE) == set(get_args(hints["device"]))
    assert {b for bs in BACKENDS_BY_DEVICE.values() for b in bs} | {"auto"} == set(get_args(hints["backend"]))
    auto = {d: TrainingConfig(device=d).resolved_backend for d in BACKENDS_BY_DEVICE}
    assert auto == {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
    assert TrainingConfig(device="cuda", backend="gloo").resolved_backend == "gloo"


def test_config_mtp_recipe_is_the_tiny_mxfp8_recipe_with_one_mtp_layer():
    """``recipes/dsv3_tiny_mxfp8_mtp.yaml``: ``dsv3_tiny_mxfp8`` plus one MTP layer and its loss weight."""
    base, mtp = (load(REPO / "recipes" / f"{name}.yaml").to_dict() for name in ("dsv3_tiny_mxfp8", "dsv3_tiny_mxfp8_mtp"))
    assert mtp["model"].pop("overrides") == {"num_nextn_predict_layers": 1}
    assert mtp["model"].pop("mtp") == {"loss_scaling_factor": 0.3, "loss_scaling_factor_after": 0.1, "change_step": 200}
    base["model"].pop("overrides")
    base["model"].pop("mtp")
    for section in ("checkpoint", "logging"):
        mtp[section]["dir"] = mtp[section]["dir"].replace("dsv3_tiny_mxfp8_mtp", "dsv3_tiny_mxfp8")
    assert mtp == base
