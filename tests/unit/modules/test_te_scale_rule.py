"""The MXFP8 scale rule through a TE module: the default recipes compute the round-up rule, and a
quantized weight carries the rule it was quantized with (re-quantized from its high-precision
value under a recipe with the other rule, else the GEMM raises naming both rules and the FQN)."""
from __future__ import annotations

import pytest
import torch

import te_npu
from te_npu import LowPrecisionUnavailableError, MXFP8BlockRecipe
from te_npu.events import QuantEvent, subscribe
from tests.seeded import seeded_init

CEIL, FLOOR = MXFP8BlockRecipe(scale_alg="ceil"), MXFP8BlockRecipe(scale_alg="floor")


def _linear(recipe=None, *, preserve=False, seed=0):
    """TELinear 64 -> 96 (bf16, no bias); quantized under ``recipe`` when given."""
    if recipe is None:
        return te_npu.TELinear(64, 96, init_method=seeded_init(seed), bias=False, params_dtype=torch.bfloat16)
    with te_npu.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=preserve):
        return te_npu.TELinear(64, 96, init_method=seeded_init(seed), bias=False, params_dtype=torch.bfloat16)


def _run(lin, recipe, x):
    """(y, dx, dW) of one forward + backward of ``lin`` on ``x`` under ``recipe``."""
    x = x.detach().clone().requires_grad_(True)
    lin.zero_grad(set_to_none=True)
    with te_npu.autocast(recipe=recipe):
        y = lin(x)
    y.float().square().sum().backward()
    return y.detach(), x.grad, lin.weight.grad


def _bits_equal(a, b) -> bool:
    return all(torch.equal(p.view(torch.int16), q.view(torch.int16)) for p, q in zip(a, b))


@pytest.fixture
def x(rand):
    return rand(64, 64, scale=4.0)


@pytest.mark.parametrize("recipe", [MXFP8BlockRecipe(), te_npu.recipe.MXFP8BlockScaling()],
                         ids=["MXFP8BlockRecipe()", "MXFP8BlockScaling()"])
def test_te_linear_default_recipe_computes_the_ceil_rule_bitwise(recipe, x):
    lin = _linear()
    got = _run(lin, recipe, x)
    assert _bits_equal(got, _run(lin, CEIL, x))
    assert not _bits_equal(got, _run(lin, FLOOR, x))  # the rules differ on these inputs: the test can fail


def test_quantized_weight_carries_its_rule():
    assert _linear(FLOOR).weight.quantizer.scale_alg == "floor"
    assert _linear(MXFP8BlockRecipe()).weight.quantizer.scale_alg == "ceil"


def test_weight_of_the_other_rule_is_requantized_from_its_high_precision_value(x):
    """A floor-quantized weight under the ceil recipe computes what a ceil-quantized one does."""
    floor_weight = _linear(FLOOR, preserve=True)
    events = []
    with subscribe(events.append, QuantEvent):
        got = _run(floor_weight, CEIL, x)
    # the weight: its preserved value checked against the stored row copy (own rule), then
    # re-quantized under the recipe's rule for this call
    assert [e.orientation for e in events if e.shape == (96, 64)] == ["row", "dual"]
    assert _bits_equal(got[:2], _run(_linear(CEIL), CEIL, x)[:2])
    assert floor_weight.weight.quantizer.scale_alg == "floor"  # the stored payload is left as it was
    assert got[2] is not None and got[2].shape == (96, 64)
    same_rule = []
    with subscribe(same_rule.append, QuantEvent):
        _run(floor_weight, FLOOR, x)
    assert not [e for e in same_rule if e.shape == (96, 64)]  # its own rule: the stored payload


def test_weight_of_the_other_rule_without_high_precision_value_raises_naming_both_rules_and_fqn(x):
    model = torch.nn.Sequential(torch.nn.Identity(), _linear(FLOOR))
    te_npu.assign_fqns(model)
    with pytest.raises(LowPrecisionUnavailableError,
                       match=r"^1: weight \[96, 64\] was quantized with MXFP8 scale_alg='floor' but the recipe "
                             r"\(MXFP8BlockRecipe\) computes scale_alg='ceil', and it has no high-precision value"):
        with te_npu.autocast(recipe=CEIL):
            model(x)


def test_weight_changed_since_its_preserved_value_raises_instead_of_using_it(x):
    lin = _linear(FLOOR, preserve=True)
    with torch.no_grad():  # what an optimizer / refresh does: the preserved value is stale now
        lin.weight.copy_(lin.weight.dequantize() * 2)
    with pytest.raises(LowPrecisionUnavailableError, match="no longer quantizes to it"):
        with te_npu.autocast(recipe=CEIL):
            lin(x)


def test_quantize_weights_re_quantizes_a_weight_of_the_other_rule_from_its_preserved_value(x):
    """quantize_weights_ under the ceil recipe turns a floor weight (with its preserved value)
    into the ceil weight quantized_model_init(ceil) builds, bit for bit, keeping the value."""
    lin = _linear(FLOOR, preserve=True)
    te_npu.quantize_weights_(lin, CEIL)
    want = _linear(CEIL)
    assert lin.weight.quantizer.scale_alg == "ceil" and lin.weight.requires_grad
    assert torch.equal(lin.weight.select("row").scale, want.weight.select("row").scale)
    assert torch.equal(lin.weight.select("row").data.view(torch.uint8), want.weight.select("row").data.view(torch.uint8))
    assert lin.weight.get_high_precision_init_val() is not None
    assert _bits_equal(_run(lin, CEIL, x), _run(want, CEIL, x))


def test_quantize_weights_refuses_a_weight_of_the_other_rule_it_cannot_re_quantize():
    lin = _linear(FLOOR)
    with pytest.raises(ValueError, match=r"weight: quantized with MXFP8 scale_alg='floor', the recipe computes "
                                         r"scale_alg='ceil', and it has no high-precision value"):
        te_npu.quantize_weights_(lin, CEIL)
    assert lin.weight.quantizer.scale_alg == "floor"  # left as it was
    stale = _linear(FLOOR, preserve=True)
    with torch.no_grad():
        stale.weight.copy_(stale.weight.dequantize() * 2)
    with pytest.raises(ValueError, match="no longer quantizes to it"):
        te_npu.quantize_weights_(stale, CEIL)


def test_quantize_weights_keeps_a_weight_of_the_same_rule():
    lin = _linear(CEIL)
    before = lin.weight
    te_npu.quantize_weights_(lin, MXFP8BlockRecipe())
    assert lin.weight is before
