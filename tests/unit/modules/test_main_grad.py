"""``fuse_wgrad_accumulation=True`` with Megatron's ``weight.main_grad`` (issue 20, item 6): the
wgrad GEMM's FP32 product goes into ``main_grad`` (``+=``, ``=`` on ``is_first_microbatch=True``),
bitwise the FP32 wgrad of the same GEMM; the rest of the backward is unchanged.

The reference for the FP32 wgrad is a freshly built layer with FP32 parameters holding the same
values (its quantized operands are the same codes, and its wgrad GEMM outputs FP32); on the
plain path it is ``dY^T X`` in FP32 from the test's own tensors."""
from __future__ import annotations

import pytest
import torch

import te_npu
from te_npu import HiF8CurrentScalingRecipe, MXFP8BlockRecipe
from tests.seeded import seeded_init

RECIPES = [None, MXFP8BlockRecipe(), HiF8CurrentScalingRecipe()]
RECIPE_IDS = ["plain", "mxfp8", "hif8"]
SPLITS = [40, 0, 55, 1]
KINDS = {
    "TELinear": (lambda **kw: te_npu.TELinear(64, 96, init_method=seeded_init(0), **kw), (32, 64), ()),
    "TEGroupedLinear": (lambda **kw: te_npu.TEGroupedLinear(4, 64, 96, init_method=seeded_init(0), **kw),
                        (96, 64), (SPLITS,)),
}


def _ctx(recipe):
    return te_npu.autocast(enabled=recipe is not None, recipe=recipe)


def _inputs(shape, n):
    """x ``[M, 64]`` and dY ``[M, 96]``, both bf16 (the layers' activation dtype)."""
    gen = torch.Generator().manual_seed(n)
    return (torch.randn(*shape, generator=gen).to(torch.bfloat16),
            torch.randn(shape[0], 96, generator=gen).to(torch.bfloat16))


def _step(module, x, dy, extra, recipe, **forward):
    xi = x.clone().requires_grad_()
    with _ctx(recipe):
        y = module(xi, *extra, **forward)
    y.backward(dy)
    return xi.grad


def _fp32_wgrad(build, module, x, dy, extra, recipe):
    """The FP32 wgrad of the same GEMM: an FP32-parameter copy of ``module`` without the option."""
    reference = build(params_dtype=torch.float32)
    reference.load_state_dict({k: v.float() for k, v in module.state_dict().items()})
    _step(reference, x, dy, extra, recipe)
    return reference.weight.grad


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_fuse_wgrad_accumulation_writes_the_fp32_wgrad_into_main_grad(kind, recipe):
    build, shape, extra = KINDS[kind]
    module = build(params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
    plain = build(params_dtype=torch.bfloat16)
    plain.load_state_dict(module.state_dict())
    start = torch.randn(module.weight.shape, generator=torch.Generator().manual_seed(9))
    module.weight.main_grad = start.clone()
    batches = [_inputs(shape, n) for n in range(3)]
    want = start.clone()
    for micro, (x, dy) in enumerate(batches):
        flag = micro == 0
        dx = _step(module, x, dy, extra, recipe, is_first_microbatch=flag)
        assert torch.equal(dx, _step(plain, x, dy, extra, recipe, is_first_microbatch=flag))  # dgrad unchanged
        if recipe is None:  # dW = dY^T X in FP32
            rows = [0, *torch.tensor(SPLITS).cumsum(0).tolist()] if extra else [0, shape[0]]
            dw = torch.stack([dy[a:b].float().T @ x[a:b].float() for a, b in zip(rows, rows[1:])])
            dw = dw if extra else dw[0]
        else:
            dw = _fp32_wgrad(build, module, x, dy, extra, recipe)
        want = dw.clone() if flag else want + dw  # is_first_microbatch=True overwrites
        assert torch.equal(module.weight.main_grad, want), micro
    assert module.weight.grad is None  # no grad_added_to_main_grad flag: TE returns no wgrad
    assert torch.equal(module.bias.grad, plain.bias.grad)  # the bias keeps its ordinary gradient


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_fuse_wgrad_accumulation_follows_megatron_s_flags(recipe):
    build, shape, extra = KINDS["TELinear"]
    module = build(params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
    module.weight.main_grad = torch.zeros(96, 64)
    module.weight.grad_added_to_main_grad = False
    x, dy = _inputs(shape, 0)
    _step(module, x, dy, extra, recipe)  # 0 + dW
    wgrad = module.weight.main_grad.clone()
    assert module.weight.grad_added_to_main_grad is True
    assert torch.equal(module.weight.grad, torch.zeros(96, 64, dtype=torch.bfloat16))  # TE's dummy wgrad
    module.weight.main_grad.fill_(1.0)
    module.weight.overwrite_main_grad = True
    _step(module, x, dy, extra, recipe)
    assert torch.equal(module.weight.main_grad, wgrad)  # overwritten: the wgrad alone


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_fuse_wgrad_accumulation_rounds_once_into_a_bf16_main_grad(recipe):
    build, shape, extra = KINDS["TELinear"]
    module = build(params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
    start = torch.randn(96, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    module.weight.main_grad = start.clone()
    x, dy = _inputs(shape, 0)
    _step(module, x, dy, extra, recipe)
    if recipe is None:
        dw = dy.float().T @ x.float()
    else:
        dw = _fp32_wgrad(build, module, x, dy, extra, recipe)
    assert torch.equal(module.weight.main_grad, (dw + start.float()).to(torch.bfloat16))


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_fuse_wgrad_accumulation_without_main_grad_raises_at_the_forward(kind, recipe):
    build, shape, extra = KINDS[kind]
    module = build(fuse_wgrad_accumulation=True, name="decoder.fc1")
    x = torch.zeros(shape, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"decoder\.fc1: fuse_wgrad_accumulation=True writes .* weight\.main_grad"):
        with _ctx(recipe):
            module(x, *extra)
    with torch.no_grad(), _ctx(recipe):  # no wgrad: nothing to write
        module(x, *extra)


def test_fuse_wgrad_accumulation_with_quantized_weights():
    with te_npu.quantized_model_init(recipe=MXFP8BlockRecipe()):
        module = te_npu.TELinear(64, 96, init_method=seeded_init(0), fuse_wgrad_accumulation=True, bias=False)
        reference = te_npu.TELinear(64, 96, init_method=seeded_init(0), params_dtype=torch.float32, bias=False)
    module.weight.main_grad = torch.zeros(96, 64)
    x, dy = _inputs((32, 64), 0)
    _step(module, x, dy, (), MXFP8BlockRecipe())
    _step(reference, x, dy, (), MXFP8BlockRecipe())
    assert torch.equal(module.weight.main_grad, reference.weight.grad) and module.weight.grad is None
