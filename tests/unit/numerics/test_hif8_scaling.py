"""HiF8 current scaling: ``current_scale``, ``quantize`` and ``dequantize``."""
import math

import numpy as np
import pytest
import torch

from te_npu.numerics import hif8
from te_npu.numerics.constants import HIF8_GRAD_MAX, HIF8_INPUT_MAX, HIF8_NAN, HIF8_NEG_INF, HIF8_POS_INF

SCALE_CASES = [
    ("finite", 30.0, 15.0, 2.0),  # amax / format_max
    ("zero_amax", 0.0, 15.0, 1.0),  # all-zero tensor: unit scale
    ("inf_amax", math.inf, 15.0, 1.0),
    ("nan_amax", math.nan, 15.0, 1.0),
    ("grad", 448.0, 224.0, 2.0),
]


@pytest.mark.parametrize("amax, fmax, expected", [c[1:] for c in SCALE_CASES], ids=[c[0] for c in SCALE_CASES])
def test_hif8_current_scale_cases(amax, fmax, expected):
    scale = hif8.current_scale(torch.tensor(amax), fmax)
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert float(scale) == expected


def test_hif8_current_scale_per_group():
    amax = torch.tensor([15.0, 0.0, math.inf, 1.5])
    tenth = float(np.float32(1.5) * (np.float32(1.0) / np.float32(15.0)))  # kernel formula: 0.1f + 1 ulp
    assert tenth != float(np.float32(0.1))
    assert torch.equal(hif8.current_scale(amax, HIF8_INPUT_MAX), torch.tensor([1.0, 1.0, 1.0, tenth]))


def _one_binade_fp32() -> np.ndarray:
    """Every float32 in [1, 2): all 2**23 mantissas."""
    return (np.arange(1 << 23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)


@pytest.mark.parametrize("fmax", [HIF8_INPUT_MAX, HIF8_GRAD_MAX], ids=["input", "grad"])
def test_hif8_current_scale_multiplies_by_fp32_reciprocal_as_the_kernel(fmax):
    """ops-nn quant/dynamic_quant/op_kernel/arch35/dynamic_quant_regbase_full_load_pertensor.h
    (ComputeMaxRowScaleVF): ``Muls(|x|, float(1.0) / maxValue)`` then a max, all FP32. The
    reference below is numpy FP32 arithmetic, independent of torch. One binade is exhaustive
    for every amax whose scale is a normal float: scaling amax by 2**k scales both exact
    results by 2**k, so they round alike."""
    amax = _one_binade_fp32()
    kernel = amax * (np.float32(1.0) / np.float32(fmax))  # FP32 product with the FP32 reciprocal
    spec = amax / np.float32(fmax)  # the spec's amax / format_max, one FP32 division
    got = hif8.current_scale(torch.from_numpy(amax), fmax).numpy()
    assert np.array_equal(got.view(np.uint32), kernel.view(np.uint32))
    differ = np.count_nonzero(kernel != spec)
    assert differ > 0  # the formulas do differ: following the kernel is a real choice
    assert np.all(np.abs(kernel.view(np.int32) - spec.view(np.int32)) <= 1)  # by one ulp at most


def test_hif8_reciprocal_format_max_is_the_fp32_division():
    for fmax in (15.0, 224.0, 448.0, 7.0):
        assert hif8.reciprocal_format_max(fmax) == float(np.float32(1.0) / np.float32(fmax))


@pytest.mark.parametrize("fmax", [HIF8_INPUT_MAX, HIF8_GRAD_MAX], ids=["input", "grad"])
def test_hif8_quantize_amax_lands_on_format_max(fmax, gen):
    x = torch.randn(64, 64, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    scale = hif8.current_scale(x.abs().amax(), fmax)
    codes = hif8.quantize(x, scale)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert float(hif8.decode(codes).abs().max()) == fmax  # 15 and 224 are HiF8 values
    assert torch.equal(codes, hif8.encode(x.float() / scale))


def test_hif8_quantize_per_group_scale(gen):
    x = torch.randn(3, 8, 16, generator=gen) * torch.tensor([1.0, 100.0, 1e-3]).view(3, 1, 1)
    scale = hif8.current_scale(x.abs().amax(dim=(1, 2)), HIF8_INPUT_MAX)  # [E]
    codes = hif8.quantize(x, scale)
    for e in range(3):
        assert torch.equal(codes[e], hif8.encode(x[e] / scale[e]))
    deq = hif8.dequantize(codes, scale)
    assert torch.equal(deq, hif8.decode(codes) * scale.view(3, 1, 1))


def test_hif8_quantize_keeps_nan_and_inf(gen):
    x = torch.tensor([1.0, math.nan, math.inf, -math.inf, 3.0])
    codes = hif8.quantize(x, torch.tensor(0.2))
    assert codes.tolist()[1:4] == [HIF8_NAN, HIF8_POS_INF, HIF8_NEG_INF]


def test_hif8_dequantize_scalar_scale():
    codes = torch.tensor([0x08, 0x10, 0x88], dtype=torch.uint8)  # 1, 2, -1
    assert torch.equal(hif8.dequantize(codes, torch.tensor(0.5)), torch.tensor([0.5, 1.0, -0.5]))
