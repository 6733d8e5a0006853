"""``te_npu.checkpoint`` and recompute recipes: a recompute replays the recipe of the checkpointed
call, whatever the module ran since (issue 14, item 2), in both ``use_reentrant`` modes; a plain
``torch.utils.checkpoint`` recompute either uses the one recipe it can prove or raises (issue 20,
item 1)."""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import te_npu
from te_npu import ConfigError, HiF8CurrentScalingRecipe, MXFP8BlockRecipe
from tests.seeded import BF16_NO_BIAS, seeded_init, seeded_randn

BF16 = dict(params_dtype=torch.bfloat16)
SPLITS = [40, 0, 55, 5]


def _quantized_dense():
    with te_npu.quantized_model_init(recipe=MXFP8BlockRecipe()):
        return te_npu.TELinear(64, 96, init_method=seeded_init(0), **BF16)


MODULES = {
    "dense": (lambda: te_npu.TELinear(64, 96, init_method=seeded_init(0), **BF16), (2, 32, 64), ()),
    "grouped": (lambda: te_npu.TEGroupedLinear(4, 64, 96, init_method=seeded_init(0), **BF16), (100, 64), (SPLITS,)),
    "swiglu": (lambda: te_npu.TEGroupedSwiGLUExperts(4, 64, 32, init_method=seeded_init(0, std=0.02)), (100, 64),
               (SPLITS,)),
    "quantized_dense": (_quantized_dense, (32, 64), ()),
}
CHECKPOINTS = {
    "non_reentrant": te_npu.checkpoint,
    "reentrant": lambda *a: te_npu.checkpoint(*a, use_reentrant=True),
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


def _x(shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


@pytest.mark.parametrize("mode", list(CHECKPOINTS))
@pytest.mark.parametrize("kind", list(MODULES))
@pytest.mark.parametrize("first, second", SEQUENCES, ids=SEQUENCE_IDS)
def test_checkpoint_recompute_replays_the_recipe_of_the_checkpointed_call(mode, kind, first, second):
    build, x_shape, extra = MODULES[kind]
    if kind == "quantized_dense" and HiF8CurrentScalingRecipe() in (first, second):
        pytest.skip("an MXFP8 quantized weight runs in MXFP8 or the plain path only (HiF8 refuses it by design)")
    module = build()
    x = _x(x_shape)
    reference = _grads(module, x, extra, first, second, None)
    recomputed = _grads(module, x, extra, first, second, CHECKPOINTS[mode])
    assert all(torch.equal(a, b) for a, b in zip(reference, recomputed))


PLAIN_TORCH = {
    "non_reentrant": lambda *a: torch_checkpoint(*a, use_reentrant=False),
    "reentrant": lambda *a: torch_checkpoint(*a, use_reentrant=True),
    "torch_default": lambda *a: torch_checkpoint(*a),  # warns, then runs reentrant
}


@pytest.mark.filterwarnings("ignore:torch.utils.checkpoint")
@pytest.mark.parametrize("mode", list(PLAIN_TORCH))
@pytest.mark.parametrize("kind", list(MODULES))
def test_plain_torch_checkpoint_that_cannot_tell_the_recipe_raises_naming_te_npu_checkpoint(mode, kind):
    """The issue's case: checkpoint under MXFP8, the same module under HiF8 (or plain), backward.
    Reentrant recomputes used to take the other graph's recipe silently; every mode now raises."""
    build, x_shape, extra = MODULES[kind]
    second = None if kind == "quantized_dense" else HiF8CurrentScalingRecipe()
    with pytest.raises(RuntimeError, match=r"cannot be told: .* ran 2 different recipes.*te_npu\.checkpoint"):
        _grads(build(), _x(x_shape), extra, MXFP8BlockRecipe(), second, PLAIN_TORCH[mode])


@pytest.mark.filterwarnings("ignore:torch.utils.checkpoint")
@pytest.mark.parametrize("mode", list(PLAIN_TORCH))
@pytest.mark.parametrize("kind", list(MODULES))
def test_plain_torch_checkpoint_with_one_recipe_is_bitwise_the_plain_backward(mode, kind):
    """With one recipe in sight (no other forward alive or under no_grad) a plain torch checkpoint,
    reentrant ones included, recomputes in it: the gradients equal the non-recomputed ones."""
    build, x_shape, extra = MODULES[kind]
    x = _x(x_shape)

    def grads(checkpoint_fn):
        module = build()
        xi = x.clone().requires_grad_()
        with te_npu.autocast(recipe=MXFP8BlockRecipe()):
            y = checkpoint_fn(module, xi, *extra) if checkpoint_fn else module(xi, *extra)
        y.float().pow(2).sum().backward()
        return [xi.grad] + [p.grad for p in module.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads(None), grads(PLAIN_TORCH[mode])))


def test_plain_torch_checkpoint_after_a_no_grad_forward_in_another_recipe_raises():
    """A forward under torch.no_grad may be a reentrant checkpoint's (its graph cannot be seen), so
    an evaluation in another recipe makes later plain recomputes of that module refuse."""
    module = te_npu.TELinear(64, 96, init_method=seeded_init(0), **BF16)
    x = seeded_randn(1)(32, 64)
    with torch.no_grad(), te_npu.autocast(recipe=HiF8CurrentScalingRecipe()):
        module(x)
    with torch.inference_mode(), te_npu.autocast(enabled=False):
        module(x)  # inference mode: never recomputed, not recorded
    with pytest.raises(RuntimeError, match=r"forwards under torch.no_grad .* ran 2 different recipes"):
        _grads(module, x, (), MXFP8BlockRecipe(), MXFP8BlockRecipe(),
               lambda *a: torch_checkpoint(*a, use_reentrant=False))
    recomputed = _grads(module, x, (), MXFP8BlockRecipe(), MXFP8BlockRecipe(), te_npu.checkpoint)
    assert all(torch.equal(a, b) for a, b in zip(
        recomputed, _grads(module, x, (), MXFP8BlockRecipe(), MXFP8BlockRecipe(), None)))


def test_plain_torch_checkpoint_with_one_recipe_and_backward_inside_another_autocast():
    """An autocast around ``backward()`` is not the checkpointed call's: the recompute ignores it."""
    module = te_npu.TELinear(64, 96, init_method=seeded_init(0), bias=False, params_dtype=torch.bfloat16)
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
    module = te_npu.TELinear(64, 96, init_method=seeded_init(0), bias=False, params_dtype=torch.bfloat16)
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
    first, second = te_npu.TELinear(64, 64, init_method=init, **BF16_NO_BIAS), te_npu.TELinear(64, 64, init_method=init, **BF16_NO_BIAS)

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


class _Mark:
    """A user context manager that records its name in `seen` on entry."""

    def __init__(self, name, seen):
        self.name, self.seen = name, seen

    def __enter__(self):
        self.seen.append(self.name)

    def __exit__(self, *exc):
        return False


def test_checkpoint_passes_kwargs_and_user_context_fn():
    seen = []

    module = te_npu.TELinear(64, 64, bias=True, return_bias=True, init_method=seeded_init(0), params_dtype=torch.bfloat16)
    x = seeded_randn(1)(32, 64, requires_grad=True)
    out, bias = te_npu.checkpoint(module, x, is_first_microbatch=True,
                                  context_fn=lambda: (_Mark("forward", seen), _Mark("recompute", seen)))
    (out.float().sum() + bias.float().sum()).backward()
    assert seen == ["forward", "recompute"] and module.bias.grad is not None


@pytest.mark.parametrize("argument, value, reason", [
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


# ---- te_npu.checkpoint(use_reentrant=True): TE's default mode -----------------------------------

def test_reentrant_checkpoint_passes_kwargs_and_user_context_fn():
    seen = []

    def run(use_reentrant):
        module = te_npu.TELinear(64, 64, return_bias=True, init_method=seeded_init(0), **BF16)
        x = seeded_randn(1)(32, 64, requires_grad=True)
        with te_npu.autocast(recipe=HiF8CurrentScalingRecipe()):
            out, bias = te_npu.checkpoint(module, x, is_first_microbatch=True, use_reentrant=use_reentrant,
                                          context_fn=lambda: (_Mark("forward", seen), _Mark("recompute", seen)))
        (out.float().pow(2).sum() + bias.float().sum()).backward()
        return [x.grad, module.weight.grad, module.bias.grad]

    reentrant = run(True)
    assert seen == ["forward", "recompute"]
    assert all(torch.equal(a, b) for a, b in zip(reentrant, run(False)))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_reentrant_checkpoint_refuses_what_would_lose_gradients():
    module = te_npu.TELinear(64, 64, init_method=seeded_init(0), **BF16)
    x = seeded_randn(1)(32, 64)
    with pytest.raises(ConfigError, match=r"no tensor argument of TELinear requires grad.*use_reentrant=False"):
        te_npu.checkpoint(module, x, use_reentrant=True)
    with pytest.raises(ConfigError, match=r"keyword tensor argument\(s\) \['extra'\] need gradients"):
        te_npu.checkpoint(lambda a, extra: a + extra, x.requires_grad_(), extra=x.clone(), use_reentrant=True)
    with torch.no_grad():  # no backward: nothing to lose
        assert torch.equal(te_npu.checkpoint(module, x.detach(), use_reentrant=True), module(x.detach()))


def test_checkpoint_refuses_te_deprecated_positional_tracker_form():
    """TE's ``checkpoint(fn, distribute_saved_activations, get_rng_state_tracker, tp_group, *args)``."""
    with pytest.raises(ConfigError, match=r"deprecated positional form .* not supported: there is no tensor-parallel"):
        te_npu.checkpoint(torch.sin, False, lambda: None, None, torch.zeros(2))

