"""TEGroupedSwiGLUExperts: the plain path is ``down(silu(gate) * up)`` per expert in the Hugging
Face layout (gate rows first); its two GEMMs report as ``<fqn>.gate_up_proj`` / ``.down_proj``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import te_npu
from te_npu.events import OperandEvent, subscribe
from te_npu.formats import QuantizationRole as Role
from tests.unit.functional.gemm_reference import RECIPES

SPLITS = [40, 0, 55, 5]


def test_te_grouped_swiglu_experts_plain_path_is_the_per_expert_hf_mlp(rand, experts_init):
    experts = te_npu.TEGroupedSwiGLUExperts(len(SPLITS), 64, 32, init_method=experts_init)
    assert experts.gate_up_proj.shape == (4, 64, 64) and experts.down_proj.shape == (4, 64, 32)
    x = rand(sum(SPLITS), 64)
    rows = []
    for chunk, gate_up, down in zip(torch.split(x, SPLITS), experts.gate_up_proj, experts.down_proj):
        gate, up = F.linear(chunk, gate_up).chunk(2, dim=-1)  # HF: gate rows [0, F), up rows [F, 2F)
        rows.append(F.linear(F.silu(gate) * up, down))
    torch.testing.assert_close(experts(x, SPLITS), torch.cat(rows), rtol=0, atol=0)
    assert list(experts.state_dict()) == ["gate_up_proj", "down_proj"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_te_grouped_swiglu_experts_report_each_gemm_under_its_projection(recipe, rand, experts_init):
    model = torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict(
        {"experts": te_npu.TEGroupedSwiGLUExperts(len(SPLITS), 64, 32, init_method=experts_init)})})
    te_npu.assign_fqns(model)
    operands = []
    with subscribe(operands.append, OperandEvent), te_npu.autocast(recipe=recipe):
        model["mlp"]["experts"](rand(sum(SPLITS), 64, requires_grad=True), SPLITS).float().sum().backward()
    by_gemm = {}
    for e in operands:
        by_gemm.setdefault(e.module, set()).add(e.role)
    assert by_gemm == {"mlp.experts.gate_up_proj": set(Role), "mlp.experts.down_proj": set(Role)}
    shapes = {(e.module, e.role): e.shape for e in operands}
    assert shapes["mlp.experts.gate_up_proj", Role.WEIGHT_FWD] == (4, 64, 64)
    assert shapes["mlp.experts.down_proj", Role.INPUT_FWD] == (sum(SPLITS), 32)  # silu(gate) * up
