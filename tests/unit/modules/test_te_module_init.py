"""TEModule construction: parameter names, order and default-init draws of the three TE modules.

The default inits draw from the global RNG (as TE's and ``nn.Linear``'s do), so each case runs
inside ``torch.random.fork_rng`` with a fixed seed: the reference draws the numbers TE draws
(``transformer_engine/pytorch/module/base.py`` ``reset_parameters``: ``init_fn(param)`` per
registered parameter, ``utils.get_default_init_method`` = ``normal_(0, 0.023)``, biases zero).
"""
import pytest
import torch
from torch import nn

from te_npu import TEGroupedLinear, TEGroupedSwiGLUExperts, TELinear

SEED = 1234


def _seeded(build):
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        return build()


def test_te_linear_default_init_is_te_normal_0023_draws():
    ours = _seeded(lambda: TELinear(48, 80, params_dtype=torch.float32))
    ref = _seeded(lambda: nn.init.normal_(torch.empty(80, 48), mean=0.0, std=0.023))
    assert [n for n, _ in ours.named_parameters()] == ["weight", "bias"]
    assert torch.equal(ours.weight, ref)
    assert torch.equal(ours.bias, torch.zeros(80))
    assert _seeded(lambda: TELinear(48, 80, bias=False)).bias is None


def test_te_grouped_linear_default_init_draws_each_expert_weight_in_order():
    """TE registers weight0, bias0, weight1, ... and draws normal_(0, 0.023) for each weight{g}."""
    ours = _seeded(lambda: TEGroupedLinear(3, 64, 32, params_dtype=torch.float32))

    def ref():
        return torch.stack([nn.init.normal_(torch.empty(32, 64), mean=0.0, std=0.023) for _ in range(3)])

    assert [n for n, _ in ours.named_parameters()] == ["weight", "bias"]
    assert torch.equal(ours.weight, _seeded(ref))
    assert torch.equal(ours.bias, torch.zeros(3, 32))
    assert _seeded(lambda: TEGroupedLinear(3, 64, 32, bias=False)).bias is None


def test_te_grouped_swiglu_default_init_draws_gate_up_then_down():
    ours = _seeded(lambda: TEGroupedSwiGLUExperts(2, 32, 16, params_dtype=torch.float32))

    def ref():
        return torch.empty(2, 32, 32).normal_(0.0, 0.02), torch.empty(2, 32, 16).normal_(0.0, 0.02)

    gate_up, down = _seeded(ref)
    assert [n for n, _ in ours.named_parameters()] == ["gate_up_proj", "down_proj"]
    assert torch.equal(ours.gate_up_proj, gate_up) and torch.equal(ours.down_proj, down)


@pytest.mark.parametrize("build", [
    lambda init: TELinear(32, 64, bias=True, init_method=init, params_dtype=torch.bfloat16),
    lambda init: TEGroupedLinear(2, 32, 64, init_method=init, bias=False, params_dtype=torch.bfloat16),
    lambda init: TEGroupedSwiGLUExperts(2, 32, 64, init_method=init),
], ids=["TELinear", "TEGroupedLinear", "TEGroupedSwiGLUExperts"])
def test_te_module_init_method_and_reset_parameters(build):
    seen = []

    def init(weight):
        seen.append(tuple(weight.shape))
        nn.init.constant_(weight, 0.5)

    module = build(init)
    weights = [getattr(module, name) for name in module._weight_names]
    # every GEMM weight, in order; TEGroupedLinear: each expert's [out, in] weight (TE's weight{g})
    units = [tuple(w.shape[1:]) for w in weights for _ in range(w.shape[0])] if isinstance(
        module, TEGroupedLinear) else [tuple(w.shape) for w in weights]
    assert seen == units
    assert all(bool((w == 0.5).all()) for w in weights) and module.init_method is init
    with torch.no_grad():
        for w in weights:
            w.zero_()
    module.reset_parameters()
    assert all(bool((w == 0.5).all()) for w in weights) and len(seen) == 2 * len(units)
    with torch.device("meta"):
        meta = build(init)
    assert all(getattr(meta, n).is_meta for n in meta._weight_names) and len(seen) == 2 * len(units)
