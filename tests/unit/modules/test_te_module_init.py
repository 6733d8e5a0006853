"""TEModule construction: parameter names, order and default-init draws of the three TE modules.

The default inits draw from the global RNG (as ``nn.Linear`` does), so each case runs inside
``torch.random.fork_rng`` with a fixed seed: the reference draws the same numbers the way the
modules drew them before ``TEModule._init_parameters`` folded their constructors.
"""
import math

import pytest
import torch
from torch import nn

from te_npu import TEGroupedLinear, TEGroupedSwiGLUExperts, TELinear

SEED = 1234


def _seeded(build):
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        return build()


def test_te_linear_default_init_is_nn_linear_draws():
    ours = _seeded(lambda: TELinear(48, 80, bias=True, params_dtype=torch.float32))
    ref = _seeded(lambda: nn.Linear(48, 80))  # weight: kaiming_uniform(a=sqrt(5)) first, as ours
    assert [n for n, _ in ours.named_parameters()] == ["weight", "bias"]
    assert torch.equal(ours.weight, ref.weight)
    assert torch.equal(ours.bias, torch.zeros(80))
    assert _seeded(lambda: TELinear(48, 80)).bias is None


def test_te_grouped_linear_default_init_is_per_expert_uniform():
    ours = _seeded(lambda: TEGroupedLinear(3, 64, 32, params_dtype=torch.float32))
    bound = 1.0 / math.sqrt(64)
    ref = _seeded(lambda: torch.empty(3, 32, 64).uniform_(-bound, bound))
    assert [n for n, _ in ours.named_parameters()] == ["weight"]
    assert torch.equal(ours.weight, ref)
    assert not hasattr(ours, "bias")


def test_te_grouped_swiglu_default_init_draws_gate_up_then_down():
    ours = _seeded(lambda: TEGroupedSwiGLUExperts(2, 32, 16, params_dtype=torch.float32))

    def ref():
        return torch.empty(2, 32, 32).normal_(0.0, 0.02), torch.empty(2, 32, 16).normal_(0.0, 0.02)

    gate_up, down = _seeded(ref)
    assert [n for n, _ in ours.named_parameters()] == ["gate_up_proj", "down_proj"]
    assert torch.equal(ours.gate_up_proj, gate_up) and torch.equal(ours.down_proj, down)


@pytest.mark.parametrize("build", [
    lambda init: TELinear(32, 64, bias=True, init_method=init),
    lambda init: TEGroupedLinear(2, 32, 64, init_method=init),
    lambda init: TEGroupedSwiGLUExperts(2, 32, 64, init_method=init),
], ids=["TELinear", "TEGroupedLinear", "TEGroupedSwiGLUExperts"])
def test_te_module_init_method_and_reset_parameters(build):
    seen = []

    def init(weight):
        seen.append(tuple(weight.shape))
        nn.init.constant_(weight, 0.5)

    module = build(init)
    weights = [getattr(module, name) for name in module._weight_names]
    assert seen == [tuple(w.shape) for w in weights]  # every GEMM weight, in order
    assert all(bool((w == 0.5).all()) for w in weights) and module.init_method is init
    with torch.no_grad():
        for w in weights:
            w.zero_()
    module.reset_parameters()
    assert all(bool((w == 0.5).all()) for w in weights) and len(seen) == 2 * len(weights)
    with torch.device("meta"):
        meta = build(init)
    assert all(getattr(meta, n).is_meta for n in meta._weight_names) and len(seen) == 2 * len(weights)
