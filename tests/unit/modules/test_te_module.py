"""What every TE module shares (``te_npu.modules.base.TEModule``), checked on each of them:
recompute, quantized weights, state dicts, the meta-device rule, and the npu backend through
the fake torch_npu."""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import te_npu
from te_npu import HiF8CurrentScalingRecipe, LowPrecisionUnavailableError, MXFP8BlockRecipe
from te_npu.events import QuantEvent, subscribe
from te_npu.tensor import QuantizedWeightTensor
from tests.unit.functional.gemm_reference import RECIPES
from tests.seeded import BF16_NO_BIAS


def _module(kind, init, experts_init):
    """(module, input shape, extra forward args) of one TE module kind."""
    if kind == "dense":
        return te_npu.TELinear(64, 96, bias=True, init_method=init, params_dtype=torch.bfloat16), (2, 32, 64), ()
    if kind == "grouped":
        return te_npu.TEGroupedLinear(4, 64, 96, init_method=init, **BF16_NO_BIAS), (100, 64), ([40, 0, 55, 5],)
    return te_npu.TEGroupedSwiGLUExperts(4, 64, 32, init_method=experts_init), (100, 64), ([40, 0, 55, 5],)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", ["dense", "grouped", "swiglu"])
@pytest.mark.parametrize("checkpoint_fn", [te_npu.checkpoint, lambda *a: checkpoint(*a, use_reentrant=False)],
                         ids=["te_npu.checkpoint", "torch.utils.checkpoint"])
