"""TEGroupedLinear: the plain path is one ``F.linear`` per row group; its GEMMs report their
operands under the module's FQN, with one HiF8 weight scale per group."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import te_npu
from te_npu import HiF8CurrentScalingRecipe
from te_npu.events import GemmEvent, OperandEvent, subscribe
from te_npu.formats import QuantizationRole as Role
from tests.unit.functional.gemm_reference import RECIPES

SPLITS = [40, 0, 55, 5]


def test_te_grouped_linear_plain_path_is_one_f_linear_per_group(rand, init):
    layer = te_npu.TEGroupedLinear(len(SPLITS), 64, 96, init_method=init)
    x = rand(sum(SPLITS), 64)
    want = torch.cat([F.linear(chunk, w) for chunk, w in zip(torch.split(x, SPLITS), layer.weight)])
    for splits in (SPLITS, torch.tensor(SPLITS)):
        torch.testing.assert_close(layer(x, splits), want, rtol=0, atol=0)
    assert list(layer.state_dict()) == ["weight"] and layer.weight.shape == (4, 96, 64)


def test_te_grouped_linear_refuses_bias():
    with pytest.raises(ValueError, match="bias=True is not supported"):
        te_npu.TEGroupedLinear(4, 64, 96, bias=True)


@pytest.mark.parametrize("recipe", RECIPES)
def test_te_grouped_linear_reports_grouped_gemms_and_operands_under_its_fqn(recipe, rand, init):
    model = torch.nn.ModuleDict({"experts": te_npu.TEGroupedLinear(len(SPLITS), 64, 96, init_method=init)})
    te_npu.assign_fqns(model)
    with torch.no_grad():
        model["experts"].weight[2] *= 100  # one expert far larger: its own HiF8 scale
    seen = []
    with subscribe(seen.append, OperandEvent, GemmEvent), te_npu.autocast(recipe=recipe):
        model["experts"](rand(sum(SPLITS), 64, requires_grad=True), SPLITS).float().sum().backward()
    gemms = [e for e in seen if isinstance(e, GemmEvent)]
    assert [(e.kind, e.gemm, e.num_groups) for e in gemms] == [("grouped", g, 4) for g in ("fprop", "dgrad", "wgrad")]
    operands = {e.role: e for e in seen if isinstance(e, OperandEvent)}
    assert set(operands) == set(Role) and {e.module for e in seen if isinstance(e, OperandEvent)} == {"experts"}
    if isinstance(recipe, HiF8CurrentScalingRecipe):
        weight = model["experts"].weight.detach()
        assert operands[Role.WEIGHT_FWD].scale.shape == (4,)
        torch.testing.assert_close(operands[Role.WEIGHT_FWD].amax, weight.abs().float().amax(dim=(1, 2)))
