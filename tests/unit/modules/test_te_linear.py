"""TELinear: the plain path, TE's weight caching across micro-batches, error naming, and the
operands its GEMMs report (``te_npu.events.OperandEvent``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import te_npu
from te_npu import HiF8CurrentScalingRecipe, LowPrecisionUnavailableError, MXFP8BlockRecipe
from te_npu.events import GemmEvent, OperandEvent, QuantEvent, subscribe
from te_npu.formats import QuantizationRole as Role
from tests.unit.functional.gemm_reference import RECIPES
from tests.seeded import BF16_NO_BIAS


def _weight_quantizations(events, shape):
    return [e for e in events if isinstance(e, QuantEvent) and e.shape == tuple(shape)]


def test_te_linear_plain_path_is_f_linear(rand, init):
    lin = te_npu.TELinear(64, 96, bias=True, init_method=init, params_dtype=torch.bfloat16)
    x = rand(8, 64)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    with te_npu.autocast(enabled=False):
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    assert list(lin.state_dict()) == ["weight", "bias"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_te_linear_micro_batches_quantize_weight_per_forward_unless_is_first_microbatch(recipe, rand, init):
    """TE's model: a high-precision weight is quantized by every forward by default; with
    is_first_microbatch True then False it is quantized once per step."""
    lin = te_npu.TELinear(64, 96, init_method=init, bias=False, params_dtype=torch.bfloat16)

    def step(flags):
        events = []
        with subscribe(events.append):
            for flag in flags:  # micro-batches, gradients accumulate
                with te_npu.autocast(recipe=recipe):
                    y = lin(rand(32, 64, requires_grad=True), is_first_microbatch=flag)
                y.float().sum().backward()
        return events

    events = step([None, None, None])
    assert len(_weight_quantizations(events, (96, 64))) == 3
    assert len([e for e in events if isinstance(e, GemmEvent)]) == 9
    assert len(_weight_quantizations(step([True, False, False]), (96, 64))) == 1
    assert list(lin.state_dict()) == ["weight"] and not list(lin.buffers())
    with torch.no_grad():  # an optimizer step in place: the next step starts with True again
        lin.weight.add_(0.01)
    assert len(_weight_quantizations(step([True, False]), (96, 64))) == 1
    with torch.no_grad():  # ... and a False that sees the version change quantizes anyway
        lin.weight.add_(0.01)
    assert len(_weight_quantizations(step([False, False]), (96, 64))) == 1


def test_te_linear_error_names_fqn_and_recipe_change_warns(rand):
    model = torch.nn.Sequential(torch.nn.Identity(), te_npu.TELinear(64, 96, **BF16_NO_BIAS))
    te_npu.assign_fqns(model)
    with pytest.raises(LowPrecisionUnavailableError, match=r"^1: mxfp8_e4m3 GEMM cannot run: input \[40, 64\] \(M=40"):
        with te_npu.autocast(recipe=MXFP8BlockRecipe()):
            model(rand(40, 64, requires_grad=True))
    with te_npu.autocast(recipe=MXFP8BlockRecipe()):
        model(rand(32, 64))
    with pytest.warns(UserWarning, match="recipe changed from MXFP8BlockRecipe to HiF8CurrentScalingRecipe"):
        with te_npu.autocast(recipe=HiF8CurrentScalingRecipe()):
            model(rand(32, 64))


@pytest.mark.parametrize("recipe", RECIPES)
def test_te_linear_reports_every_role_operand_with_its_fqn(recipe, rand):
    """One forward + backward reports an ``OperandEvent`` for every role, named by the module's
    FQN, with detached scales: HiF8 amax = the tensor's amax, gradient scale amax / 224; MXFP8
    E8M0 codes and no single amax. (What a module's ``quant_stats`` dict used to hold.)"""
    model = torch.nn.Sequential(te_npu.TELinear(64, 96, bias=False, params_dtype=torch.bfloat16))
    te_npu.assign_fqns(model)
    x = rand(32, 64, requires_grad=True)
    operands = []
    with subscribe(operands.append, OperandEvent), te_npu.autocast(recipe=recipe):
        model(x).float().sum().backward()
    assert {e.module for e in operands} == {"0"}
    latest = {e.role: e for e in operands}
    assert set(latest) == set(Role)
    stats = latest[Role.INPUT_FWD]
    assert stats.shape == (32, 64) and not stats.scale.requires_grad
    if recipe.format.value == "hif8":
        torch.testing.assert_close(stats.amax, x.detach().abs().float().amax())
        torch.testing.assert_close(latest[Role.GRAD_OUTPUT].scale, torch.tensor(1 / 224))
    else:
        assert stats.amax is None and stats.scale.dtype == torch.uint8
