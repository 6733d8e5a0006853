"""``HiF8Quantizer`` (current scaling) and ``hif8_amax``: the FP32 scale ``amax * (1.0f / max)``
computed here with FP32 numpy scalars, per tensor or per expert; codes of ``x / scale`` (decoded
back within HiF8's rounding); the given-scale path; what each call reports."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from te_npu.events import QuantEvent, subscribe
from te_npu.formats import Format
from te_npu.numerics import hif8
from te_npu.quantizers import HiF8Quantizer, Quantizer
from te_npu.quantizers.hif8 import hif8_amax


def reference_scale(amax: float, format_max: float) -> torch.Tensor:
    """The A5 kernel's scale: the FP32 product of the amax and the FP32 reciprocal of the maximum."""
    return torch.tensor(np.float32(amax) * (np.float32(1.0) / np.float32(format_max)), dtype=torch.float32)


@pytest.mark.parametrize("format_max", [15.0, 224.0])
def test_hif8_quantizer_scale_is_amax_times_fp32_reciprocal(spread, format_max):
    x = spread(64, 96)
    op = HiF8Quantizer(format_max).quantize(x, orientation="row")
    amax = float(x.float().abs().max())
    assert op.format == Format.HIF8 and op.scale.dtype == torch.float32 and op.scale.shape == ()
    assert torch.equal(op.scale, reference_scale(amax, format_max))
    # the codes hold x / scale: within HiF8's coarsest relative step (1 mantissa bit: 2**-2) of it
    scaled = x.float() / op.scale
    decoded = hif8.decode(op.data)
    assert decoded.abs().max() <= format_max * 1.25
    torch.testing.assert_close(decoded, scaled, rtol=2**-2, atol=2**-16)


def test_hif8_quantizer_3d_weight_gets_one_scale_per_expert(spread):
    w = spread(4, 64, 32)
    w[2] *= 1000
    op = HiF8Quantizer(15.0).quantize(w, orientation="row")
    want = torch.stack([reference_scale(float(w[e].float().abs().max()), 15.0) for e in range(4)])
    assert op.scale.shape == (4,) and torch.equal(op.scale, want)
    for e in range(4):
        assert torch.equal(op.data[e], HiF8Quantizer(15.0).quantize_with_scale(w[e], op.scale[e]).data)


def test_hif8_quantizer_codes_do_not_depend_on_orientation_or_group_list(spread):
    x = spread(64, 96)
    q = HiF8Quantizer(224.0)
    row, col = q.quantize(x, orientation="row"), q.quantize(x, orientation="col", group_list=torch.tensor([40, 24]))
    assert (row.orientation, col.orientation) == ("row", "col")
    assert torch.equal(row.data, col.data) and torch.equal(row.scale, col.scale)
    with pytest.raises(ValueError, match="orientation must be 'row' or 'col', got 'dual'"):
        q.quantize(x, orientation="dual")


def test_hif8_quantizer_zero_and_nan_tensors_get_scale_one(spread):
    q = HiF8Quantizer(15.0)
    zero = q.quantize(torch.zeros(32, 32, dtype=torch.bfloat16), orientation="row")
    assert torch.equal(zero.scale, torch.tensor(1.0)) and torch.count_nonzero(zero.data) == 0
    w = spread(3, 32, 32)
    w[1, 0, 0] = float("nan")
    op = q.quantize(w, orientation="row")
    assert op.scale[1] == 1.0 and op.scale[0] != 1.0 and op.data[1, 0, 0] == 0x80  # NaN code, group scale 1.0


def test_hif8_quantizer_empty_tensor_gets_scale_one_and_reports_amax_zero():
    """No element: amax 0, hence scale 1.0 (per expert for 3D); an amax over nothing used to raise."""
    q = HiF8Quantizer(15.0)
    seen = []
    with subscribe(seen.append, QuantEvent):
        flat, experts = (q.quantize(torch.zeros(shape, dtype=torch.bfloat16), orientation="col")
                         for shape in ((0, 64), (3, 0, 32)))
    assert flat.data.shape == (0, 64) and flat.data.dtype == torch.uint8 and torch.equal(flat.scale, torch.tensor(1.0))
    assert experts.data.shape == (3, 0, 32) and torch.equal(experts.scale, torch.ones(3))
    assert [float(e.amax.sum()) for e in seen] == [0.0, 0.0] and all(e.format_max == 15.0 for e in seen)


def test_hif8_quantize_with_scale_uses_the_given_scale_and_reports_its_amax(spread):
    x = spread(64, 96)
    q = HiF8Quantizer(15.0)
    amax = torch.tensor(float(x.float().abs().max()) * 4)  # e.g. the FSDP group's larger amax
    scale = hif8.current_scale(amax, 15.0)
    events = []
    with subscribe(events.append, QuantEvent):
        given = q.quantize_with_scale(x, scale, amax=amax)
        bare = q.quantize_with_scale(x, scale)
        current = q.quantize(x, orientation="col")
    assert given.scale is scale and torch.equal(given.data, bare.data)
    assert torch.equal(given.data, hif8.encode(x.float() / scale))
    assert not torch.equal(given.data, current.data)
    assert [(e.amax is amax, e.format_max) for e in events[:2]] == [(True, 15.0), (False, None)]
    assert events[2].format_max == 15.0 and torch.equal(events[2].scale, current.scale)
    assert torch.equal(events[2].amax, x.float().abs().max())


def test_hif8_amax_is_per_tensor_for_2d_and_per_expert_for_3d(spread):
    x, w = spread(64, 96), spread(4, 16, 8)
    assert hif8_amax(x).shape == () and hif8_amax(x).dtype == torch.float32
    assert torch.equal(hif8_amax(x), x.float().abs().max())
    assert torch.equal(hif8_amax(w), w.float().abs().amax(dim=(1, 2)))
    w[3, 1, 1] = float("nan")
    assert torch.isnan(hif8_amax(w)[3]) and not torch.isnan(hif8_amax(w)[:3]).any()


def test_hif8_quantizer_is_a_frozen_per_role_quantizer():
    q = HiF8Quantizer(15.0)
    assert isinstance(q, Quantizer) and q.format == Format.HIF8
    assert q == HiF8Quantizer(15.0) and q != HiF8Quantizer(224.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.format_max = 224.0
