"""One table of bit-identical kernel variants; the active one is chosen by ``use_quant_kernel``
(a run: once, from ``training.quant_kernel``), never by a per-call setting."""
import pytest
import torch

import te_npu
from te_npu import ops
from te_npu.numerics import hif8
from te_npu.ops import emulation
from te_npu.ops.kernels import (
    KERNELS,
    QUANT_KERNEL_METHODS,
    QuantKernels,
    QuantKernelUnavailable,
    active_quant_kernels,
    choose_quant_kernel,
    native_cpu,
    quant_kernel_device_problem,
)
from tests.unit.functional.gemm_reference import RECIPES


def _route_compiled_to_eager(monkeypatch) -> list[str]:
    """Record which numerics function each compiled kernel compiles, and run it uncompiled: the
    routing is under test here, the compiled graphs' bitwise equality is proven by
    test_compiled_equivalence.py (slow)."""
    calls = []
    monkeypatch.setattr(KERNELS["compiled"], "compiled", lambda fn: calls.append(fn.__name__) or fn)
    return calls


def test_kernel_table_holds_the_three_variants_behind_one_interface():
    assert list(KERNELS) == ["eager", "compiled", "native"]
    for name, kernels in KERNELS.items():
        assert isinstance(kernels, QuantKernels) and kernels.name == name
        assert all(callable(getattr(kernels, method)) for method in QUANT_KERNEL_METHODS)


def test_default_is_eager_and_unknown_names_are_refused():
    assert active_quant_kernels() is KERNELS["eager"]
    with pytest.raises(ValueError, match=r"unknown quantization kernel 'triton'.*eager.*compiled.*native"):
        with ops.use_quant_kernel("triton"):
            pass


def test_blocks_nest_and_restore_the_previous_variant_even_on_error():
    with ops.use_quant_kernel("native"):
        with ops.use_quant_kernel("compiled"):
            assert active_quant_kernels() is KERNELS["compiled"]
        assert active_quant_kernels() is KERNELS["native"]
        with pytest.raises(RuntimeError, match="boom"):
            with ops.use_quant_kernel("eager"):
                raise RuntimeError("boom")
        assert active_quant_kernels() is KERNELS["native"]
    assert active_quant_kernels() is KERNELS["eager"]


def test_native_runs_its_kernels_for_cpu_tensors_and_32_blocks_only(monkeypatch):
    calls = []
    original = native_cpu.quantize
    monkeypatch.setattr(native_cpu, "quantize", lambda *a, **k: calls.append(k.get("axis")) or original(*a, **k))
    native = KERNELS["native"]
    native.mxfp8_quantize(torch.zeros(64, 64, device="meta"))  # not a CPU tensor: the inherited eager code
    native.mxfp8_quantize(torch.zeros(64, 64), block_size=16)
    assert calls == []
    native.mxfp8_quantize(torch.zeros(64, 64))
    assert calls == [-1]


def test_compiled_routes_every_quantization_to_a_compiled_numerics_function(monkeypatch):
    calls = _route_compiled_to_eager(monkeypatch)
    x = torch.randn(64, 64)
    with ops.use_quant_kernel("compiled"):
        ops.mxfp8_quantize(x, axis=-2)
        ops.mxfp8_quantize_dual(x)
        ops.mxfp8_quantize_grouped(x, torch.tensor([20, 44]))
        codes, scale = ops.hif8_quantize(x, 15.0)
        ops.hif8_quantize_with_scale(x, scale)
    assert calls == ["quantize", "dual_block_scales", "quantize_with_dual_scales", "quantize_ragged",
                     "quantize_current", "quantize"]
    assert torch.equal(codes, hif8.quantize(x, hif8.current_scale(x.abs().amax(), 15.0)))


