"""``te_npu.checkpoint`` and recompute recipes: a recompute replays the recipe of the checkpointed
call, whatever the module ran since (issue 14, item 2)."""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import te_npu
from te_npu import ConfigError, HiF8CurrentScalingRecipe, MXFP8BlockRecipe
from tests.seeded import seeded_init, seeded_randn

MODULES = {
    "dense": (lambda: te_npu.TELinear(64, 96, bias=True, init_method=seeded_init(0)), (2, 32, 64), ()),
    "grouped": (lambda: te_npu.TEGroupedLinear(4, 64, 96, init_method=seeded_init(0)), (100, 64), ([40, 0, 55, 5],)),
    "swiglu": (lambda: te_npu.TEGroupedSwiGLUExperts(4, 64, 32, init_method=seeded_init(0, std=0.02)), (100, 64),
               ([40, 0, 55, 5],)),
}
# (checkpointed call, what the module runs afterwards, before backward)
SEQUENCES = [(MXFP8BlockRecipe(), HiF8CurrentScalingRecipe()), (MXFP8BlockRecipe(), None),
             (HiF8CurrentScalingRecipe(), MXFP8BlockRecipe()), (None, MXFP8BlockRecipe())]
SEQUENCE_IDS = ["mxfp8_then_hif8", "mxfp8_then_plain", "hif8_then_mxfp8", "plain_then_mxfp8"]


def _ctx(recipe):
    return te_npu.autocast(enabled=recipe is not None, recipe=recipe)


def _grads(module, x, extra, first, second, checkpoint_fn):
    """Gradients of loss(first call) + loss(second call); the first is checkpointed when asked."""
    module.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recipe-change warning of quantizers_for
        with _ctx(first):
            y1 = checkpoint_fn(module, xi, *extra) if checkpoint_fn else module(xi, *extra)
        with _ctx(second):
            y2 = module(xi, *extra)
        (y1.float().pow(2).sum() + y2.float().sum()).backward()
    return [xi.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("kind", list(MODULES))
@pytest.mark.parametrize("first, second", SEQUENCES, ids=SEQUENCE_IDS)
def test_checkpoint_recompute_replays_the_recipe_of_the_checkpointed_call(kind, first, second):
    build, x_shape, extra = MODULES[kind]
    module = build()
    x = torch.randn(*x_shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    reference = _grads(module, x, extra, first, second, None)
    recomputed = _grads(module, x, extra, first, second, te_npu.checkpoint)
    assert all(torch.equal(a, b) for a, b in zip(reference, recomputed))


def test_plain_torch_checkpoint_that_cannot_tell_the_recipe_raises_naming_te_npu_checkpoint():
    module = te_npu.TELinear(64, 96, init_method=seeded_init(0))
    x = seeded_randn(1)(32, 64)
    with pytest.raises(RuntimeError, match=r"TELinear.*live autograd graphs ran 2 different recipes.*te_npu\.checkpoint"):
        _grads(module, x, (), MXFP8BlockRecipe(), HiF8CurrentScalingRecipe(),
               lambda *a: torch_checkpoint(*a, use_reentrant=False))


def test_plain_torch_checkpoint_with_one_recipe_and_backward_inside_another_autocast():
    """An autocast around ``backward()`` is not the checkpointed call's: the recompute ignores it."""
    module = te_npu.TELinear(64, 96, init_method=seeded_init(0))
    x = seeded_randn(1)(32, 64, requires_grad=True)

    def run(use_checkpoint):
        module.zero_grad(set_to_none=True)
        with te_npu.autocast(recipe=MXFP8BlockRecipe()):
            y = torch_checkpoint(module, x, use_reentrant=False) if use_checkpoint else module(x)
        with te_npu.autocast(recipe=HiF8CurrentScalingRecipe()):
            y.float().sum().backward()
        return module.weight.grad.clone()

    assert torch.equal(run(False), run(True))


def test_user_context_fn_entering_autocast_in_recompute_is_honoured():
    module = te_npu.TELinear(64, 96, init_method=seeded_init(0))
    x = seeded_randn(1)(32, 64)
    recipe = MXFP8BlockRecipe()

    def context_fn():
        return contextlib.nullcontext(), te_npu.autocast(recipe=recipe)

    ref = _grads(module, x, (), recipe, HiF8CurrentScalingRecipe(), None)
    got = _grads(module, x, (), recipe, HiF8CurrentScalingRecipe(),
                 lambda *a: torch_checkpoint(*a, use_reentrant=False, context_fn=context_fn))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_checkpoint_replays_autocast_entered_inside_the_function_and_retained_graphs():
    """An autocast inside the checkpointed function is re-entered by the recompute itself; a
    retained graph recomputes (and re-enters the replay context) once per backward."""
    init = seeded_init(0)
    first, second = te_npu.TELinear(64, 64, init_method=init), te_npu.TELinear(64, 64, init_method=init)

    def body(x):
        with te_npu.autocast(recipe=HiF8CurrentScalingRecipe()):
            return second(first(x))

    x = seeded_randn(1)(32, 64, requires_grad=True)
    with te_npu.autocast(recipe=MXFP8BlockRecipe()):
        ref = body(x)
        out = te_npu.checkpoint(body, x)
    assert torch.equal(ref, out)
    want = torch.autograd.grad(ref.float().sum(), x)[0]
    for _ in range(2):
        assert torch.equal(torch.autograd.grad(out.float().sum(), x, retain_graph=True)[0], want)


def test_checkpoint_passes_kwargs_and_user_context_fn():
    seen = []

    class Mark:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            seen.append(self.name)

        def __exit__(self, *exc):
            return False

    module = te_npu.TELinear(64, 64, bias=True, return_bias=True, init_method=seeded_init(0))
    x = seeded_randn(1)(32, 64, requires_grad=True)
    out, bias = te_npu.checkpoint(module, x, is_first_microbatch=True,
                                  context_fn=lambda: (Mark("forward"), Mark("recompute")))
    (out.float().sum() + bias.float().sum()).backward()
    assert seen == ["forward", "recompute"] and module.bias.grad is not None


@pytest.mark.parametrize("argument, value, reason", [
    ("use_reentrant", True, "non-reentrant"),
    ("distribute_saved_activations", True, "no tensor parallelism"),
    ("tp_group", object(), "no tensor parallelism"),
    ("get_rng_state_tracker", lambda: None, "RNG tracker"),
])
def test_checkpoint_refuses_te_only_arguments_with_the_reason(argument, value, reason):
    with pytest.raises(ConfigError, match=rf"te_npu.checkpoint: {argument}=.*not supported: .*{reason}"):
        te_npu.checkpoint(torch.nn.Identity(), torch.zeros(1), **{argument: value})


def test_checkpoint_accepts_te_no_op_values():
    x = seeded_randn(1)(4, dtype=torch.float32, requires_grad=True)
    y = te_npu.checkpoint(torch.sin, x, use_reentrant=False, distribute_saved_activations=False, tp_group=None)
    y.sum().backward()
    assert torch.equal(x.grad, torch.cos(x.detach()))
