"""Recipes, roles and config parsing (spec sections 7.1, 13.1, 16.1)."""
import dataclasses
import subprocess
import sys
from types import MappingProxyType

import pytest

import te_npu
from te_npu import ConfigError, HiF8CurrentScalingRecipe, MXFP8BlockRecipe, QuantizationRole
from te_npu.quantizers import HiF8Quantizer, MXFP8Quantizer


def test_mxfp8_recipe_defaults_are_e4m3_block32_e8m0_ceil():
    recipe = MXFP8BlockRecipe()
    assert (recipe.fp8_format, recipe.block_size, recipe.scale_dtype, recipe.scale_alg) == ("E4M3", 32, "E8M0", "ceil")
    assert te_npu.recipe.MXFP8BlockScaling().scale_alg == "ceil" and recipe == MXFP8BlockRecipe(scale_alg="ceil")
    assert {q.scale_alg for q in recipe.quantizers().values()} == {"ceil"}
    assert MXFP8BlockRecipe(scale_alg="floor").quantizer(QuantizationRole.INPUT_FWD).scale_alg == "floor"
    assert recipe.format is te_npu.Format.MXFP8_E4M3


def test_recipes_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MXFP8BlockRecipe().block_size = 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        HiF8CurrentScalingRecipe().grad_max = 1.0


@pytest.mark.parametrize(
    "field, value", [("block_size", 16), ("fp8_format", "E5M2"), ("scale_dtype", "FP32"), ("scale_alg", "round")]
)
def test_mxfp8_recipe_rejects_unsupported_fields(field, value):
    with pytest.raises(ConfigError, match=field):
        MXFP8BlockRecipe(**{field: value})


def test_mxfp8_recipe_maps_every_role_to_one_shared_quantizer():
    mapping = MXFP8BlockRecipe().quantizers()
    assert isinstance(mapping, MappingProxyType)
    assert set(mapping) == set(QuantizationRole)
    assert len({id(q) for q in mapping.values()}) == 1
    assert isinstance(mapping[QuantizationRole.INPUT_FWD], MXFP8Quantizer)
    with pytest.raises(TypeError):
        mapping[QuantizationRole.INPUT_FWD] = None


@pytest.mark.parametrize(
    "role, expected_max",
    [
        (QuantizationRole.INPUT_FWD, 15.0),
        (QuantizationRole.WEIGHT_FWD, 15.0),
        (QuantizationRole.INPUT_BWD, 15.0),
        (QuantizationRole.WEIGHT_BWD, 15.0),
        (QuantizationRole.GRAD_OUTPUT, 224.0),
    ],
)
def test_hif8_recipe_role_format_max(role, expected_max):
    quantizer = HiF8CurrentScalingRecipe().quantizer(role)
    assert isinstance(quantizer, HiF8Quantizer)
    assert quantizer.format_max == expected_max


def test_hif8_recipe_quantizer_accepts_role_strings():
    assert HiF8CurrentScalingRecipe().quantizer("grad_output").format_max == 224.0


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"enabled": True, "format": "mxfp8_e4m3", "scaling": "mx_block"}, MXFP8BlockRecipe()),
        ({"enabled": True, "format": "hif8", "scaling": "current"}, HiF8CurrentScalingRecipe()),
        ({"enabled": True, "format": "mxfp8_e4m3", "scale_alg": "floor"}, MXFP8BlockRecipe(scale_alg="floor")),
        ({"enabled": True, "format": "mxfp8_e4m3", "scale_alg": "ceil"}, MXFP8BlockRecipe()),
    ],
    ids=["mxfp8", "hif8", "mxfp8-floor", "mxfp8-ceil"],
)
def test_recipe_from_config_accepts_the_two_legal_combinations(config, expected):
    assert te_npu.recipe_from_config(config) == expected


