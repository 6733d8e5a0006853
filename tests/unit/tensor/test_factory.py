"""``quantize_weight``: the recipe's format picks the weight class and its weight quantizer."""
import pytest
import torch

from te_npu.formats import QuantizationRole
from te_npu.recipe import HiF8CurrentScalingRecipe, MXFP8BlockRecipe
from te_npu.tensor import HiF8Tensor, MXFP8Tensor, quantize_weight


@pytest.mark.parametrize(
    "recipe, cls",
    [
        pytest.param(MXFP8BlockRecipe(), MXFP8Tensor, id="mxfp8"),
        pytest.param(MXFP8BlockRecipe(scale_alg="ceil"), MXFP8Tensor, id="mxfp8_ceil"),
        pytest.param(HiF8CurrentScalingRecipe(), HiF8Tensor, id="hif8"),
    ],
)
@pytest.mark.parametrize("shape", [(64, 32), (2, 64, 32)], ids=["dense", "grouped"])
def test_quantize_weight_picks_class_by_recipe_format(make_weight, assert_same_payload, recipe, cls, shape):
    w = make_weight(*shape)
    t = quantize_weight(w, recipe)
    assert type(t) is cls and t.shape == w.shape and t.dtype == w.dtype and not t.requires_grad
    assert t._quantizer == recipe.quantizer(QuantizationRole.WEIGHT_FWD)
    assert_same_payload(t, cls.from_high_precision(w, recipe.quantizer(QuantizationRole.WEIGHT_FWD)))


def test_quantize_weight_rejects_unknown_recipe(make_weight):
    with pytest.raises(ValueError, match="no quantized weight tensor"):
        quantize_weight(make_weight(32, 32), object())
