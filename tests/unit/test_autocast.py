"""autocast / fp8_autocast / quantized_model_init state handling."""
import pytest

import te_npu
from te_npu import HiF8CurrentScalingRecipe, MXFP8BlockRecipe
from te_npu.autocast import get_autocast_state, get_quantized_init_recipe


def test_autocast_is_off_outside_any_context():
    assert not te_npu.is_autocast_enabled()
    assert te_npu.get_autocast_recipe() is None


def test_autocast_defaults_to_mxfp8():
    with te_npu.autocast():
        assert te_npu.is_autocast_enabled()
        assert te_npu.get_autocast_recipe() == MXFP8BlockRecipe()


def test_autocast_nesting_restores_outer_state():
    with te_npu.autocast(recipe=HiF8CurrentScalingRecipe(), amax_reduction_group="g"):
        with te_npu.autocast(enabled=False):
            assert not te_npu.is_autocast_enabled()
            assert te_npu.get_autocast_recipe() is None
            with te_npu.autocast(recipe=MXFP8BlockRecipe()):
                assert te_npu.get_autocast_recipe() == MXFP8BlockRecipe()
            assert not te_npu.is_autocast_enabled()
        assert te_npu.get_autocast_recipe() == HiF8CurrentScalingRecipe()
        assert get_autocast_state().amax_reduction_group == "g"
    assert not te_npu.is_autocast_enabled()


def test_autocast_restores_state_on_exception():
    with pytest.raises(RuntimeError):
        with te_npu.autocast(recipe=HiF8CurrentScalingRecipe()):
            raise RuntimeError("boom")
    assert not te_npu.is_autocast_enabled()


def test_fp8_autocast_alias_maps_te_argument_names():
    with te_npu.fp8_autocast(enabled=True, fp8_recipe=HiF8CurrentScalingRecipe(), fp8_group="grp"):
        state = get_autocast_state()
        assert state.enabled and state.recipe == HiF8CurrentScalingRecipe() and state.amax_reduction_group == "grp"
    with te_npu.fp8_autocast(enabled=False, fp8_recipe=HiF8CurrentScalingRecipe()):
        assert te_npu.get_autocast_recipe() is None


def test_quantized_model_init_nests_and_restores():
    assert get_quantized_init_recipe() is None
    with te_npu.quantized_model_init(recipe=HiF8CurrentScalingRecipe()):
        assert get_quantized_init_recipe() == HiF8CurrentScalingRecipe()
        with te_npu.quantized_model_init(enabled=False):
            assert get_quantized_init_recipe() is None
        with te_npu.quantized_model_init():
            assert get_quantized_init_recipe() == MXFP8BlockRecipe()
    assert get_quantized_init_recipe() is None


# ---- issue 14: one reusable context object, recipes checked at the ``with`` line --------------

def test_autocast_object_is_reusable_and_safely_re_entrant():
    ctx = te_npu.autocast(recipe=HiF8CurrentScalingRecipe())
    for _ in range(2):  # sequential reuse (a generator context would fail the second time)
        with ctx as entered:
            assert entered is ctx and te_npu.get_autocast_recipe() == HiF8CurrentScalingRecipe()
        assert not te_npu.is_autocast_enabled()
    with ctx:  # nested re-entry of the same object
        with te_npu.autocast(enabled=False):
            with ctx:
                assert te_npu.get_autocast_recipe() == HiF8CurrentScalingRecipe()
            assert not te_npu.is_autocast_enabled()
        assert te_npu.is_autocast_enabled()
    assert not te_npu.is_autocast_enabled()
    init = te_npu.quantized_model_init(recipe=MXFP8BlockRecipe())
    for _ in range(2):
        with init:
            assert get_quantized_init_recipe() == MXFP8BlockRecipe()
    assert get_quantized_init_recipe() is None


def test_autocast_exit_out_of_order_raises():
    outer, inner = te_npu.autocast(), te_npu.autocast(enabled=False)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="out of order"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    assert not te_npu.is_autocast_enabled()


@pytest.mark.parametrize("enter", [
    pytest.param(lambda r: te_npu.autocast(recipe=r), id="autocast"),
    pytest.param(lambda r: te_npu.fp8_autocast(fp8_recipe=r), id="fp8_autocast"),
    pytest.param(lambda r: te_npu.quantized_model_init(recipe=r), id="quantized_model_init"),
    pytest.param(lambda r: te_npu.fp8_model_init(recipe=r), id="fp8_model_init"),
])
def test_unsupported_recipe_fails_at_entry_with_a_clear_error(enter):
    class DelayedScaling:  # e.g. a Transformer Engine recipe object
        pass

    with pytest.raises(TypeError, match=r"recipe must be a te_npu recipe .*got .*DelayedScaling"):
        enter(DelayedScaling())
    assert not te_npu.is_autocast_enabled() and get_quantized_init_recipe() is None


def test_fp8_autocast_takes_te_positional_order_and_refuses_calibration():
    with te_npu.fp8_autocast(True, False, HiF8CurrentScalingRecipe()):  # TE: enabled, calibrating, fp8_recipe
        assert te_npu.get_autocast_recipe() == HiF8CurrentScalingRecipe()
    with pytest.raises(te_npu.ConfigError, match="calibrating"):
        te_npu.fp8_autocast(calibrating=True)
    with pytest.raises(te_npu.ConfigError, match="calibrating"):
        te_npu.autocast(calibrating=True)
    with pytest.raises(te_npu.ConfigError, match="_graph"):
        te_npu.fp8_autocast(_graph=True)
    assert te_npu.fp8_model_init is te_npu.quantized_model_init


# ---- issue 20: TE's positional order autocast(enabled, calibrating, recipe, amax_reduction_group, _graph)

def test_autocast_takes_te_positional_order():
    group = object()
    with te_npu.autocast(True, False, HiF8CurrentScalingRecipe(), group, False):
        assert te_npu.get_autocast_recipe() == HiF8CurrentScalingRecipe()
        assert get_autocast_state().amax_reduction_group is group
    with pytest.raises(te_npu.ConfigError, match="_graph"):
        te_npu.autocast(True, False, None, None, True)


@pytest.mark.parametrize("call", [
    pytest.param(lambda r: te_npu.autocast(r), id="recipe-as-enabled"),
    pytest.param(lambda r: te_npu.autocast(True, r), id="recipe-as-calibrating"),
    pytest.param(lambda r: te_npu.fp8_autocast(True, r), id="fp8_autocast-recipe-as-calibrating"),
    pytest.param(lambda r: te_npu.quantized_model_init(r), id="quantized_model_init-recipe-as-enabled"),
])
def test_autocast_refuses_a_recipe_in_a_flag_position(call):
    """te_npu's former order put the recipe second; in TE's order it would land in a flag and
    silently run the default recipe: refused, naming TE's order."""
    with pytest.raises(TypeError, match=r"must be a bool, got HiF8CurrentScalingRecipe; the positional order is "
                                        r"Transformer Engine's \(enabled, "):
        call(HiF8CurrentScalingRecipe())
    assert not te_npu.is_autocast_enabled() and get_quantized_init_recipe() is None
