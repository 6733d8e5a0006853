"""``TE_NPU_QUANT_KERNEL`` picks which bit-identical quantization kernel the emulation backend runs."""
import pytest
import torch

import te_npu
from te_npu import ops
from te_npu.numerics import compiled, hif8, mxfp8
from te_npu.ops import emulation
from tests.unit.functional.gemm_reference import RECIPES


def _spy(monkeypatch, module, names, calls):
    for name in names:
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))


def test_default_is_eager_and_unknown_values_are_refused(monkeypatch):
    x = torch.zeros(64, 64)
    monkeypatch.delenv(emulation.QUANT_KERNEL_ENV, raising=False)
    assert emulation.quant_kernel(x) == "eager"
    monkeypatch.setenv(emulation.QUANT_KERNEL_ENV, "triton")
    with pytest.raises(ValueError, match=r"TE_NPU_QUANT_KERNEL='triton'.*eager.*compiled.*native"):
        ops.mxfp8_quantize(x)


def test_native_applies_to_cpu_tensors_only(monkeypatch):
    monkeypatch.setenv(emulation.QUANT_KERNEL_ENV, "native")
    assert emulation.quant_kernel(torch.zeros(64, 64)) == "native"
    assert emulation.quant_kernel(torch.zeros(64, 64, device="meta")) == "eager"
    assert emulation.quant_kernel(torch.zeros(64, 64), block_size=16) == "eager"


def test_compiled_routes_every_dense_quantization_to_the_compiled_kernels(monkeypatch):
    calls = []
    # stand-ins that run the eager math: the routing is under test here, the kernels' bitwise
    # equality is proven by test_compiled_equivalence.py (slow)
    monkeypatch.setattr(compiled, "quantize_compiled",
                        lambda x, axis, block_size, scale_alg: calls.append("mx") or mxfp8.quantize(x, axis, block_size, scale_alg))
    monkeypatch.setattr(compiled, "quantize_dual_compiled",
                        lambda x, block_size, scale_alg: calls.append("dual") or mxfp8.quantize_dual(x, block_size, scale_alg))
    monkeypatch.setattr(compiled, "quantize_grouped_compiled",
                        lambda x, sizes, block_size, scale_alg: calls.append("ragged") or mxfp8.quantize_grouped(
                            x, sizes, block_size, scale_alg))
    monkeypatch.setattr(compiled, "hif8_quantize_compiled",
                        lambda x, scale: calls.append("hif8") or hif8.quantize(x, scale))
    monkeypatch.setenv(emulation.QUANT_KERNEL_ENV, "compiled")
    x = torch.randn(64, 64)
    ops.mxfp8_quantize(x, axis=-2)
    ops.mxfp8_quantize_dual(x)
    ops.mxfp8_quantize_grouped(x, torch.tensor([20, 44]))
    codes, scale = ops.hif8_quantize(x, 15.0)
    ops.hif8_quantize_with_scale(x, scale)
    assert calls == ["mx", "dual", "ragged", "hif8", "hif8"]
    assert torch.equal(codes, hif8.quantize(x, hif8.current_scale(x.abs().amax(), 15.0)))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_step_with_compiled_kernels_matches_eager_bitwise(monkeypatch, recipe):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=gen).to(torch.bfloat16)
    eager_layer = te_npu.TELinear(128, 96, params_dtype=torch.bfloat16)
    compiled_layer = te_npu.TELinear(128, 96, params_dtype=torch.bfloat16)
    compiled_layer.load_state_dict(eager_layer.state_dict())

    def step(layer):
        inp = x.clone().requires_grad_(True)
        with te_npu.autocast(recipe=recipe):
            out = layer(inp)
        out.float().square().sum().backward()
        return out.detach(), inp.grad, layer.weight.grad

    monkeypatch.delenv(emulation.QUANT_KERNEL_ENV, raising=False)
    eager = step(eager_layer)
    monkeypatch.setenv(emulation.QUANT_KERNEL_ENV, "compiled")
    for a, b in zip(eager, step(compiled_layer)):
        assert torch.equal(a, b)


def test_compiled_also_decodes_every_operand_compiled(monkeypatch):
    from te_npu.quantizers import HiF8Quantizer, MXFP8Quantizer

    calls = []
    monkeypatch.setattr(compiled, "mxfp8_dequantize_compiled",
                        lambda data, scale, axis, bs, dtype, shift: calls.append(("mx", axis)) or mxfp8.dequantize(data, scale, axis, bs).to(dtype))
    monkeypatch.setattr(compiled, "hif8_decode_compiled", lambda codes, dtype: calls.append(("hif8",)) or hif8.decode(codes).to(dtype))
    monkeypatch.setattr(compiled, "mxfp8_dequantize_grouped_compiled",
                        lambda data, scale, sizes, dtype, shift: calls.append(("ragged",)) or mxfp8.dequantize_grouped(
                            data, scale, sizes).to(dtype))
    x = torch.randn(64, 96)
    row = MXFP8Quantizer().quantize(x, orientation="row")
    col = MXFP8Quantizer().quantize(x, orientation="col")
    ragged = MXFP8Quantizer().quantize(x, orientation="col", group_list=torch.tensor([30, 34]))
    codes = HiF8Quantizer(15.0).quantize(x, orientation="row")
    eager = [emulation.decode(op) for op in (row, col, ragged, codes)]
    monkeypatch.setenv(emulation.QUANT_KERNEL_ENV, "compiled")
    assert calls == []
    routed = [emulation.decode(op) for op in (row, col, ragged, codes)]
    assert calls == [("mx", -1), ("mx", -2), ("ragged",), ("hif8",)]
    for a, b in zip(eager, routed):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_experts_step_with_compiled_kernels_matches_eager_bitwise(monkeypatch, recipe):
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
        monkeypatch.delenv(emulation.QUANT_KERNEL_ENV, raising=False)
        eager = step(splits)
        monkeypatch.setenv(emulation.QUANT_KERNEL_ENV, "compiled")
        for a, b in zip(eager, step(splits), strict=True):
            assert torch.equal(a, b)
