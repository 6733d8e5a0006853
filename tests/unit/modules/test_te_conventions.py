"""The call conventions TE and Megatron users bring (issue 14, items 3 and 5): split validation
on every path, ``is_first_microbatch``, ``return_bias``, TE's activation dtype (also under
``torch.autocast``), ``preserve_high_precision_init_val``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import te_npu
from te_npu import HiF8CurrentScalingRecipe, MXFP8BlockRecipe
from tests.seeded import BF16_NO_BIAS, seeded_init
from tests.unit.functional.gemm_reference import RECIPES

PATHS = [None, *RECIPES]
PATH_IDS = ["plain", "mxfp8", "hif8"]


def _ctx(recipe):
    return te_npu.autocast(enabled=recipe is not None, recipe=recipe)


# ---- item 3: group splits are checked on the plain path as on the 8-bit one ---------------------

@pytest.mark.parametrize("recipe", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("module", [lambda: te_npu.TEGroupedLinear(4, 64, 96, **BF16_NO_BIAS),
                                    lambda: te_npu.TEGroupedSwiGLUExperts(4, 64, 32)], ids=["grouped", "swiglu"])
@pytest.mark.parametrize("splits, message", [
    ([25] * 4, r"must be non-negative and sum to the 128 input rows"),   # rows 100-127 in no group
    ([40] * 4, r"must be non-negative and sum to the 128 input rows"),   # past T
    ([64, 64, 16, -16], r"must be non-negative"),
    ([64, 64], r"must hold 4 group sizes, got 2"),
], ids=["short", "past_rows", "negative", "count"])
def test_grouped_modules_check_splits_on_every_path(recipe, module, splits, message, rand):
    layer = module()
    x = rand(128, 64)
    for given in (splits, torch.tensor(splits)):
        with pytest.raises(ValueError, match=message), _ctx(recipe):
            layer(x, given)


# ---- item 5: is_first_microbatch, return_bias -----------------------------------------------------

@pytest.mark.parametrize("recipe", PATHS, ids=PATH_IDS)
def test_te_modules_take_is_first_microbatch_like_megatron(recipe, rand, init, experts_init):
    """Megatron passes is_first_microbatch to every TE forward; results equal the default call."""
    x = rand(32, 64)
    for module, args in ((te_npu.TELinear(64, 96, init_method=init, **BF16_NO_BIAS), (x,)),
                         (te_npu.TEGroupedLinear(2, 64, 96, init_method=init, **BF16_NO_BIAS), (x, [20, 12])),
                         (te_npu.TEGroupedSwiGLUExperts(2, 64, 32, init_method=experts_init), (x, [20, 12]))):
        with _ctx(recipe):
            want = module(*args)
            for flag in (True, False, False):
                assert torch.equal(module(*args, is_first_microbatch=flag), want)


@pytest.mark.parametrize("recipe", PATHS, ids=PATH_IDS)
def test_te_linear_return_bias_returns_bias_unadded(recipe, rand, init):
    lin = te_npu.TELinear(64, 96, bias=True, return_bias=True, init_method=init, params_dtype=torch.bfloat16)
    with torch.no_grad():
        lin.bias.copy_(rand(96))
    plain = te_npu.TELinear(64, 96, bias=False, init_method=init, params_dtype=torch.bfloat16)
    plain.load_state_dict({"weight": lin.weight.detach()})
    x = rand(32, 64, requires_grad=True)
    with _ctx(recipe):
        out, bias = lin(x)  # Megatron: ``out, bias = self.linear_fc1(x)``
        assert torch.equal(out, plain(x)) and bias is not None and torch.equal(bias, lin.bias)
    (out.float().sum() + bias.float().sum()).backward()
    assert torch.equal(lin.bias.grad, torch.ones(96, dtype=torch.bfloat16))
    with _ctx(recipe):
        out, none = te_npu.TELinear(64, 96, bias=False, return_bias=True, params_dtype=torch.bfloat16)(x)
    assert none is None and out.shape == (32, 96)


# ---- item 5: TE's activation dtype ------------------------------------------------------------------

@pytest.mark.parametrize("recipe", PATHS, ids=PATH_IDS)
def test_te_modules_compute_in_the_input_dtype_outside_torch_autocast(recipe, rand, init, experts_init):
    """An fp32 input into a bf16 layer: both paths compute in and return fp32 (the weight is
    cast to the activation dtype; the 8-bit path quantizes it whatever its dtype); gradients
    come back in each tensor's own dtype."""
    lin = te_npu.TELinear(64, 96, bias=True, init_method=init, params_dtype=torch.bfloat16)
    x = rand(32, 64, dtype=torch.float32, requires_grad=True)
    with _ctx(recipe):
        y = lin(x)
    y.sum().backward()
    assert y.dtype == torch.float32 and x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.bfloat16
    if recipe is None:
        assert torch.equal(y, F.linear(x, lin.weight.float(), lin.bias.float()))
    experts = te_npu.TEGroupedSwiGLUExperts(2, 64, 32, init_method=experts_init)
    with _ctx(recipe):
        assert experts(x[:32], [20, 12]).dtype == torch.float32


