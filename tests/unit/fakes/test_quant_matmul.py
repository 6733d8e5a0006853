"""The fake's npu_quant_matmul: MX and HiFloat8 modes against float64 references built from the
aclnnQuantMatmulV5 formulas, and the op-plugin / aclnn rejections."""
import math

import pytest
import torch

from tests.fakes import install_fake_torch_npu
from tests.fakes.dtypes import hif8_decode, hif8_encode

E4M3 = torch.float8_e4m3fn


def _random_e4m3(shape, gen):
    """E4M3 values with small exponents so every product and partial sum is exact in float32."""
    mant = torch.randint(0, 8, shape, generator=gen).float() / 8 + 1
    exp = torch.randint(-3, 3, shape, generator=gen).float()
    sign = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
    return (sign * mant * 2**exp).to(E4M3)


def _random_codes(shape, gen):
    return torch.randint(120, 135, shape, generator=gen, dtype=torch.uint8)


def mx_reference(x1, s1, x2, s2):
    """aclnnQuantMatmulV5.md: out[m,n] = sum_j (x1Slice_j . x2Slice_j) * x1Scale[m, j] * x2Scale[j, n],
    32-wide K blocks j; scale j lives in pair j // 2, slot j % 2 (float64)."""
    m, k = x1.shape
    n = x2.shape[1]
    out = torch.zeros(m, n, dtype=torch.float64)
    for j in range(math.ceil(k / 32)):
        a = x1[:, 32 * j:32 * j + 32].double()
        b = x2[32 * j:32 * j + 32].double()
        sa = torch.exp2(s1[:, j // 2, j % 2].double() - 127)
        sb = torch.exp2(s2[j // 2, :, j % 2].double() - 127)
        out += (a @ b) * sa[:, None] * sb[None, :]
    return out


@pytest.mark.parametrize("k", [64, 96, 160])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_mx_matches_block_formula(npu, gen, k, out_dtype):
    m, n, p = 6, 10, math.ceil(k / 64)
    x1, x2t = _random_e4m3((m, k), gen), _random_e4m3((n, k), gen)
    s1, s2t = _random_codes((m, p, 2), gen), _random_codes((n, p, 2), gen)
    # weight passed as the transposed view of [n, k], its scale as the transposed view of [n, p, 2]
    out = npu.npu_quant_matmul(x1, x2t.t(), s2t.transpose(0, 1), pertoken_scale=s1, output_dtype=out_dtype,
                               scale_dtype=npu.float8_e8m0fnu, pertoken_scale_dtype=npu.float8_e8m0fnu,
                               group_sizes=[1, 1, 32])
    ref = mx_reference(x1, s1, x2t.t(), s2t.transpose(0, 1))
    assert out.dtype == out_dtype and out.shape == (m, n)
    # equal up to float32 accumulation order: within a few float32 ulps of sum |terms|
    magnitude = mx_reference(x1.float().abs().to(E4M3), s1, x2t.t().float().abs().to(E4M3), s2t.transpose(0, 1))
    if out_dtype == torch.float32:
        assert ((out.double() - ref).abs() <= 2**-21 * magnitude).all()
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-21 * magnitude.max().item())


def test_mx_reads_both_slots_of_each_pair(npu, gen):
    x1, x2 = _random_e4m3((2, 64), gen), _random_e4m3((64, 3), gen)
    s1 = torch.tensor([[[127, 127]], [[127, 127]]], dtype=torch.uint8)
    s2 = torch.full((1, 3, 2), 127, dtype=torch.uint8)
    s2_hi = s2.clone()
    s2_hi[..., 1] = 128  # the second K block only
    base = npu.npu_quant_matmul(x1, x2, s2, pertoken_scale=s1, output_dtype=torch.float32, scale_dtype=293,
                                pertoken_scale_dtype=293)
    hi = npu.npu_quant_matmul(x1, x2, s2_hi, pertoken_scale=s1, output_dtype=torch.float32, scale_dtype=293,
                              pertoken_scale_dtype=293)
    second = (x1[:, 32:].float() @ x2[32:].float())
    assert torch.equal(hi - base, second)


def test_mx_scale_transposition_must_follow_its_operand(npu, gen):
    x1, x2t = _random_e4m3((4, 128), gen), _random_e4m3((8, 128), gen)
    s1, s2t = _random_codes((4, 2, 2), gen), _random_codes((8, 2, 2), gen)
    kw = dict(output_dtype=torch.float32, scale_dtype=293, pertoken_scale_dtype=293)
    with pytest.raises(RuntimeError, match="Input x2 tensor and scale tensor's transpose are not same"):
        npu.npu_quant_matmul(x1, x2t.t(), s2t.transpose(0, 1).contiguous(), pertoken_scale=s1, **kw)
    x1t = x1.t().contiguous().t()  # x1 as a transposed view
    with pytest.raises(RuntimeError, match="Input x1 tensor and pertoken_scale tensor's transpose are not same"):
        npu.npu_quant_matmul(x1t, x2t.t(), s2t.transpose(0, 1), pertoken_scale=s1, **kw)
    # with one pair along K ([.., 1, N, 2]) the strides cannot tell: accepted, as by op-plugin
    npu.npu_quant_matmul(x1[:, :64], x2t[:, :64].t(), s2t[:, :1].transpose(0, 1).contiguous(),
                         pertoken_scale=s1[:, :1].contiguous(), **kw)


@pytest.mark.parametrize("kwargs,match", [
    (dict(group_sizes=[1, 1, 64]), "group_sizes must be \\[1, 1, 32\\]"),
    (dict(group_sizes=[1, 32]), "three elements"),
    (dict(group_sizes=[1, 1, 70000]), "range \\[0, 65535\\]"),
    (dict(output_dtype=None), "output dtype must be FLOAT16, BFLOAT16 or FLOAT32"),
    (dict(output_dtype=torch.int8), "output dtype must be"),
    (dict(bias=torch.zeros(8, dtype=torch.bfloat16)), "bias must be FLOAT32"),
], ids=["gs-k64", "gs-len", "gs-range", "out-none", "out-int8", "bias"])
def test_mx_rejections(npu, gen, kwargs, match):
    x1, x2 = _random_e4m3((4, 64), gen), _random_e4m3((64, 8), gen)
    args = dict(pertoken_scale=_random_codes((4, 1, 2), gen), output_dtype=torch.float32, scale_dtype=293,
                pertoken_scale_dtype=293)
    args.update(kwargs)
    with pytest.raises(RuntimeError, match=match):
        npu.npu_quant_matmul(x1, x2, _random_codes((1, 8, 2), gen), **args)


def test_mx_scale_shape_checks(npu, gen):
    x1, x2 = _random_e4m3((4, 96), gen), _random_e4m3((96, 8), gen)
    kw = dict(output_dtype=torch.float32, scale_dtype=293, pertoken_scale_dtype=293)
    with pytest.raises(RuntimeError, match="ceildivided by 64"):
        npu.npu_quant_matmul(x1, x2, _random_codes((3, 8, 2), gen), pertoken_scale=_random_codes((4, 3, 2), gen), **kw)
    with pytest.raises(RuntimeError, match="itemsize"):
        npu.npu_quant_matmul(x1, x2, torch.ones(2, 8, 2), pertoken_scale=_random_codes((4, 2, 2), gen), **kw)
    with pytest.raises(RuntimeError, match="k dim of x1 and x2 need be same"):
        npu.npu_quant_matmul(x1, x2[:64], _random_codes((2, 8, 2), gen), pertoken_scale=_random_codes((4, 2, 2), gen), **kw)


def test_uint8_scales_without_e8m0_dtype_are_not_mx(npu, gen):
    x1, x2 = _random_e4m3((4, 64), gen), _random_e4m3((64, 8), gen)
    with pytest.raises(NotImplementedError):
        npu.npu_quant_matmul(x1, x2, _random_codes((1, 8, 2), gen), pertoken_scale=_random_codes((4, 1, 2), gen),
                             output_dtype=torch.float32)


def test_quant_matmul_kernel_and_chip_gates(monkeypatch, gen):
    x1, x2 = _random_e4m3((4, 64), gen), _random_e4m3((64, 8), gen)
    args = (x1, x2, _random_codes((1, 8, 2), gen))
    kw = dict(pertoken_scale=_random_codes((4, 1, 2), gen), output_dtype=torch.float32, scale_dtype=293,
              pertoken_scale_dtype=293)
    no_v5 = install_fake_torch_npu(monkeypatch, without_kernels=("aclnnQuantMatmulV5",))
    with pytest.raises(RuntimeError, match="aclnnQuantMatmulV5"):
        no_v5.npu_quant_matmul(*args, **kw)
    b3 = install_fake_torch_npu(monkeypatch, chip="Ascend910B3")
    with pytest.raises(RuntimeError, match="only supported on Ascend 950"):
        b3.npu_quant_matmul(*args, **kw)


# ------------------------------------------------------------------------------------------ HiF8
def _hif8_operands(gen, m=5, k=40, n=7):
    return hif8_encode(torch.randn(m, k, generator=gen)), hif8_encode(torch.randn(k, n, generator=gen))


def test_hif8_dynamic_pertensor_is_acc_times_x2scale_times_x1scale(npu, gen):
    a, b = _hif8_operands(gen)
    s2, s1 = torch.tensor([0.0371]), torch.tensor([1.7e-3])
    out = npu.npu_quant_matmul(a, b, s2, pertoken_scale=s1, output_dtype=torch.float32, x1_dtype=npu.hifloat8,
                               x2_dtype=npu.hifloat8)
    acc = hif8_decode(a) @ hif8_decode(b)
    assert torch.equal(out, acc * s2 * s1)


def test_hif8_pertoken_and_perchannel_scales(npu, gen):
    a, b = _hif8_operands(gen)
    s2, s1 = torch.rand(7, generator=gen), torch.rand(5, generator=gen)
    out = npu.npu_quant_matmul(a, b, s2, pertoken_scale=s1, output_dtype=torch.bfloat16, x1_dtype=290, x2_dtype=290)
    acc = hif8_decode(a) @ hif8_decode(b)
    assert torch.equal(out, (acc * s2[None, :] * s1[:, None]).bfloat16())


def test_hif8_static_fp32_scale_is_truncated_to_fp19(npu, gen):
    # op-plugin: float32 scale and no pertoken_scale -> npu_trans_quant_param (round_mode 0):
    # scale & 0xFFFFE000, i.e. 1 + 2**-20 acts as 1.0; (acc + bias) * scale.
    a, b = _hif8_operands(gen)
    scale = torch.tensor([1.0 + 2.0**-20])
    bias = torch.randn(7, generator=gen)
    out = npu.npu_quant_matmul(a, b, scale, bias=bias, output_dtype=torch.float32, x1_dtype=290, x2_dtype=290)
    acc = hif8_decode(a) @ hif8_decode(b)
    assert torch.equal(out, (acc + bias) * 1.0)


def test_hif8_rejections(npu, gen):
    a, b = _hif8_operands(gen)
    kw = dict(x1_dtype=290, x2_dtype=290)
    with pytest.raises(RuntimeError, match="output dtype must be"):
        npu.npu_quant_matmul(a, b, torch.tensor([1.0]), pertoken_scale=torch.tensor([1.0]), **kw)
    with pytest.raises(RuntimeError, match="x2Scale must be \\[1\\] or \\[7\\]"):
        npu.npu_quant_matmul(a, b, torch.ones(3), pertoken_scale=torch.tensor([1.0]), output_dtype=6, **kw)
    with pytest.raises(RuntimeError, match="x1Scale must be null or FLOAT32"):
        npu.npu_quant_matmul(a, b, torch.ones(1), pertoken_scale=torch.ones(1).half(), output_dtype=6, **kw)
    with pytest.raises(RuntimeError, match="itemsize"):
        npu.npu_quant_matmul(a.float(), b, torch.ones(1), pertoken_scale=torch.ones(1), output_dtype=6, **kw)