def test_te_modules_recompute_bitwise_and_its_weight_quantizations(recipe, kind, checkpoint_fn, rand, init,
                                                                   experts_init):
    """Recompute is bitwise the plain run. A high-precision weight costs one more quantization
    per recomputed call by default (is_first_microbatch=None), none with True (the recompute
    reuses what its forward kept) or False; a quantized weight never is quantized."""
    module, x_shape, extra = _module(kind, init, experts_init)
    x = rand(*x_shape)
    weight_shapes = {tuple(p.shape) for p in module.parameters() if p.dim() >= 2}
    weights = len(module._weight_names)

    def run(use_checkpoint, flag=None):
        module.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        events = []
        with subscribe(events.append):
            with te_npu.autocast(recipe=recipe):
                if use_checkpoint:
                    y = checkpoint_fn(functools.partial(module, is_first_microbatch=flag), xi, *extra)
                else:
                    y = module(xi, *extra, is_first_microbatch=flag)
            y.float().pow(2).sum().backward()
        quants = len([e for e in events if isinstance(e, QuantEvent) and e.shape in weight_shapes])
        return xi.grad, [p.grad.clone() for p in module.parameters()], quants

    plain = run(False)
    for flag, extra_quantizations in ((None, weights), (True, 0), (False, 0)):
        recomputed = run(True, flag)
        assert torch.equal(plain[0], recomputed[0])
        assert all(torch.equal(a, b) for a, b in zip(plain[1], recomputed[1]))
        assert recomputed[2] == (0 if flag is False else weights) + extra_quantizations, flag
    te_npu.quantize_weights_(module, recipe)
    assert run(True)[2] == 0 and run(False)[2] == 0
    assert set(module.state_dict()) == {n for n, _ in module.named_parameters()} and not list(module.buffers())


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("how", ["quantized_model_init", "quantize_weights_"])
def test_te_modules_quantized_weights(recipe, how, rand, init, experts_init):
    def build():
        return torch.nn.ModuleDict({"lin": te_npu.TELinear(64, 96, bias=True, init_method=init, params_dtype=torch.bfloat16),
                                    "experts": te_npu.TEGroupedSwiGLUExperts(4, 64, 32, init_method=experts_init)})

    if how == "quantized_model_init":
        with te_npu.quantized_model_init(recipe=recipe):
            model = build()
    else:
        model = build()
        te_npu.quantize_weights_(model, recipe)
    assert isinstance(model["lin"].weight, QuantizedWeightTensor) and isinstance(model["lin"].weight, torch.nn.Parameter)
    assert not isinstance(model["lin"].bias, QuantizedWeightTensor)
    assert isinstance(model["experts"].down_proj, QuantizedWeightTensor)
    assert list(model.state_dict()) == ["lin.weight", "lin.bias", "experts.gate_up_proj", "experts.down_proj"]
    events = []
    with subscribe(events.append):
        for _ in range(2):
            with te_npu.autocast(recipe=recipe):
                y = model["lin"](rand(32, 64)).float().sum() + model["experts"](rand(20, 64), [5, 0, 15, 0]).float().sum()
            y.backward()
    assert not [e for e in events if isinstance(e, QuantEvent) and (len(e.shape) == 3 or e.shape == (96, 64))]
    assert model["lin"].weight.grad.shape == (96, 64) and model["lin"].weight.grad.dtype == torch.bfloat16
    assert model["experts"].gate_up_proj.grad.shape == (4, 64, 64)
    # outside autocast the BF16 baseline uses weight.dequantize()
    x = rand(8, 64)
    torch.testing.assert_close(model["lin"](x), F.linear(x, model["lin"].weight.dequantize(), model["lin"].bias))
    other = HiF8CurrentScalingRecipe() if recipe.format.value == "mxfp8_e4m3" else MXFP8BlockRecipe()
    te_npu.assign_fqns(model)
    with pytest.raises(LowPrecisionUnavailableError, match=rf"lin: weight is stored as {recipe.format.value}.*"
                                                           rf"requests {other.format.value}"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with te_npu.autocast(recipe=other):
                model["lin"](rand(32, 64))


@pytest.mark.parametrize("recipe", RECIPES)
def test_te_modules_run_npu_backend_through_fake(recipe, rand, init, monkeypatch):
    """The npu wrappers (te_npu.ops.npu) run on CPU through the vendor-faithful fake torch_npu
    (te_npu.ops.force_backend("npu")): every GEMM and quantization of one fwd+bwd goes to
    torch_npu ops, and the result equals the emulation bitwise."""
    from te_npu.ops import force_backend
    from tests.npu_backend import install_npu_backend

    lin = te_npu.TELinear(64, 96, init_method=init, bias=False, params_dtype=torch.bfloat16)
    experts = te_npu.TEGroupedLinear(4, 64, 96, init_method=init, bias=False, params_dtype=torch.bfloat16)
    x, xg = rand(32, 64), rand(100, 64)

    def step():
        lin.zero_grad(), experts.zero_grad()
        xi, xgi = x.clone().requires_grad_(), xg.clone().requires_grad_()
        with te_npu.autocast(recipe=recipe):
            y = lin(xi).float().sum() + experts(xgi, [40, 0, 55, 5]).float().sum()
        y.backward()
        return [xi.grad, xgi.grad, lin.weight.grad, experts.weight.grad]

    expected = step()
    fake = install_npu_backend(monkeypatch)
    for module in (lin, experts):
        for cache in module._weight_caches.values():
            cache.clear()
    events = []
    with subscribe(events.append, QuantEvent, te_npu.events.GemmEvent), force_backend("npu"):
        got = step()
    assert {e.backend for e in events} == {"npu"}
    assert len(fake.calls_of("npu_quant_matmul")) == 3 and len(fake.calls_of("npu_grouped_matmul")) == 3
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", RECIPES)
def test_meta_module_inside_quantized_model_init_raises_instead_of_staying_high_precision(recipe, init):
    with te_npu.quantized_model_init(recipe=recipe), torch.device("meta"):
        with pytest.raises(ValueError, match="TELinear built on the meta device inside te_npu.quantized_model_init"):
            te_npu.TELinear(64, 96, bias=False, params_dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="TEGroupedLinear built on the meta device"):
            te_npu.TEGroupedLinear(4, 64, 96, bias=False, params_dtype=torch.bfloat16)
    # the supported route: meta build outside, materialize, then convert
    with torch.device("meta"):
        layer = te_npu.TELinear(64, 96, bias=False, params_dtype=torch.bfloat16)
    layer = layer.to_empty(device="cpu")
    init(layer.weight)
    te_npu.quantize_weights_(layer, recipe)
    assert isinstance(layer.weight, QuantizedWeightTensor)
