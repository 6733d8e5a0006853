"""The fake's npu_dynamic_quant / npu_quantize (HiFloat8 and FP8 outputs) against the golden and
the kernel's scale rule."""
import numpy as np
import pytest
import torch

from tests.fakes import install_fake_torch_npu
from tests.fakes.dtypes import hif8_encode
from tests.unit.fakes import vendor_goldens


def _f32_bits(t) -> int:
    return int(torch.as_tensor(t, dtype=torch.float32).reshape(()).view(torch.int32)) & 0xFFFFFFFF


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_value", [0.0, 15.0, 224.0])
def test_pertensor_matches_golden(npu, gen, dtype, max_value):
    x = (torch.randn(33, 70, generator=gen) * 3).to(dtype)
    y, scale = npu.npu_dynamic_quant(x, dst_type=npu.hifloat8, quant_mode="pertensor", dst_type_max=max_value)
    gy, gs = vendor_goldens.dynamic_quant_pertensor_hif8(x.float().numpy(), max_value or 32768.0)
    assert y.dtype == torch.uint8 and scale.dtype == torch.float32 and scale.shape == (1,)
    assert _f32_bits(scale) == int(np.array(gs).view(np.uint32)) and torch.equal(y, torch.from_numpy(gy))


def test_pertensor_scale_is_amax_times_reciprocal_not_amax_over_max(npu):
    # scale = fp32(amax * fp32(1/15)): 0x3d911112 for amax 1.0625, where amax / 15 is 0x3d911111;
    # 0.00830078125 then codes to 0x53 (kernel) instead of 0x38.
    x = torch.tensor([[1.0625, 0.00830078125]], dtype=torch.bfloat16)
    y, scale = npu.npu_dynamic_quant(x, dst_type=npu.hifloat8, quant_mode="pertensor", dst_type_max=15.0)
    assert _f32_bits(scale) == 0x3D911112 != _f32_bits(torch.tensor(1.0625) / 15)
    assert y.tolist() == [[hif8_encode(torch.tensor(15.0)).item(), 0x53]]


def test_all_zero_tensor_gives_scale_zero_and_nan_codes(npu):
    # no zero guard in the kernel: scale 0, y = 0 / 0 -> HiFloat8 NaN (golden: en_dtypes NaN code 0x80)
    y, scale = npu.npu_dynamic_quant(torch.zeros(4, 8, dtype=torch.bfloat16), dst_type=npu.hifloat8,
                                     quant_mode="pertensor", dst_type_max=15.0)
    assert scale.tolist() == [0.0] and set(y.flatten().tolist()) == {0x80}
    gy, gs = vendor_goldens.dynamic_quant_pertensor_hif8(np.zeros((4, 8), np.float32), 15.0)
    assert gs == 0 and set(gy.flatten().tolist()) == {0x80}


def test_pertoken_and_perchannel_reduce_rows_and_columns(npu, gen):
    x = torch.randn(2, 6, 40, generator=gen).bfloat16()
    yt, st = npu.npu_dynamic_quant(x, dst_type=npu.hifloat8, quant_mode="pertoken", dst_type_max=15.0)
    yc, sc = npu.npu_dynamic_quant(x, dst_type=npu.hifloat8, quant_mode="perchannel", dst_type_max=15.0)
    assert st.shape == (2, 6) and sc.shape == (2, 40)
    r = torch.tensor(1.0) / torch.tensor(15.0)
    assert torch.equal(st, (x.float().abs() * r).amax(-1)) and torch.equal(sc, (x.float().abs() * r).amax(-2))
    assert torch.equal(yt, hif8_encode(x.float() / st.unsqueeze(-1)))


def test_fp8_dst_uses_the_format_max_and_ignores_dst_type_max(npu, gen):
    x = torch.randn(8, 32, generator=gen).bfloat16()
    y, scale = npu.npu_dynamic_quant(x, dst_type=torch.float8_e4m3fn, quant_mode="pertensor", dst_type_max=15.0)
    r = torch.tensor(1.0) / torch.tensor(448.0)
    assert y.dtype == torch.float8_e4m3fn and torch.equal(scale, (x.float().abs() * r).amax().reshape(1))


def test_smooth_scales_multiply_before_the_reduction(npu, gen):
    x = torch.randn(4, 16, generator=gen).bfloat16()
    smooth = torch.rand(16, generator=gen).bfloat16() + 0.5
    y, scale = npu.npu_dynamic_quant(x, smooth_scales=smooth, dst_type=npu.hifloat8, quant_mode="pertensor")
    xs = x.float() * smooth.float()
    r = torch.tensor(1.0) / torch.tensor(32768.0)
    assert torch.equal(scale, (xs.abs() * r).amax().reshape(1)) and torch.equal(y, hif8_encode(xs / scale))


