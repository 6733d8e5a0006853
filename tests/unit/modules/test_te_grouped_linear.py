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
from tests.seeded import BF16_NO_BIAS, seeded_init
from tests.unit.functional.gemm_reference import RECIPES

SPLITS = [40, 0, 55, 5]


def test_te_grouped_linear_plain_path_is_one_f_linear_per_group(rand, init):
    layer = te_npu.TEGroupedLinear(len(SPLITS), 64, 96, init_method=init, **BF16_NO_BIAS)
    x = rand(sum(SPLITS), 64)
    want = torch.cat([F.linear(chunk, w) for chunk, w in zip(torch.split(x, SPLITS), layer.weight)])
    for splits in (SPLITS, torch.tensor(SPLITS)):
        torch.testing.assert_close(layer(x, splits), want, rtol=0, atol=0)
    assert list(layer.state_dict()) == ["weight"] and layer.weight.shape == (4, 96, 64)


# ---- issue 20: TE's bias, state-dict keys, stride-0 gradients, meta --------------------------------

def _biased(**kw):
    layer = te_npu.TEGroupedLinear(len(SPLITS), 64, 96, init_method=seeded_init(0), params_dtype=torch.bfloat16, **kw)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(len(SPLITS), 96, generator=torch.Generator().manual_seed(3)))
    return layer


def test_te_grouped_linear_plain_bias_is_one_f_linear_per_group(rand):
    layer = _biased()
    x = rand(sum(SPLITS), 64, requires_grad=True)
    want = torch.cat([F.linear(c, w, b) for c, w, b in zip(torch.split(x, SPLITS), layer.weight, layer.bias)])
    y = layer(x, SPLITS)
    assert torch.equal(y, want)
    y.float().sum().backward()
    sums = torch.stack([torch.ones(n, 96, dtype=torch.bfloat16).sum(0) for n in SPLITS])
    assert torch.equal(layer.bias.grad, sums)  # an empty group's bias gets a zero gradient


@pytest.mark.parametrize("recipe", RECIPES)
def test_te_grouped_linear_8bit_bias_is_added_to_the_fp32_product(recipe, rand):
    """Row group g adds bias[g] to the FP32 GEMM result, rounded once (as TELinear does); its
    gradient is the FP32 sum of the group's dY rows."""
    layer, unbiased = _biased(), te_npu.TEGroupedLinear(len(SPLITS), 64, 96, bias=False)
    unbiased.weight = torch.nn.Parameter(layer.weight.detach().clone())
    x, dy = rand(sum(SPLITS), 64, requires_grad=True), rand(sum(SPLITS), 96)
    with te_npu.autocast(recipe=recipe):
        y = layer(x, SPLITS)
        y32 = unbiased(x.detach().float(), SPLITS)  # the same codes (x is bf16), an FP32 product
    rows = torch.repeat_interleave(layer.bias.detach().float(), torch.tensor(SPLITS), dim=0)
    assert torch.equal(y, (y32 + rows).to(torch.bfloat16))
    y.backward(dy)
    want = torch.stack([c.sum(0, dtype=torch.float32) for c in dy.split(SPLITS)]).to(torch.bfloat16)
    assert torch.equal(layer.bias.grad, want)


@pytest.mark.parametrize("recipe", [None, *RECIPES])
def test_te_grouped_linear_return_bias_returns_one_bias_per_gemm(recipe, rand):
    layer, plain = _biased(return_bias=True), te_npu.TEGroupedLinear(len(SPLITS), 64, 96, bias=False,
                                                                     params_dtype=torch.bfloat16)
    plain.load_state_dict({"weight": layer.weight.detach()})
    x = rand(sum(SPLITS), 64)
    with te_npu.autocast(enabled=recipe is not None, recipe=recipe):
        out, biases = layer(x, SPLITS)
        assert torch.equal(out, plain(x, SPLITS))
    assert len(biases) == len(SPLITS) and all(torch.equal(b, layer.bias[g]) for g, b in enumerate(biases))


def test_te_grouped_linear_loads_and_writes_te_per_gemm_state_dict_keys(rand):
    """TE's GroupedLinear holds weight0..weight{G-1} / bias0.. and an empty _extra_state."""
    layer = _biased()
    te_keys = layer.te_state_dict()
    assert list(te_keys) == [*(f"weight{g}" for g in range(4)), *(f"bias{g}" for g in range(4)), "_extra_state"]
    assert te_keys["weight2"].shape == (96, 64) and te_keys["_extra_state"].numel() == 0
    fresh = te_npu.TEGroupedLinear(len(SPLITS), 64, 96, params_dtype=torch.bfloat16)
    fresh.load_state_dict({k: v.clone() for k, v in te_keys.items()})  # strict: every key consumed
    assert torch.equal(fresh.weight, layer.weight) and torch.equal(fresh.bias, layer.bias)
    x = rand(sum(SPLITS), 64)
    assert torch.equal(fresh(x, SPLITS), layer(x, SPLITS))
    with te_npu.quantized_model_init(recipe=HiF8CurrentScalingRecipe()):
        quantized = te_npu.TEGroupedLinear(len(SPLITS), 64, 96, params_dtype=torch.bfloat16)
    quantized.load_state_dict(te_keys)
    assert torch.equal(quantized.weight.dequantize(), te_npu.tensor.quantize_weight(layer.weight.detach(),
                                                                                    HiF8CurrentScalingRecipe()).dequantize())
    assert torch.equal(quantized.te_state_dict()["weight1"], quantized.weight.dequantize()[1])
    partial = {k: v for k, v in te_keys.items() if k != "weight3"}
    with pytest.raises(KeyError, match=r"3 of the 4 per-GEMM weight entries; missing \['weight3'\]"):
        fresh.load_state_dict(partial)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_te_grouped_linear_plain_backward_takes_a_stride_0_gradient(dtype, rand):
    """``y.sum().backward()`` sends an expanded (stride-0) gradient, which torch's CPU
    ``_grouped_mm`` backward rejects; the result equals the backward of a contiguous one."""
    layer = te_npu.TEGroupedLinear(len(SPLITS), 64, 96, bias=False, params_dtype=dtype, init_method=seeded_init(0))
    x = rand(sum(SPLITS), 64, dtype=dtype, requires_grad=True)
    layer(x, SPLITS).sum().backward()
    got = (x.grad.clone(), layer.weight.grad.clone())
    x.grad, layer.weight.grad = None, None
    layer(x, SPLITS).backward(torch.ones(sum(SPLITS), 96, dtype=dtype))
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], layer.weight.grad)


def test_te_grouped_linear_on_meta_gives_the_output_shape_and_refuses_meta_splits_elsewhere():
    layer = te_npu.TEGroupedLinear(2, 64, 96, device="meta")
    x = torch.empty(40, 64, device="meta")
    out = layer(x, torch.empty(2, dtype=torch.int64, device="meta"))
    assert out.is_meta and out.shape == (40, 96)
    for recipe in (None, *[p.values[0] for p in RECIPES]):
        with pytest.raises(ValueError, match="m_splits is a meta tensor: it holds no group sizes"):
            with te_npu.autocast(enabled=recipe is not None, recipe=recipe):
                te_npu.TEGroupedLinear(2, 64, 96)(torch.zeros(40, 64), torch.empty(2, dtype=torch.int64, device="meta"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_te_grouped_linear_reports_grouped_gemms_and_operands_under_its_fqn(recipe, rand, init):
    model = torch.nn.ModuleDict({"experts": te_npu.TEGroupedLinear(len(SPLITS), 64, 96, init_method=init, **BF16_NO_BIAS)})
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
