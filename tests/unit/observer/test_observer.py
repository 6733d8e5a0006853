"""``PrecisionObserver`` around TE modules: figures per GEMM and role against hand-made inputs,
micro-batch accumulation, selection of steps / layers / roles, nothing done when off, the NPU
path (the fake torch_npu) and the config section's errors."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch import nn

import te_npu
from te_npu import compat, events
from te_npu.errors import ConfigError
from te_npu.observer import ObserverConfig, PrecisionObserver

ON = ObserverConfig(enabled=True, freq=1)


def _pattern_input(rows: int) -> torch.Tensor:
    """Every 32-column block of every row holds 1.0 (column 0) and 2**-20 (column 1), else 0.
    Row blocks (fprop): the ceil scale of amax 1.0 is 2**-8, so 2**-20 -> 2**-12, below E4M3's
    half-quantum 2**-10: it underflows (1 of 2 non-zero values). Col blocks (wgrad) hold one
    magnitude each: exact."""
    x = torch.zeros(rows, 64)
    x[:, 0::32] = 1.0
    x[:, 1::32] = 2.0**-20
    return x


def _model(*layers: nn.Module) -> nn.Module:
    model = nn.Sequential(*layers)
    te_npu.assign_fqns(model)
    return model


def _init(w: torch.Tensor) -> None:
    with torch.no_grad():
        w.copy_(torch.linspace(-1, 1, w.numel()).reshape(w.shape))


def test_mxfp8_linear_activation_figures_versus_hand_counts_over_two_micro_batches():
    model = _model(te_npu.TELinear(64, 32, bias=False, params_dtype=torch.float32, init_method=_init))
    observer = PrecisionObserver(ON, model)
    with observer.step(1) as observed:
        for _ in range(2):  # two micro-batches add into the step
            with te_npu.autocast(recipe=te_npu.MXFP8BlockRecipe()):
                y = model(_pattern_input(32).requires_grad_())
            y.sum().backward()
    figs = observed.figures.tensors
    fprop, wgrad = figs["0/activation.fprop"], figs["0/activation.wgrad"]
    blocks = 2 * 32 * 2  # micro-batches x rows x blocks per row
    assert fprop.elements == 2 * 32 * 64 and fprop.underflow == 0.5
    sig, err = blocks * (1.0 + 2.0**-40), blocks * 2.0**-40
    assert fprop.sqnr_db == pytest.approx(10 * math.log10(sig / err), rel=1e-12)
    assert (fprop.scale_min, fprop.scale_max, fprop.amax) == (-8.0, -8.0, 1.0)
    assert fprop.block_dynamic_range == 20.0
    assert (wgrad.underflow, wgrad.sqnr_db, wgrad.block_dynamic_range) == (0.0, math.inf, 0.0)
    assert sorted(figs) == sorted(f"0/{r}" for r in ("activation.fprop", "activation.wgrad", "weight.fprop",
                                                       "weight.dgrad", "grad_output.dgrad", "grad_output.wgrad"))
    # dY of y.sum() is all ones: exact in both formats' copies
    assert figs["0/grad_output.dgrad"].sqnr_db == math.inf and figs["0/grad_output.dgrad"].elements == 2 * 32 * 32
    metrics = observed.figures.metrics()
    assert metrics["precision/0/activation.fprop/underflow"] == 0.5
    assert metrics["precision/0/grad_output.wgrad/sqnr_db"] is None  # inf: JSON null
    assert observed.figures.summary().startswith("precision: min SQNR ")
    assert "max underflow 50.00% 0/activation.fprop" in observed.figures.summary()


def test_hif8_linear_one_copy_reported_for_each_gemm_versus_hand_scale():
    """HiF8 activation scale = amax / 15 (one FP32 scale for the fprop and wgrad copy)."""
    model = _model(te_npu.TELinear(64, 32, bias=False, params_dtype=torch.float32, init_method=_init))
    observer = PrecisionObserver(ON, model)
    x = torch.full((4, 64), 3.0)
    x[:, 1] = 2.0**-40  # 2**-40 / (3 / 15) is far below 2**-23: underflows
    with observer.step(1) as observed:
        with te_npu.autocast(recipe=te_npu.HiF8CurrentScalingRecipe()):
            model(x.requires_grad_()).sum().backward()
    fprop, wgrad = observed.figures.tensors["0/activation.fprop"], observed.figures.tensors["0/activation.wgrad"]
    assert fprop == wgrad
    assert fprop.underflow == 1 / 64 and fprop.clipped == 0.0
    assert fprop.scale_min == fprop.scale_max == pytest.approx(3.0 / 15, rel=1e-6)
    assert fprop.block_dynamic_range is None


def test_steps_layers_and_roles_select_what_is_observed():
    cfg = ObserverConfig(enabled=True, freq=5, start_step=10, end_step=20)
    assert [s for s in range(30) if cfg.selects(s)] == [10, 15, 20]
    assert not ObserverConfig().selects(0)  # off by default
    model = _model(te_npu.TELinear(64, 32, bias=False), te_npu.TELinear(32, 32, bias=False))
    observer = PrecisionObserver(ObserverConfig(enabled=True, freq=1, layers=("1",), roles=("grad_output",)), model)
    assert observer.begin_step(7)
    with te_npu.autocast(recipe=te_npu.MXFP8BlockRecipe()):
        y = model(torch.randn(32, 64, dtype=torch.bfloat16))
    y.float().sum().backward()
    assert sorted(observer.end_step().tensors) == ["1/grad_output.dgrad", "1/grad_output.wgrad"]


def test_observer_off_adds_no_op_and_no_subscription():
    """Off (the default), or on a step it does not select: the step runs the same aten ops as
    without an observer and nothing listens to the event stream."""
    class Ops(compat.torch_dispatch_mode()):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    model = _model(te_npu.TELinear(64, 32, bias=False))
    x = torch.randn(32, 64, dtype=torch.bfloat16)

    def step():
        model.zero_grad(set_to_none=True)  # every step starts without a gradient to accumulate into
        with Ops() as counter:
            with te_npu.autocast(recipe=te_npu.MXFP8BlockRecipe()):
                y = model(x)
            y.float().sum().backward()
        return counter.ops

    baseline = step()
    for observer, number in ((PrecisionObserver(ObserverConfig(), model), 1),
                             (PrecisionObserver(ObserverConfig(enabled=True, freq=10), model), 3)):
        with observer.step(number) as observed:
            assert not events.has_subscribers()
            assert step() == baseline
        assert observed.figures is None


def test_npu_path_figures_come_from_the_kernels_outputs(monkeypatch):
    """Through the fake torch_npu the operands carry the kernels' scale layout; the figures read
    them and equal the emulation's (the fake's kernels are bit-exact to it)."""
    from te_npu.ops import force_backend
    from tests.npu_backend import install_npu_backend

    def run():
        model = _model(te_npu.TELinear(64, 32, bias=False, params_dtype=torch.float32, init_method=_init))
        observer = PrecisionObserver(ON, model)
        layouts = []
        with events.subscribe(lambda e: layouts.append(e.operand.scale_layout), events.OperandEvent):
            with observer.step(1) as observed:
                with te_npu.autocast(recipe=te_npu.MXFP8BlockRecipe()):
                    model(_pattern_input(32).requires_grad_()).sum().backward()
        return observed.figures, set(layouts)

    emulated, emulated_layouts = run()
    fake = install_npu_backend(monkeypatch)
    with force_backend("npu"):
        on_npu, npu_layouts = run()
    assert fake.calls_of("npu_dynamic_mx_quant") and npu_layouts == {"npu"} and emulated_layouts == {"canonical"}
    assert on_npu.tensors == emulated.tensors
    assert on_npu.tensors["0/activation.fprop"].underflow == 0.5


@pytest.mark.parametrize("raw, key", [
    ({"freq": 0}, "precision_observer.freq"),
    ({"roles": ["activations"]}, "precision_observer.roles"),
    ({"stats": ["snr"]}, "precision_observer.stats"),
    ({"layers": "*"}, "precision_observer.layers"),
    ({"start_step": 5, "end_step": 2}, "precision_observer.end_step"),
    ({"every": 3}, "precision_observer.every"),
])
def test_config_errors_name_the_key(raw, key):
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        ObserverConfig.from_config({"enabled": True, **raw})


def test_config_round_trips_through_its_mapping():
    cfg = ObserverConfig.from_config({"enabled": True, "layers": ["layers.*.mlp.*"], "freq": 7, "stats": ["sqnr_db"]})
    assert ObserverConfig.from_config(cfg.to_config()) == cfg
