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