def test_compiled_also_decodes_every_operand_compiled(monkeypatch):
    from te_npu.quantizers import HiF8Quantizer, MXFP8Quantizer

    x = torch.randn(64, 96)
    row = MXFP8Quantizer().quantize(x, orientation="row")
    col = MXFP8Quantizer().quantize(x, orientation="col")
    ragged = MXFP8Quantizer().quantize(x, orientation="col", group_list=torch.tensor([30, 34]))
    codes = HiF8Quantizer(15.0).quantize(x, orientation="row")
    eager = [emulation.decode(op) for op in (row, col, ragged, codes)]
    calls = _route_compiled_to_eager(monkeypatch)
    with ops.use_quant_kernel("compiled"):
        routed = [emulation.decode(op) for op in (row, col, ragged, codes)]
    assert calls == ["dequantize", "dequantize", "dequantize_ragged", "decode"]
    for a, b in zip(eager, routed):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- choosing once
def test_auto_picks_native_for_a_cpu_run_that_quantizes_when_it_builds():
    assert native_cpu.is_available(), "the native kernel must build here (C++ compiler + ninja)"
    choice = choose_quant_kernel("auto", "cpu")
    assert choice.name == "native" and "built here" in choice.reason


def test_auto_picks_eager_and_says_why_otherwise(monkeypatch):
    assert choose_quant_kernel("auto", "cpu", quantizes=False).name == "eager"  # BF16 run: no build
    cuda = choose_quant_kernel("auto", "cuda")
    assert cuda.name == "eager" and "CPU-only" in cuda.reason
    monkeypatch.setattr(KERNELS["native"], "availability", lambda: (False, "no compiler"))
    unbuilt = choose_quant_kernel("auto", "cpu")
    assert unbuilt.name == "eager" and "no compiler" in unbuilt.reason


def test_a_named_kernel_that_cannot_run_raises_instead_of_falling_back(monkeypatch):
    monkeypatch.setattr(KERNELS["native"], "availability", lambda: (False, "no compiler"))
    with pytest.raises(QuantKernelUnavailable, match="'native' kernels cannot run here: no compiler"):
        choose_quant_kernel("native", "cpu")
    with pytest.raises(QuantKernelUnavailable, match="cpu tensors only, not on 'cuda'"):
        choose_quant_kernel("native", "cuda")
    assert choose_quant_kernel("eager", "cpu").name == "eager"


@pytest.mark.parametrize(("name", "device", "bad"), [
    ("native", "cuda", True), ("native", "npu", True), ("compiled", "npu", True), ("compiled", "cuda", False),
    ("eager", "npu", False), ("auto", "npu", False), ("native", "cpu", False),
])
def test_device_rules_of_each_variant(name, device, bad):
    assert (quant_kernel_device_problem(name, device) is not None) == bad


# ---------------------------------------------------------------- whole steps (slow: they compile)
@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_step_with_compiled_kernels_matches_eager_bitwise(recipe):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=gen).to(torch.bfloat16)
    eager_layer = te_npu.TELinear(128, 96, params_dtype=torch.bfloat16, bias=False)
    compiled_layer = te_npu.TELinear(128, 96, params_dtype=torch.bfloat16, bias=False)
    compiled_layer.load_state_dict(eager_layer.state_dict())

    def step(layer):
        inp = x.clone().requires_grad_(True)
        with te_npu.autocast(recipe=recipe):
            out = layer(inp)
        out.float().square().sum().backward()
        return out.detach(), inp.grad, layer.weight.grad

    eager = step(eager_layer)
    with ops.use_quant_kernel("compiled"):
        compiled = step(compiled_layer)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_experts_step_with_compiled_kernels_matches_eager_bitwise(recipe):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(90, 128, generator=gen).to(torch.bfloat16)
    torch.manual_seed(0)
    experts = te_npu.TEGroupedSwiGLUExperts(4, 128, 64, params_dtype=torch.bfloat16)

    def step(splits):
        experts.zero_grad()
        inp = x.clone().requires_grad_(True)
        with te_npu.autocast(recipe=recipe):
            out = experts(inp, splits)
        out.float().square().sum().backward()
        return [out.detach(), inp.grad] + [p.grad for p in experts.parameters()]

    for splits in ([40, 0, 17, 33], [2, 70, 18, 0]):  # a routing change: no recompile needed
        eager = step(splits)
        with ops.use_quant_kernel("compiled"):
            compiled = step(splits)
        for a, b in zip(eager, compiled, strict=True):
            assert torch.equal(a, b)
