"""Inputs TE modules meet that used to fail deep inside (issue 20, item 5): a micro-batch with
0 tokens gives the empty result (HiF8 raised IndexError in its amax), and an integer or float64
activation is refused at the call instead of failing in a kernel (or, for integers on the plain
path, silently truncating the weight)."""
from __future__ import annotations

import pytest
import torch

import te_npu
from te_npu import HiF8CurrentScalingRecipe, LowPrecisionUnavailableError, MXFP8BlockRecipe
from tests.seeded import seeded_init

RECIPES = [None, MXFP8BlockRecipe(), HiF8CurrentScalingRecipe()]
RECIPE_IDS = ["plain", "mxfp8", "hif8"]
BUILDERS = {
    "TELinear": (lambda: te_npu.TELinear(64, 96, init_method=seeded_init(0)), ()),
    "TEGroupedLinear": (lambda: te_npu.TEGroupedLinear(3, 64, 96, init_method=seeded_init(0)), ([0, 0, 0],)),
    "TEGroupedSwiGLUExperts": (lambda: te_npu.TEGroupedSwiGLUExperts(3, 64, 32, init_method=seeded_init(1, std=0.02)),
                               ([0, 0, 0],)),
}


def _ctx(recipe):
    return te_npu.autocast(enabled=recipe is not None, recipe=recipe)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_te_module_with_zero_tokens_gives_the_empty_result(kind, recipe):
    build, extra = BUILDERS[kind]
    module = build()
    x = torch.zeros(0, 64, requires_grad=True)
    with _ctx(recipe):
        y = module(x, *extra)
    assert y.shape == (0, 64 if kind == "TEGroupedSwiGLUExperts" else 96)
    y.sum().backward()
    assert x.grad.shape == (0, 64)
    for name, param in module.named_parameters():  # a sum over no token
        assert torch.equal(param.grad, torch.zeros_like(param)), name


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_te_module_refuses_an_integer_input(kind, recipe):
    build, extra = BUILDERS[kind]
    with pytest.raises(TypeError, match=r"input dtype torch.int64 \(shape \[0, 64\]\) is not a floating-point type"):
        with _ctx(recipe):
            build()(torch.zeros(0, 64, dtype=torch.int64), *extra)


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_te_module_refuses_float64_in_8_bits_and_computes_it_on_the_plain_path(kind):
    build, extra = BUILDERS[kind]
    module = build()
    x = torch.zeros(0, 64, dtype=torch.float64)
    with pytest.raises(LowPrecisionUnavailableError, match="an 8-bit GEMM returns .* not the activation dtype "
                                                           "torch.float64 of the input"):
        with _ctx(MXFP8BlockRecipe()):
            module(x, *extra)
    assert module(x, *extra).dtype == torch.float64


@pytest.mark.parametrize("recipe", RECIPES[1:], ids=RECIPE_IDS[1:])
def test_te_modules_new_paths_run_through_the_npu_wrappers(recipe, monkeypatch):
    """TE's grouped bias (an FP32 grouped product) and 0-token micro-batches through the
    vendor-faithful fake torch_npu equal the emulation bitwise."""
    from te_npu.ops import force_backend
    from tests.npu_backend import install_npu_backend

    grouped = te_npu.TEGroupedLinear(4, 64, 96, init_method=seeded_init(0), params_dtype=torch.bfloat16)
    with torch.no_grad():
        grouped.bias.copy_(torch.randn(4, 96, generator=torch.Generator().manual_seed(1)))
    dense = te_npu.TELinear(64, 96, init_method=seeded_init(0), params_dtype=torch.bfloat16)
    x = torch.randn(100, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

    def step():
        grouped.zero_grad(), dense.zero_grad()
        xi, x0 = x.clone().requires_grad_(), torch.zeros(0, 64, dtype=torch.bfloat16, requires_grad=True)
        with _ctx(recipe):
            y = grouped(xi, [40, 0, 55, 5]).float().square().sum() + dense(x0).float().sum()
            y = y + grouped(x0, [0, 0, 0, 0]).float().sum()
        y.backward()
        return [xi.grad, x0.grad, *(p.grad for p in (*grouped.parameters(), *dense.parameters()))]

    expected = step()
    install_npu_backend(monkeypatch)
    with force_backend("npu"):
        got = step()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