@pytest.mark.parametrize("kwargs,match", [
    (dict(quant_mode="pergroup"), "quantMode only support"),
    (dict(dst_type_max=40000.0), r"\[0, 32768\]"),
    (dict(dst_type=23 + 1000), "y dtype"),
], ids=["mode", "max-range", "dst"])
def test_dynamic_quant_rejections(npu, kwargs, match):
    args = dict(dst_type=npu.hifloat8, quant_mode="pertensor")
    args.update(kwargs)
    with pytest.raises(RuntimeError, match=match):
        npu.npu_dynamic_quant(torch.randn(4, 8).bfloat16(), **args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dynamic_quant_rejects_non_half_input(npu, dtype):
    with pytest.raises(RuntimeError, match="FLOAT16, BFLOAT16"):
        npu.npu_dynamic_quant(torch.randn(4, 8, dtype=dtype), dst_type=npu.hifloat8, quant_mode="pertensor")


def test_dynamic_quant_needs_2d_and_no_group_index_outside_pertoken(npu):
    with pytest.raises(RuntimeError, match="greater than 1"):
        npu.npu_dynamic_quant(torch.randn(8).bfloat16(), dst_type=npu.hifloat8)
    with pytest.raises(RuntimeError, match="groupIndexOptional must be nullptr"):
        npu.npu_dynamic_quant(torch.randn(4, 8).bfloat16(), smooth_scales=torch.ones(2, 8).bfloat16(),
                              group_index=torch.tensor([2, 4], dtype=torch.int32), dst_type=npu.hifloat8,
                              quant_mode="pertensor")


def test_dynamic_quant_version_gates(monkeypatch):
    x = torch.randn(4, 8).bfloat16()
    old = install_fake_torch_npu(monkeypatch, cann_version="9.0.0")  # V3, no V4
    with pytest.raises(RuntimeError, match="Can't support attr dst_type_max"):
        old.npu_dynamic_quant(x, dst_type=old.hifloat8, quant_mode="pertensor", dst_type_max=15.0)
    y, s = old.npu_dynamic_quant(x, dst_type=old.hifloat8, quant_mode="pertensor")  # V3, max 32768
    assert s.shape == (1,)
    no_v3 = install_fake_torch_npu(monkeypatch, without_kernels=("aclnnDynamicQuantV3", "aclnnDynamicQuantV4"))
    with pytest.raises(RuntimeError, match="aclnnDynamicQuantV2 failed"):
        no_v3.npu_dynamic_quant(x, dst_type=no_v3.hifloat8, quant_mode="pertensor")
    b3 = install_fake_torch_npu(monkeypatch, chip="Ascend910B3")
    with pytest.raises(RuntimeError, match="only support socVersion Ascend950"):
        b3.npu_dynamic_quant(x, dst_type=b3.hifloat8, quant_mode="pertensor")


def test_integer_outputs_are_not_modelled(npu):
    with pytest.raises(NotImplementedError):
        npu.npu_dynamic_quant(torch.randn(4, 8).bfloat16())  # dst_type None -> int8


# --------------------------------------------------------------------------------- npu_quantize
def test_quantize_per_tensor_hif8_divides_in_fp32(npu, gen):
    x = torch.randn(5, 24, generator=gen)
    s = torch.tensor([0.037])
    y = npu.npu_quantize(x, s, None, npu.hifloat8)
    assert y.dtype == torch.uint8 and torch.equal(y, hif8_encode(x / s))


def test_quantize_per_channel_along_axis(npu, gen):
    x = torch.randn(3, 4, 6, generator=gen).bfloat16()
    s = (torch.rand(4, generator=gen) + 0.1).bfloat16()
    y = npu.npu_quantize(x, s, None, npu.hifloat8, axis=1)
    assert torch.equal(y, hif8_encode(x.float() / s.float().reshape(1, 4, 1)))
    y0 = npu.npu_quantize(x, torch.ones(6).bfloat16(), None, torch.float8_e4m3fn, axis=-1)
    assert y0.dtype == torch.float8_e4m3fn and torch.equal(y0.float(), x.float().to(torch.float8_e4m3fn).float())


def test_quantize_saturates_hif8_to_32768(npu):
    y = npu.npu_quantize(torch.tensor([1e9, -float("inf"), 40000.0]), torch.tensor([1.0]), None, npu.hifloat8)
    assert y.tolist() == [hif8_encode(torch.tensor(32768.0)).item(), hif8_encode(torch.tensor(-32768.0)).item(),
                          hif8_encode(torch.tensor(32768.0)).item()]


def test_quantize_scale_dtype_must_match_non_fp32_x(npu):
    # docs/aclnnQuantize.md: "如果x的dtype不是FLOAT32，scales的dtype需要和x的dtype一致"
    with pytest.raises(RuntimeError, match="must be the same"):
        npu.npu_quantize(torch.randn(4, 8).bfloat16(), torch.tensor([0.5]), None, npu.hifloat8)
    with pytest.raises(RuntimeError, match="scales BF16 requires x BF16"):
        npu.npu_quantize(torch.randn(4, 8), torch.tensor([0.5]).bfloat16(), None, npu.hifloat8)
    npu.npu_quantize(torch.randn(4, 8), torch.tensor([0.5]), None, npu.hifloat8)  # FP32 x takes FP32 scales


def test_quantize_dtype_codes(npu):
    x, s = torch.randn(4, 8), torch.tensor([0.5])
    with pytest.raises(RuntimeError, match="Param \\(dtype\\) must be"):
        npu.npu_quantize(x, s, None, npu.float8_e4m3fn)  # 292 is not in QUANTIZE_SUPPORT_MAP
    assert npu.npu_quantize(x, s, None, torch.float8_e4m3fn).dtype == torch.float8_e4m3fn  # 24 is


def test_quantize_shape_rules(npu):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="only support 1 dimension"):
        npu.npu_quantize(x, torch.ones(1, 8), None, npu.hifloat8)
    with pytest.raises(RuntimeError, match="equal to 1 or the specified dimension"):
        npu.npu_quantize(x, torch.ones(3), None, npu.hifloat8, axis=1)
    with pytest.raises(RuntimeError, match="Axis out of range"):
        npu.npu_quantize(x, torch.ones(8), None, npu.hifloat8, axis=2)
    with pytest.raises(NotImplementedError):
        npu.npu_quantize(x, torch.ones(1), None, npu.hifloat8, div_mode=False)


