"""``te_npu.functional.grouped_linear`` / ``grouped_swiglu`` versus references (spec 16.3)."""
from __future__ import annotations

import pytest
import torch

import te_npu
from te_npu import HiF8CurrentScalingRecipe, LowPrecisionUnavailableError, MXFP8BlockRecipe
from te_npu.formats import QuantizationRole as Role
from te_npu.functional import grouped_linear, grouped_swiglu, linear
from te_npu.events import GemmEvent, OperandEvent, QuantEvent, subscribe
from tests.unit.functional.gemm_reference import RECIPES, fp32_close, grouped_reference, sqnr_db

SPLITS = {
    "uneven": [40, 0, 55, 5],
    "empty_first_last": [0, 64, 36, 0],
    "single": [100],
    "all_empty_but_one": [0, 0, 100, 0],
}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("splits", list(SPLITS.values()), ids=list(SPLITS))
def test_grouped_linear_versus_reference_fp32(recipe, splits, rand):
    g = len(splits)
    x = rand(100, 64, dtype=torch.float32, requires_grad=True)
    w = rand(g, 96, 64, dtype=torch.float32, scale=0.1, requires_grad=True)
    dy = rand(100, 96, dtype=torch.float32)
    y = grouped_linear(x, w, torch.tensor(splits), recipe=recipe)
    y.backward(dy)
    ref_y, ref_dx, ref_dw = grouped_reference(x.detach(), w.detach(), dy, splits, recipe.format)
    assert (y.shape, x.grad.shape, w.grad.shape) == ((100, 96), (100, 64), (g, 96, 64))
    fp32_close(y, ref_y)
    fp32_close(x.grad, ref_dx)
    fp32_close(w.grad, ref_dw)
    for e, size in enumerate(splits):
        if size == 0:
            assert torch.count_nonzero(w.grad[e]) == 0


@pytest.mark.parametrize("splits", [[64, 32, 96], [40, 5, 0, 51]], ids=["blocks", "ragged"])
def test_grouped_linear_mxfp8_equals_per_group_linear_bitwise(splits, rand):
    """A block never crosses a group boundary, so the grouped result is one dense GEMM per group.

    fprop/dgrad: per-group ``linear`` bitwise. wgrad: per-group ``linear`` where the group size is
    a multiple of 32; for ragged groups (40, 5) the dense rule refuses M % 32 != 0, so the
    reference is the same short-last-block quantization of that group alone (``grouped_linear``
    with one group) -- still bitwise.
    """
    recipe = MXFP8BlockRecipe()
    x = rand(sum(splits), 64, requires_grad=True)
    w = rand(len(splits), 96, 64, scale=0.1, requires_grad=True)
    dy = rand(sum(splits), 96)
    grouped_linear(x, w, splits, recipe=recipe).backward(dy)
    start = 0
    for e, size in enumerate(splits):
        rows = slice(start, start + size)
        start += size
        xe = x.detach()[rows].clone().requires_grad_()
        we = w.detach()[e].clone().requires_grad_()
        if size % 32 == 0:
            ye = linear(xe, we, recipe=recipe)
        else:
            ye = grouped_linear(xe, we.unsqueeze(0), [size], recipe=recipe)
        ye.backward(dy[rows])
        y_full = grouped_linear(x.detach(), w.detach(), splits, recipe=recipe)
        assert torch.equal(y_full[rows], ye.detach())
        assert torch.equal(x.grad[rows], xe.grad)
        assert torch.equal(w.grad[e], we.grad if we.grad is not None else torch.zeros_like(we))


def test_grouped_linear_hif8_weight_scale_per_expert(rand):
    w = rand(4, 96, 64, requires_grad=True)
    with torch.no_grad():
        w[2] *= 100
    operands = []
    with subscribe(operands.append, OperandEvent):
        grouped_linear(rand(64, 64), w, [16, 16, 16, 16], recipe=HiF8CurrentScalingRecipe())
    stats = {e.role: e for e in operands}  # the latest operand of each role

    assert stats[Role.WEIGHT_FWD].scale.shape == (4,)
    assert stats[Role.INPUT_FWD].scale.shape == ()
    torch.testing.assert_close(stats[Role.WEIGHT_FWD].amax, w.detach().abs().float().amax(dim=(1, 2)))


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_linear_events(recipe, rand):
    x = rand(100, 64, requires_grad=True)
    w = rand(4, 96, 64, requires_grad=True)
    events = []
    with subscribe(events.append):
        grouped_linear(x, w, [40, 0, 55, 5], recipe=recipe).float().sum().backward()
    gemms = [(e.kind, e.gemm, e.left_shape, e.right_shape, e.num_groups) for e in events if isinstance(e, GemmEvent)]
    assert gemms == [("grouped", "fprop", (100, 64), (4, 96, 64), 4), ("grouped", "dgrad", (100, 96), (4, 96, 64), 4),
                     ("grouped", "wgrad", (100, 96), (100, 64), 4)]
    quants = [(e.shape, e.orientation, e.grouped) for e in events if isinstance(e, QuantEvent)]
    if recipe.format.value == "hif8":  # one quantization per tensor
        assert [q[0] for q in quants] == [(4, 96, 64), (100, 64), (100, 96)]
    else:  # weight dual; X row + ragged col; dY row + ragged col
        assert quants == [((4, 96, 64), "dual", False), ((100, 64), "row", False), ((100, 64), "col", True),
                          ((100, 96), "row", False), ((100, 96), "col", True)]


