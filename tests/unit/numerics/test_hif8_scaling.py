"""HiF8 current scaling: ``current_scale``, ``quantize`` and ``dequantize``."""
import math

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
    assert torch.equal(hif8.current_scale(amax, HIF8_INPUT_MAX), torch.tensor([1.0, 1.0, 1.0, 0.1]))


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
