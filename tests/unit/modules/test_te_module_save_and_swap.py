"""``torch.save(module)`` / ``torch.load`` and ``torch.utils.swap_tensors`` on TE modules (issue 20,
item 5): they used to fail on a WeakSet (pickling) and on the weight cache's weakref (swapping)."""
from __future__ import annotations

import io

import pytest
import torch

import te_npu
from te_npu import HiF8CurrentScalingRecipe, MXFP8BlockRecipe
from tests.seeded import seeded_init

RECIPES = [MXFP8BlockRecipe(), HiF8CurrentScalingRecipe()]
SPLITS = [20, 12]


def _modules():
    """Seeded modules whose ``init_method`` pickles (a closure does not, in TE either)."""
    modules = {
        "TELinear": (te_npu.TELinear(64, 64, init_method=torch.nn.init.zeros_), ()),
        "TEGroupedLinear": (te_npu.TEGroupedLinear(2, 64, 64, init_method=torch.nn.init.zeros_), (SPLITS,)),
        "TEGroupedSwiGLUExperts": (te_npu.TEGroupedSwiGLUExperts(2, 64, 32, init_method=torch.nn.init.zeros_),
                                   (SPLITS,)),
    }
    gen = torch.Generator().manual_seed(0)
    for module, _ in modules.values():
        with torch.no_grad():
            for param in module.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return modules


def _x():
    return torch.randn(32, 64, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("quantized", [None, *RECIPES], ids=["high_precision", "mxfp8", "hif8"])
@pytest.mark.parametrize("kind", list(_modules()))
def test_torch_save_of_a_te_module_round_trips(kind, quantized):
    module, extra = _modules()[kind]
    if quantized is not None:
        te_npu.quantize_weights_(module, quantized)
    recipe = quantized or MXFP8BlockRecipe()
    with te_npu.autocast(recipe=recipe):
        want = module(_x().requires_grad_(), *extra, is_first_microbatch=True)  # fills caches and records
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is type(module)
    assert all(type(a) is type(b) and torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                                         module.state_dict().values()))
    with te_npu.autocast(recipe=recipe):
        assert torch.equal(loaded(_x(), *extra), want)


@pytest.mark.parametrize("recipe", RECIPES)
def test_swap_tensors_after_an_is_first_microbatch_forward(recipe):
    """The weight cache holds the weight it quantized; a weakref there made swap_tensors refuse."""
    layer = te_npu.TELinear(64, 64, init_method=seeded_init(0))
    with te_npu.autocast(recipe=recipe):
        layer(_x(), is_first_microbatch=True)
    new = torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(3)))
    weight = layer.weight
    torch.utils.swap_tensors(weight, new)
    assert layer.weight is weight
    fresh = te_npu.TELinear(64, 64, init_method=seeded_init(0))
    fresh.load_state_dict(layer.state_dict())
    with te_npu.autocast(recipe=recipe):  # False: the cache sees another storage, re-quantizes
        assert torch.equal(layer(_x(), is_first_microbatch=False), fresh(_x()))


@pytest.mark.parametrize("recipe", RECIPES)
def test_load_state_dict_with_swap_after_an_is_first_microbatch_forward(recipe):
    layer = te_npu.TELinear(64, 64, init_method=seeded_init(0))
    source = te_npu.TELinear(64, 64, init_method=seeded_init(7))
    with te_npu.autocast(recipe=recipe):
        layer(_x(), is_first_microbatch=True)
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        layer.load_state_dict(source.state_dict())
        layer.to(torch.float64).to(torch.float32)  # module.to swaps too
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    with te_npu.autocast(recipe=recipe):
        assert torch.equal(layer(_x(), is_first_microbatch=False), source(_x()))