def test_grouped_linear_mxfp8_feature_dims_raise(rand):
    with pytest.raises(LowPrecisionUnavailableError, match="multiples of 32"):
        grouped_linear(rand(10, 48), rand(2, 64, 48), [5, 5], recipe=MXFP8BlockRecipe(), name="experts")


def test_grouped_linear_bad_splits_raise(rand):
    with pytest.raises(ValueError, match="sum to the 10 input rows"):
        grouped_linear(rand(10, 64), rand(2, 64, 64), [5, 4], recipe=MXFP8BlockRecipe())


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_linear_topk_permute(recipe, rand, gen):
    """Top-2 routing through te_npu.moe.permute: each expert sees its tokens, grads flow back."""
    tokens, experts, k = 48, 4, 2
    h = rand(tokens, 64, requires_grad=True)
    topk = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    permuted, m_splits, row_map = te_npu.moe.permute(h, topk, experts)
    w = rand(experts, 96, 64, scale=0.1, requires_grad=True)
    out = grouped_linear(permuted, w, m_splits, recipe=recipe)
    y = te_npu.moe.unpermute(out, row_map, torch.full((tokens, k), 0.5))
    y.float().sum().backward()
    expected = torch.stack([sum(0.5 * h.detach()[t].float() @ w.detach()[e].float().T for e in topk[t].tolist())
                            for t in range(tokens)])
    assert sqnr_db(y.detach(), expected) >= 25
    assert h.grad.shape == h.shape and w.grad.shape == w.shape


@pytest.mark.parametrize("recipe, grad_floor", [(MXFP8BlockRecipe(), 25.0), (HiF8CurrentScalingRecipe(), 24.0)],
                         ids=["mxfp8", "hif8"])
def test_grouped_linear_sqnr(recipe, grad_floor, rand):
    """>= 25 dB against FP32 per-group GEMMs of the same bf16 inputs; HiF8 gradient GEMMs on a
    Gaussian dY sit at ~24.5 dB, the limit of its 2-mantissa-bit band (see test_linear)."""
    x = rand(200, 128, requires_grad=True)
    w = rand(4, 96, 128, scale=0.05, requires_grad=True)
    dy = rand(200, 96)
    splits = [70, 0, 97, 33]
    y = grouped_linear(x, w, splits, recipe=recipe)
    y.backward(dy)
    xf, wf, dyf = x.detach().float(), w.detach().float(), dy.float()
    chunks = torch.split(torch.arange(200), splits)
    ys = torch.cat([xf[c] @ wf[e].T for e, c in enumerate(chunks)])
    dxs = torch.cat([dyf[c] @ wf[e] for e, c in enumerate(chunks)])
    dws = torch.stack([dyf[c].T @ xf[c] for e, c in enumerate(chunks)])
    assert sqnr_db(y.detach(), ys) >= 25
    assert sqnr_db(x.grad, dxs) >= grad_floor
    assert sqnr_db(w.grad, dws) >= grad_floor


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_swiglu_order_and_reference(recipe, rand):
    """gate_up fprop -> SwiGLU -> down fprop; backward down dgrad/wgrad, then gate_up dgrad/wgrad."""
    x = rand(100, 64, dtype=torch.float32, requires_grad=True)
    gate_up = rand(4, 2 * 32, 64, dtype=torch.float32, scale=0.1, requires_grad=True)
    down = rand(4, 64, 32, dtype=torch.float32, scale=0.1, requires_grad=True)
    splits = [40, 0, 55, 5]
    events = []
    with subscribe(events.append):
        y = grouped_swiglu(x, gate_up, down, splits, recipe=recipe)
        y.sum().backward()
    gemms = [(e.gemm, e.right_shape[-2:] if e.gemm != "wgrad" else e.left_shape) for e in events
             if isinstance(e, GemmEvent)]
    assert gemms == [("fprop", (64, 64)), ("fprop", (64, 32)), ("dgrad", (64, 32)), ("wgrad", (100, 64)),
                     ("dgrad", (64, 64)), ("wgrad", (100, 64))]
    # reference: the same composition with an autograd-free SwiGLU on reference GEMMs
    h_ref = grouped_reference(x.detach(), gate_up.detach(), torch.zeros(100, 64), splits, recipe.format)[0]
    gate, up = h_ref.chunk(2, -1)
    a_ref = torch.nn.functional.silu(gate) * up
    y_ref = grouped_reference(a_ref, down.detach(), torch.zeros(100, 64), splits, recipe.format)[0]
    fp32_close(y.detach(), y_ref)
    assert x.grad.shape == x.shape and gate_up.grad.shape == gate_up.shape and down.grad.shape == down.shape


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_linear_runs_under_inference_mode(recipe, rand):
    layer = te_npu.TEGroupedLinear(4, 64, 32, params_dtype=torch.float32, bias=False)
    x = rand(100, 64)
    with te_npu.autocast(recipe=recipe):
        want = layer(x, [10, 0, 57, 33])
        with torch.inference_mode():
            for splits in ([10, 0, 57, 33], torch.tensor([10, 0, 57, 33])):
                assert torch.equal(layer(x, splits), want)
