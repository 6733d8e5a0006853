"""A low-precision training step never makes the host wait for the device.

On CUDA / NPU each host read drains the stream; the emulation's BF16 plan and the NPU path
share every check and layout computation that could read one. Counted by op with
``te_npu.ops.host_syncs`` (so this runs on CPU), on both emulation plans.
"""
from __future__ import annotations

import pytest
import torch

import te_npu
from te_npu import HiF8CurrentScalingRecipe, MXFP8BlockRecipe
from te_npu.ops import emulation
from te_npu.ops.host_syncs import count_host_syncs

RECIPES = [MXFP8BlockRecipe(), HiF8CurrentScalingRecipe()]
SPLITS = [10, 0, 57, 33]


@pytest.fixture(params=["fp32_plan", "bf16_plan"])
def plan(request, monkeypatch):
    if request.param == "bf16_plan":
        monkeypatch.setattr(emulation, "BF16_GEMM_DEVICES", frozenset({"cuda", "cpu"}))
    return request.param


def _step(module, recipe, *args):
    x = args[0]
    with count_host_syncs() as syncs:
        with te_npu.autocast(recipe=recipe):
            y = module(*args)
        y.float().square().sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in module.parameters())
    return syncs


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_linear_step_makes_no_host_sync(recipe, plan, rand):
    layer = te_npu.TELinear(256, 128, bias=True)
    syncs = _step(layer, recipe, rand(64, 256, requires_grad=True))
    assert syncs.total == 0, syncs.calls


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_grouped_linear_step_with_host_splits_makes_no_host_sync(recipe, plan, rand):
    layer = te_npu.TEGroupedLinear(len(SPLITS), 256, 128)
    syncs = _step(layer, recipe, rand(sum(SPLITS), 256, requires_grad=True), SPLITS)
    assert syncs.total == 0, syncs.calls


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_swiglu_experts_read_device_splits_once(recipe, plan, rand):
    """Router output on the device (``moe.permute``'s m_splits): one read for all six GEMMs."""
    experts = te_npu.TEGroupedSwiGLUExperts(len(SPLITS), 128, 64)
    syncs = _step(experts, recipe, rand(sum(SPLITS), 128, requires_grad=True), torch.tensor(SPLITS))
    assert syncs.calls == {"tolist": 1}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's own sync detector: needs a CUDA device")
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_cuda_steps_make_no_host_sync(recipe):
    """The same claim checked by CUDA itself: ``set_sync_debug_mode("error")`` raises on any
    synchronizing call (a warm-up step first: weight quantization and compiles may sync)."""
    torch.manual_seed(0)
    layer = te_npu.TELinear(256, 128, device="cuda")
    experts = te_npu.TEGroupedLinear(len(SPLITS), 256, 128, device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    xg = torch.randn(sum(SPLITS), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        with te_npu.autocast(recipe=recipe):
            loss = layer(x).float().square().sum() + experts(xg, SPLITS).float().square().sum()
        loss.backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
