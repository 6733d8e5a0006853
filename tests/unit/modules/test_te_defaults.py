"""TE's constructor contract for ``TELinear`` / ``TEGroupedLinear`` (issue 20, items 3, 4, 6): TE's
defaults (``bias=True``, ``params_dtype=torch.get_default_dtype()``, ``normal_(0, 0.023)``),
``init_method`` per expert weight, only the leading sizes positional, and every TE keyword
either taken or refused with its reason (read from TE's ``module/{linear,grouped_linear}.py``)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import te_npu
from te_npu import ConfigError
from te_npu.modules.te_options import GROUPED_LINEAR_OPTIONS, LINEAR_OPTIONS
from tests.seeded import seeded_randn

BUILDERS = {
    "TELinear": lambda **kw: te_npu.TELinear(64, 96, **kw),
    "TEGroupedLinear": lambda **kw: te_npu.TEGroupedLinear(3, 64, 96, **kw),
}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_te_module_defaults_are_te_s(kind):
    module = BUILDERS[kind]()
    assert module.weight.dtype == torch.float32 and module.bias is not None and module.bias.dtype == torch.float32
    assert bool((module.bias == 0).all())
    with _default_dtype(torch.float16):
        assert BUILDERS[kind]().weight.dtype == torch.float16  # TE: torch.get_default_dtype() at construction


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_te_module_default_init_std_is_0023(kind):
    weight = BUILDERS[kind]().weight.detach()
    assert abs(float(weight.std()) - 0.023) < 0.002 and abs(float(weight.mean())) < 0.002


def test_ported_te_linear_trains_every_weight_with_adamw():
    """The issue's reproduction: ``te.Linear(n, n)`` + ``AdamW(lr=1e-4)``: with TE's FP32 default
    every weight moves (bf16 parameters, the old default, kept 74% unchanged after 30 steps)."""
    rand = seeded_randn(3)
    layer = te_npu.TELinear(256, 256)
    start = layer.weight.detach().clone()
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-4)
    for _ in range(30):
        optimizer.zero_grad()
        layer(rand(64, 256, dtype=torch.float32)).pow(2).mean().backward()
        optimizer.step()
    assert float((layer.weight.detach() == start).float().mean()) == 0.0


def test_te_grouped_linear_init_method_sees_each_expert_weight():
    """TE calls ``init_method(weight{g})`` on each ``[out, in]`` weight: fan-based inits come out per
    expert (xavier std sqrt(2 / (in + out))), equal to initialising each expert on its own."""
    def build():
        with torch.random.fork_rng():
            torch.manual_seed(5)
            return te_npu.TEGroupedLinear(8, 256, 128, init_method=nn.init.xavier_normal_, bias=False)

    def reference():
        with torch.random.fork_rng():
            torch.manual_seed(5)
            return torch.stack([nn.init.xavier_normal_(torch.empty(128, 256)) for _ in range(8)])

    weight = build().weight.detach()
    assert torch.equal(weight, reference())
    want = (2.0 / (256 + 128)) ** 0.5
    assert all(abs(float(w.std()) / want - 1) < 0.05 for w in weight)


def test_te_grouped_linear_init_method_initialises_quantized_experts_through_their_values():
    with te_npu.quantized_model_init(recipe=te_npu.MXFP8BlockRecipe()):
        layer = te_npu.TEGroupedLinear(2, 64, 64, init_method=nn.init.ones_, bias=False)
    assert torch.equal(layer.weight.dequantize(), torch.ones(2, 64, 64))


@pytest.mark.parametrize("build", [lambda *a: te_npu.TELinear(64, 96, *a),
                                   lambda *a: te_npu.TEGroupedLinear(3, 64, 96, *a)], ids=list(BUILDERS))
def test_te_modules_take_only_their_sizes_positionally(build):
    """TE's next positional argument is ``sequence_parallel``; ``TELinear(a, b, False)`` meant
    bias=False here once: refused rather than read either way."""
    with pytest.raises(TypeError, match="pass every other argument by keyword .* would be sequence_parallel, not bias"):
        build(False)


# Every TE keyword that is not a constructor parameter: the value TE users pass at TP = 1 builds the
# module; a value asking for something te_npu does not do raises with the reason.
ACCEPTED = {
    "sequence_parallel": True, "tp_group": None, "tp_size": 1, "parallel_mode": "column", "ub_name": "qkv",
    "delay_wgrad_compute": False, "save_original_input": False, "ub_overlap_ag": False, "ub_overlap_rs": False,
    "ub_overlap_rs_dgrad": True, "ub_bulk_dgrad": True, "ub_bulk_wgrad": True, "symmetric_ar_type": "one_shot",
    "parameters_split": None, "single_grouped_weight": True, "single_grouped_bias": False, "use_grouped_tensor": True,
}
SHARED_REFUSALS = {
    "tp_size": (2, "no tensor parallelism"), "tp_group": (object(), "only None or a one-rank group"),
    "parallel_mode": ("diagonal", "TE's modes are"), "delay_wgrad_compute": (True, "no deferred backward_dw"),
    "save_original_input": (True, "never the original input"),
}
REFUSED = {
    "TELinear": {**SHARED_REFUSALS, "symmetric_ar_type": ("ring", "tensor-parallel"),
                 "parameters_split": (("q", "k", "v"), "one weight parameter per TELinear")},
    "TEGroupedLinear": {**SHARED_REFUSALS, "ub_overlap_ag": (True, "does not support Userbuffers overlap"),
                        "ub_overlap_rs": (True, "does not support Userbuffers overlap"),
                        "use_grouped_tensor": ("yes", "implementation choice")},
}
TABLES = {"TELinear": LINEAR_OPTIONS, "TEGroupedLinear": GROUPED_LINEAR_OPTIONS}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_te_module_takes_every_te_keyword_or_refuses_it_with_the_reason(kind):
    for name in TABLES[kind]:
        assert BUILDERS[kind](**{name: ACCEPTED[name]}).weight.shape[-2:] == (96, 64), name
    for name, (value, reason) in REFUSED[kind].items():
        with pytest.raises(ConfigError, match=rf"{kind}: {name}=.* is not supported: .*{reason}"):
            BUILDERS[kind](**{name: value})
    with pytest.raises(TypeError, match=rf"{kind}\(\) got an unexpected keyword argument 'fp8_typo'"):
        BUILDERS[kind](fp8_typo=True)


def test_te_module_accepts_a_one_rank_tp_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert te_npu.TELinear(64, 96, tp_group=dist.new_group([0]), tp_size=1).weight.shape == (96, 64)
    finally:
        dist.destroy_process_group()


def test_te_module_forward_refuses_fp8_outputs_and_buffers(rand):
    x = rand(32, 64, dtype=torch.float32)
    linear, grouped = BUILDERS["TELinear"](), BUILDERS["TEGroupedLinear"]()
    assert torch.equal(linear(x, fp8_output=False, fp8_grad=False), linear(x))
    with pytest.raises(ConfigError, match="fp8_output=True is not supported: .*never FP8 tensors"):
        linear(x, fp8_output=True)
    with pytest.raises(ConfigError, match="out=.* is not supported: preallocated output buffers"):
        grouped(x, [10, 10, 12], out=torch.empty(32, 96))
    with pytest.raises(TypeError, match="unexpected keyword argument 'fp8_output'"):
        grouped(x, [10, 10, 12], fp8_output=False)  # TE's GroupedLinear.forward has no such keyword


def test_te_module_name_is_its_fqn_until_assign_fqns():
    layer = te_npu.TELinear(64, 96, name="decoder.fc1")
    with pytest.raises(te_npu.LowPrecisionUnavailableError, match=r"^decoder\.fc1: "):
        with te_npu.autocast(recipe=te_npu.MXFP8BlockRecipe()):
            layer(torch.zeros(31, 64, requires_grad=True))  # M = 31: no MXFP8 wgrad
    te_npu.assign_fqns(torch.nn.ModuleDict({"fc": layer}))
    assert layer.fqn == "fc"


def test_te_module_inits_inside_the_rng_tracker_fork():
    """Megatron's ``get_cuda_rng_tracker``: TE draws each weight inside ``tracker.fork(rng_tracker_name)``."""
    forks = []

    class Tracker:
        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            forks.append(name)
            with torch.random.fork_rng():
                torch.manual_seed(11)
                yield

    tracker = Tracker()
    layer = te_npu.TEGroupedLinear(2, 64, 32, get_rng_state_tracker=lambda: tracker, rng_tracker_name="expert-rng")
    assert forks == ["expert-rng", "expert-rng"]
    with torch.random.fork_rng():
        torch.manual_seed(11)
        want = nn.init.normal_(torch.empty(32, 64), std=0.023)
    assert torch.equal(layer.weight[0].detach(), want) and torch.equal(layer.weight[1].detach(), want)
    te_npu.TELinear(64, 32, get_rng_state_tracker=lambda: tracker)
    assert forks[-1] == "model-parallel-rng"


@pytest.mark.parametrize("splits", [[32.5, 31.5], [32.0, 32.0], torch.tensor([32.0, 32.0]), torch.tensor([True, False])],
                         ids=["fractional", "integral_floats", "float_tensor", "bool_tensor"])
@pytest.mark.parametrize("recipe", [None, te_npu.MXFP8BlockRecipe()], ids=["plain", "mxfp8"])
def test_te_grouped_linear_refuses_non_integer_splits(splits, recipe):
    layer = te_npu.TEGroupedLinear(2, 64, 64, bias=False)
    with pytest.raises(TypeError, match="m_splits must hold integer group sizes"):
        with te_npu.autocast(enabled=recipe is not None, recipe=recipe):
            layer(torch.zeros(64, 64), splits)


@contextlib.contextmanager
def _default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