@pytest.mark.parametrize(
    "config, field",
    [
        ({"enabled": True, "format": "mxfp8_e4m3", "scaling": "current"}, "low_precision.scaling"),
        ({"enabled": True, "format": "hif8", "scaling": "mx_block"}, "low_precision.scaling"),
        ({"enabled": True, "format": "hif8", "scaling": "delayed"}, "low_precision.scaling"),
        ({"enabled": True, "format": "mxfp4", "scaling": "mx_block"}, "low_precision.format"),
        ({"enabled": "yes", "format": "hif8", "scaling": "current"}, "low_precision.enabled"),
        ({"enabled": True, "format": "hif8", "scaling": "current", "margin": 0}, "margin"),
        ({"enabled": True, "format": "hif8", "scale_alg": "floor"}, "low_precision.scale_alg"),
        ({"enabled": True, "format": "hif8", "scale_alg": "ceil"}, "low_precision.scale_alg"),
        ({"enabled": True, "format": "mxfp8_e4m3", "scale_alg": "round"}, "low_precision.scale_alg"),
        ({"enabled": True, "format": "mxfp8_e4m3", "scale_alg": 1}, "low_precision.scale_alg"),
    ],
    ids=["mxfp8+current", "hif8+mx_block", "hif8+delayed", "mxfp4", "enabled-not-bool", "unknown-key",
         "hif8+floor", "hif8+ceil", "mxfp8+round", "mxfp8+vendor-int"],
)
def test_recipe_from_config_rejects_illegal_combinations_naming_the_field(config, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as info:
        te_npu.recipe_from_config(config)
    if "scaling" in field:
        assert "allowed values" in str(info.value)


def test_recipe_from_config_refuses_scale_alg_with_hif8_in_one_line_even_when_disabled():
    with pytest.raises(ConfigError) as info:
        te_npu.recipe_from_config({"enabled": False, "format": "hif8", "scale_alg": "floor"}, check_disabled=True)
    assert str(info.value).startswith("low_precision.scale_alg: ") and "\n" not in str(info.value)
    assert "MXFP8" in str(info.value)


def test_recipe_from_config_disabled_returns_none():
    assert te_npu.recipe_from_config({"enabled": False, "format": "hif8", "scaling": "delayed"}) is None
    assert te_npu.recipe_from_config(None) is None


def test_disabled_low_precision_never_imports_torch_npu():
    code = (
        "import sys, te_npu, torch\n"
        "assert te_npu.recipe_from_config({'enabled': False}) is None\n"
        "m = te_npu.TELinear(64, 64, bias=False, params_dtype=torch.bfloat16)\n"
        "with te_npu.autocast(enabled=False):\n"
        "    m(torch.randn(2, 64, dtype=torch.bfloat16)).sum().backward()\n"
        "assert 'torch_npu' not in sys.modules, 'torch_npu imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- issue 14: Transformer Engine's recipe names and fields ----------------------------------

def test_te_mxfp8_block_scaling_is_the_mxfp8_recipe():
    from te_npu import recipe

    for made in (recipe.MXFP8BlockScaling(), recipe.MXFP8BlockScaling(fp8_format=recipe.Format.E4M3),
                 recipe.MXFP8BlockScaling(0, "E4M3"), recipe.MXFP8BlockScaling(margin=0, fp8_dpa=False)):
        assert made == MXFP8BlockRecipe() and type(made) is MXFP8BlockRecipe
        assert hash(made) == hash(MXFP8BlockRecipe())


@pytest.mark.parametrize("field, value, reason", [
    ("fp8_format", "HYBRID", "E4M3 for inputs, weights and gradients"),
    ("fp8_format", "E5M2", "only Format.E4M3"),
    ("margin", 1, "no delayed-scaling margin"),
    ("fp8_dpa", True, "no FP8 attention"),
    ("fp8_mha", True, "no FP8 attention"),
    ("backward_override", "high_precision", "every backward GEMM runs in the recipe's format"),
    ("enable_2d_quantization", True, "2D weight blocks are not implemented"),
])
def test_te_mxfp8_block_scaling_refuses_fields_without_meaning_here(field, value, reason):
    from te_npu import recipe

    if field == "fp8_format":
        value = recipe.Format[value]
    with pytest.raises(ConfigError, match=rf"MXFP8BlockScaling\.{field}: .*{reason}"):
        recipe.MXFP8BlockScaling(**{field: value})


def test_te_mxfp8_block_scaling_accepts_te_s_own_format_enum_by_name():
    import enum

    from te_npu import recipe

    class TEFormat(enum.Enum):  # transformer_engine.common.recipe.Format's members hold helper objects
        E4M3 = object()
        HYBRID = object()

    assert recipe.MXFP8BlockScaling(fp8_format=TEFormat.E4M3) == MXFP8BlockRecipe()
    with pytest.raises(ConfigError, match="fp8_format"):
        recipe.MXFP8BlockScaling(fp8_format=TEFormat.HYBRID)


@pytest.mark.parametrize("name, reason", [
    ("DelayedScaling", "delayed scaling"),
    ("Float8CurrentScaling", "HiF8CurrentScalingRecipe"),
    ("Float8BlockScaling", "MXFP8BlockScaling"),
    ("NVFP4BlockScaling", "FP4"),
])
def test_te_recipes_without_a5_counterpart_raise_with_reason(name, reason):
    from te_npu import recipe

    with pytest.raises(ConfigError, match=rf"{name} is not supported by te_npu: .*{reason}"):
        getattr(recipe, name)(fp8_format=recipe.Format.HYBRID)


# ---- issue 20: TE's recipe classes (isinstance, kind predicates, fields) -------------------------

def test_te_recipe_classes_answer_isinstance_and_kind_predicates_as_te():
    from te_npu import recipe

    made = recipe.MXFP8BlockScaling()
    assert recipe.MXFP8BlockScaling is MXFP8BlockRecipe and isinstance(made, recipe.MXFP8BlockScaling)
    assert isinstance(made, recipe.Recipe) and isinstance(HiF8CurrentScalingRecipe(), recipe.Recipe)
    kinds = ("mxfp8", "hif8", "delayed", "float8_current_scaling", "float8_per_tensor_scaling",
             "float8_block_scaling", "nvfp4", "custom")
    expected = {
        recipe.MXFP8BlockScaling: {"mxfp8"},
        HiF8CurrentScalingRecipe: {"hif8"},
        recipe.DelayedScaling: {"delayed", "float8_per_tensor_scaling"},
        recipe.Float8CurrentScaling: {"float8_current_scaling", "float8_per_tensor_scaling"},
        recipe.Float8BlockScaling: {"float8_block_scaling"},
        recipe.NVFP4BlockScaling: {"nvfp4"},
        recipe.CustomRecipe: {"custom"},
    }
    for cls, true_kinds in expected.items():
        assert issubclass(cls, recipe.Recipe)
        assert {k for k in kinds if getattr(cls, k)()} == true_kinds, cls
    assert {k for k in kinds if getattr(made, k)()} == {"mxfp8"}  # on instances too
    assert not isinstance(made, (recipe.DelayedScaling, recipe.Float8CurrentScaling))


def test_te_mxfp8_block_scaling_has_te_fields_in_te_order():
    from te_npu import recipe

    made = recipe.MXFP8BlockScaling(0, recipe.Format.E4M3, False, False, None, False)  # TE's positional order
    assert (made.margin, made.fp8_format, made.fp8_dpa, made.fp8_mha, made.backward_override,
            made.enable_2d_quantization) == (0, recipe.Format.E4M3, False, False, None, False)
    assert [f.name for f in dataclasses.fields(made)][:6] == [
        "margin", "fp8_format", "fp8_dpa", "fp8_mha", "backward_override", "enable_2d_quantization"]
    assert made.fp8_format == "E4M3" and made == MXFP8BlockRecipe(fp8_format="E4M3")
    with pytest.raises(TypeError):  # te_npu's own fields are keyword-only
        recipe.MXFP8BlockScaling(0, "E4M3", False, False, None, False, 32)
    assert MXFP8BlockRecipe(scale_alg="ceil").scale_alg == "ceil"


def test_te_recipe_classes_without_counterpart_refuse_construction_with_reason():
    from te_npu import recipe

    with pytest.raises(ConfigError, match="CustomRecipe is not supported by te_npu: custom quantizer factories"):
        recipe.CustomRecipe(qfactory=lambda role: None)
    with pytest.raises(ConfigError, match="DelayedScaling is not supported"):
        recipe.DelayedScaling()


def test_recipe_record_and_log_phrase_name_the_mxfp8_scale_rule():
    from te_npu.recipe import describe_recipe, recipe_record

    assert recipe_record(MXFP8BlockRecipe()) == {"format": "mxfp8_e4m3", "scale_alg": "ceil"}
    assert recipe_record(MXFP8BlockRecipe(scale_alg="floor")) == {"format": "mxfp8_e4m3", "scale_alg": "floor"}
    assert recipe_record(HiF8CurrentScalingRecipe()) == {"format": "hif8"} and recipe_record(None) is None
    assert "scale_alg=ceil" in describe_recipe(MXFP8BlockRecipe()) and "floor" in describe_recipe(MXFP8BlockRecipe(scale_alg="floor"))


@pytest.mark.parametrize("saved, recipe, expected", [
    ({"format": "mxfp8_e4m3", "scale_alg": "floor"}, MXFP8BlockRecipe(),
     "checkpoint step_4 was trained with MXFP8 scale_alg=floor; this run continues with scale_alg=ceil "
     "(low_precision.scale_alg)"),
    ({"format": "mxfp8_e4m3", "scale_alg": "ceil"}, MXFP8BlockRecipe(scale_alg="floor"),
     "checkpoint step_4 was trained with MXFP8 scale_alg=ceil; this run continues with scale_alg=floor "
     "(low_precision.scale_alg)"),
    ({"format": "mxfp8_e4m3", "scale_alg": "ceil"}, MXFP8BlockRecipe(), None),
    ({"format": "hif8"}, HiF8CurrentScalingRecipe(), None),
    (None, None, None),
    (None, MXFP8BlockRecipe(), "checkpoint step_4 was trained with low precision off (BF16); this run continues "
                               "with format=mxfp8_e4m3 scale_alg=ceil"),
], ids=["floor-to-ceil", "ceil-to-floor", "same", "hif8", "bf16", "bf16-to-mxfp8"])
def test_recipe_change_note_is_one_line_naming_both_rules(saved, recipe, expected):
    from te_npu.recipe import recipe_change_note

    assert recipe_change_note({"step": 4, "low_precision": saved}, recipe, "step_4") == expected


def test_recipe_change_note_for_a_checkpoint_older_than_the_record():
    from te_npu.recipe import recipe_change_note

    note = recipe_change_note({"step": 4}, MXFP8BlockRecipe(), "step_4")
    assert "does not record its MXFP8 scale rule" in note and "scale_alg=floor" in note and note.endswith("scale_alg=ceil")
    assert recipe_change_note({"step": 4}, HiF8CurrentScalingRecipe(), "step_4") is None
    assert recipe_change_note({"step": 4}, None, "step_4") is None
