"""A low-precision training step never makes the host wait for the device.

On CUDA / NPU each host read drains the stream; the emulation's BF16 plan and the NPU path
share every check and layout computation that could read one. Counted by op with
``te_npu.testing.count_host_syncs`` (so this runs on CPU), on both emulation plans.
"""
from __future__ import annotations

import pytest
import torch

import te_npu
from te_npu import HiF8CurrentScalingRecipe, MXFP8BlockRecipe
from te_npu.ops import emulation
from te_npu import events
from te_npu.testing import count_host_syncs
from tests.seeded import BF16_NO_BIAS, seeded_init, seeded_randn

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
    layer = te_npu.TELinear(256, 128, bias=True, params_dtype=torch.bfloat16)
    syncs = _step(layer, recipe, rand(64, 256, requires_grad=True))
    assert syncs.total == 0, syncs.calls


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_grouped_linear_step_with_host_splits_makes_no_host_sync(recipe, bias, plan, rand):
    """TE's per-GEMM bias too: its rows are expanded with the known total, its gradient summed
    per group from the splits' host mirror."""
    layer = te_npu.TEGroupedLinear(len(SPLITS), 256, 128, bias=bias, params_dtype=torch.bfloat16)
    syncs = _step(layer, recipe, rand(sum(SPLITS), 256, requires_grad=True), SPLITS)
    assert syncs.total == 0, syncs.calls


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_swiglu_experts_read_device_splits_once(recipe, plan, rand):
    """Router output on the device (``moe.permute``'s m_splits): one read for all six GEMMs."""
    experts = te_npu.TEGroupedSwiGLUExperts(len(SPLITS), 128, 64)
    syncs = _step(experts, recipe, rand(sum(SPLITS), 128, requires_grad=True), torch.tensor(SPLITS))
    assert syncs.calls == {"tolist": 1}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_steps_with_every_event_subscribed_make_no_host_sync(recipe, rand):
    """The event stream adds no host read: every event of a step built and delivered (their HiF8
    amax / scale tensors stay on the device; reading an OperandEvent's derived amax is a device op)."""
    layer = te_npu.TELinear(256, 128, bias=True, init_method=seeded_init(0), params_dtype=torch.bfloat16)
    experts = te_npu.TEGroupedSwiGLUExperts(len(SPLITS), 256, 64, init_method=seeded_init(1, std=0.02))
    seen = []

    def subscriber(event):
        seen.append(event)
        if isinstance(event, events.OperandEvent):
            event.amax  # noqa: B018 -- computed on the device

    with events.subscribe(subscriber):
        dense = _step(layer, recipe, rand(64, 256, requires_grad=True))
        grouped = _step(experts, recipe, rand(sum(SPLITS), 256, requires_grad=True), SPLITS)
    assert dense.total == 0 and grouped.total == 0, (dense.calls, grouped.calls)
    kinds = {type(e) for e in seen}
    assert kinds == {events.QuantEvent, events.OperandEvent, events.GemmEvent}, kinds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's own sync detector: needs a CUDA device")
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_cuda_steps_make_no_host_sync(recipe):
    """The same claim checked by CUDA itself: ``set_sync_debug_mode("error")`` raises on any
    synchronizing call (a warm-up step first: weight quantization and compiles may sync)."""
    layer = te_npu.TELinear(256, 128, init_method=seeded_init(0), **BF16_NO_BIAS).to("cuda")
    experts = te_npu.TEGroupedLinear(len(SPLITS), 256, 128, init_method=seeded_init(1), **BF16_NO_BIAS).to("cuda")
    randn = seeded_randn(2)
    x = randn(64, 256).to("cuda").requires_grad_()
    xg = randn(sum(SPLITS), 256).to("cuda").requires_grad_()

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