# -------------------------------------------------------------------------------- npu_quant_max
def test_grouped_quant_max_multiplies_per_group_scale_and_returns_group_amax(npu, gen):
    x = torch.randn(10, 6, generator=gen)  # FLOAT input is accepted here
    scale = torch.tensor([4.0, 0.5, 30.0])
    y, amax = npu.npu_quant_max(x, scale, round_mode="round", dst_dtype=npu.hifloat8,
                                group_list=torch.tensor([3, 3, 10]))
    factor = torch.tensor([4.0] * 3 + [30.0] * 7).reshape(-1, 1)
    assert torch.equal(y, hif8_encode(x * factor))
    assert amax.dtype == x.dtype and torch.equal(amax, torch.stack([x[:3].abs().amax(), torch.tensor(0.0), x[3:].abs().amax()]))


def test_quant_max_without_groups_and_its_round_mode_rule(npu, gen):
    x = torch.randn(4, 8, generator=gen).bfloat16()
    y, amax = npu.npu_quant_max(x, torch.tensor([2.0]), dst_dtype=torch.float8_e4m3fn)
    assert amax.shape == (1,) and amax.dtype == torch.bfloat16 and torch.equal(y.float(), (x.float() * 2).to(torch.float8_e4m3fn).float())
    with pytest.raises(RuntimeError, match="'round' or 'hybrid'"):
        npu.npu_quant_max(x, torch.tensor([2.0]), dst_dtype=npu.hifloat8)  # the default round_mode "rint"


def test_quant_max_versions(monkeypatch):
    x = torch.randn(4, 8)
    old = install_fake_torch_npu(monkeypatch, cann_version="9.1.0")  # QuantMax, no GroupedQuantMax
    old.npu_quant_max(x, torch.tensor([1.0]), round_mode="round", dst_dtype=290)
    with pytest.raises(RuntimeError, match="npu_grouped_quant_max"):
        old.npu_quant_max(x, torch.ones(2), round_mode="round", dst_dtype=290, group_list=torch.tensor([2, 4]))
    with pytest.raises(RuntimeError, match="INT64"):
        install_fake_torch_npu(monkeypatch).npu_quant_max(x, torch.ones(2), round_mode="round", dst_dtype=290,
                                                          group_list=torch.tensor([2, 4], dtype=torch.int32))