@pytest.mark.parametrize("recipe", PATHS, ids=PATH_IDS)
def test_te_modules_under_torch_autocast_return_the_autocast_dtype(recipe, rand, init, experts_init):
    """Inside torch.autocast(bf16) both paths return bf16, and the 8-bit path equals the same
    call on the bf16-cast input outside torch.autocast bit for bit: torch.autocast reaches
    neither the input's quantization nor the emulated FP32-accumulating GEMMs."""
    f32 = dict(params_dtype=torch.float32)
    modules = [(te_npu.TELinear(64, 96, bias=True, init_method=init, **f32), ()),
               (te_npu.TEGroupedLinear(2, 64, 96, init_method=init, **f32), ([20, 12],)),
               (te_npu.TEGroupedSwiGLUExperts(2, 64, 32, init_method=experts_init, **f32), ([20, 12],))]
    x = rand(32, 64, dtype=torch.float32)
    for module, extra in modules:
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), _ctx(recipe):
            y = module(xi, *extra)
            y.float().sum().backward()
        assert y.dtype == torch.bfloat16 and xi.grad.dtype == torch.float32
        grads = [p.grad.clone() for p in module.parameters()]
        module.zero_grad()
        xb = x.to(torch.bfloat16).requires_grad_()
        with _ctx(recipe):
            if recipe is None:
                want = module.to(torch.bfloat16)(xb, *extra)
                module.float()
            else:
                want = module(xb, *extra)
                want.float().sum().backward()
                assert all(torch.equal(a, p.grad) for a, p in zip(grads, module.parameters()))
        assert torch.equal(y, want)


# ---- TE's preserve_high_precision_init_val ---------------------------------------------------------

@pytest.mark.parametrize("init_context", [te_npu.quantized_model_init, te_npu.fp8_model_init],
                         ids=["quantized_model_init", "fp8_model_init"])
def test_quantized_init_preserves_high_precision_init_val(init_context):
    recipe = MXFP8BlockRecipe()
    reference = te_npu.TELinear(64, 96, init_method=seeded_init(0), bias=False, params_dtype=torch.bfloat16)
    with init_context(recipe=recipe, preserve_high_precision_init_val=True):
        lin = te_npu.TELinear(64, 96, init_method=seeded_init(0), bias=False, params_dtype=torch.bfloat16)
        experts = te_npu.TEGroupedSwiGLUExperts(2, 64, 32, init_method=seeded_init(1, std=0.02))
    value = lin.weight.get_high_precision_init_val()
    assert value.device.type == "cpu" and value.dtype == torch.bfloat16 and torch.equal(value, reference.weight)
    assert experts.down_proj.get_high_precision_init_val().shape == (2, 64, 32)
    lin.weight.clear_high_precision_init_val()
    assert lin.weight.get_high_precision_init_val() is None
    with te_npu.quantized_model_init(recipe=HiF8CurrentScalingRecipe()):
        plain = te_npu.TELinear(64, 96, bias=False, params_dtype=torch.bfloat16)
    assert not hasattr(plain.weight, "get_high_precision_init_val")  # as in TE: only when preserved
