"""The fake's npu_grouped_matmul (MX and HiFloat8, group_type 0 and 2): per-group scale offsets,
unwritten rows, empty groups, and the op-plugin / aclnn rejections."""
import math

import pytest
import torch

from tests.fakes import install_fake_torch_npu
from tests.fakes.dtypes import hif8_decode, hif8_encode
from tests.fakes.grouped_matmul import POISON_OUT
from tests.unit.fakes.test_quant_matmul import _random_codes, _random_e4m3, mx_reference

E8M0 = 293
MX = dict(scale_dtype=E8M0, per_token_scale_dtype=E8M0)


def _within_fp32_order(out, ref, magnitude):
    assert ((out.double() - ref).abs() <= 2**-21 * magnitude).all()


# ------------------------------------------------------------------------------- split M (fwd)
@pytest.mark.parametrize("sizes", [[3, 0, 5], [0, 0, 8], [4, 4, 0]], ids=["middle-empty", "leading-empty", "tail-empty"])
def test_mx_split_m_matches_per_group_block_formula(npu, gen, sizes):
    m, k, n, g = 10, 96, 12, len(sizes)
    p = math.ceil(k / 64)
    x, s_x = _random_e4m3((m, k), gen), _random_codes((m, p, 2), gen)
    w_nk, s_w = _random_e4m3((g, n, k), gen), _random_codes((g, n, p, 2), gen)
    group_list = torch.tensor(sizes).cumsum(0)
    (out,) = npu.npu_grouped_matmul([x], [w_nk.transpose(1, 2)], scale=[s_w.transpose(1, 2)], per_token_scale=[s_x],
                                    group_list=group_list, split_item=3, group_type=0, output_dtype=6, **MX)
    assert out.shape == (m, n) and out.dtype == torch.float32
    start = 0
    for gi, size in enumerate(sizes):
        rows = slice(start, start + size)
        ref = mx_reference(x[rows], s_x[rows], w_nk[gi].t(), s_w[gi].transpose(0, 1))
        mag = mx_reference(x[rows].float().abs().to(x.dtype), s_x[rows], w_nk[gi].t().float().abs().to(x.dtype),
                           s_w[gi].transpose(0, 1))
        _within_fp32_order(out[rows], ref, mag)
        start += size
    # rows after the last group are never written (op-plugin allocates y uninitialised) -> poison
    assert torch.isnan(out[sum(sizes):]).all() and math.isnan(POISON_OUT)


def test_group_list_type_1_counts_equal_type_0_cumsum(npu, gen):
    m, k, n, sizes = 8, 64, 4, [2, 0, 6]
    x, s_x = _random_e4m3((m, k), gen), _random_codes((m, 1, 2), gen)
    w, s_w = _random_e4m3((3, k, n), gen), _random_codes((3, 1, n, 2), gen)
    common = dict(scale=[s_w], per_token_scale=[s_x], split_item=3, group_type=0, output_dtype=15, **MX)
    a = npu.npu_grouped_matmul([x], [w], group_list=torch.tensor(sizes).cumsum(0), group_list_type=0, **common)[0]
    b = npu.npu_grouped_matmul([x], [w], group_list=torch.tensor(sizes), group_list_type=1, **common)[0]
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------ split K (wgrad)
def _split_k_operands(gen, sizes, m=6, n=5):
    k, g = sum(sizes), len(sizes)
    rows = k // 64 + g
    x_km, w_kn = _random_e4m3((k, m), gen), _random_e4m3((k, n), gen)
    s_x = torch.randint(118, 137, (rows, m, 2), generator=gen, dtype=torch.uint8)
    s_w = torch.randint(118, 137, (rows, n, 2), generator=gen, dtype=torch.uint8)
    return x_km, w_kn, s_x, s_w


def _split_k_reference(x_km, w_kn, s_x, s_w, sizes, first_row):
    outs, start = [], 0
    for gi, size in enumerate(sizes):
        r = first_row(start, gi)
        pairs = math.ceil(size / 64)
        if size == 0:
            outs.append(torch.zeros(x_km.shape[1], w_kn.shape[1], dtype=torch.float64))
        else:
            outs.append(mx_reference(x_km[start:start + size].t(), s_x[r:r + pairs].transpose(0, 1),
                                     w_kn[start:start + size], s_w[r:r + pairs]))
        start += size
    return torch.stack(outs)


@pytest.mark.parametrize("sizes", [[64, 64], [64, 0, 40, 24, 100], [1, 127, 0, 32], [0, 0, 64]],
                         ids=["64-64", "ragged-empty", "unaligned", "leading-empty"])
def test_mx_split_k_reads_group_scales_at_cumk_over_64_plus_g(npu, gen, sizes):
    x_km, w_kn, s_x, s_w = _split_k_operands(gen, sizes)
    (out,) = npu.npu_grouped_matmul([x_km.t()], [w_kn], scale=[s_w], per_token_scale=[s_x.transpose(0, 1)],
                                    group_list=torch.tensor(sizes).cumsum(0), split_item=3, group_type=2,
                                    output_dtype=6, **MX)
    assert out.shape == (len(sizes), 6, 5)
    ref = _split_k_reference(x_km, w_kn, s_x, s_w, sizes, lambda start, g: start // 64 + g)
    mag = _split_k_reference(x_km.float().abs().to(x_km.dtype), w_kn.float().abs().to(w_kn.dtype), s_x, s_w, sizes,
                             lambda start, g: start // 64 + g)
    _within_fp32_order(out, ref, mag)
    for gi, size in enumerate(sizes):
        if size == 0:
            assert (out[gi] == 0).all()  # gqmm_init_output.h: split-K group with k = 0 -> zeros


def test_mx_split_k_back_to_back_rows_would_read_other_scales(npu, gen):
    # [64, 64]: the kernel reads group 1 from pair-row 2; rows packed back to back would start it at 1.
    sizes = [64, 64]
    x_km, w_kn, s_x, s_w = _split_k_operands(gen, sizes)
    (out,) = npu.npu_grouped_matmul([x_km.t()], [w_kn], scale=[s_w], per_token_scale=[s_x.transpose(0, 1)],
                                    group_list=torch.tensor([64, 128]), split_item=3, group_type=2, output_dtype=6, **MX)
    packed = _split_k_reference(x_km, w_kn, s_x, s_w, sizes, lambda start, g: start // 64)
    kernel = _split_k_reference(x_km, w_kn, s_x, s_w, sizes, lambda start, g: start // 64 + g)
    assert not torch.allclose(packed[1], kernel[1]) and torch.allclose(out[1].double(), kernel[1], rtol=1e-5)


def test_mx_split_k_wgrad_from_grouped_quant_outputs(npu, gen):
    # dW_g = dy_g^T x_g from npu_grouped_dynamic_mx_quant outputs fed as they come out of the op
    sizes = [40, 0, 90, 64]
    t = sum(sizes)
    dy, x = torch.randn(t, 16, generator=gen).bfloat16(), torch.randn(t, 32, generator=gen).bfloat16()
    ends = torch.tensor(sizes).cumsum(0)
    q_dy, s_dy = npu.npu_grouped_dynamic_mx_quant(dy, ends.int(), dst_type=torch.float8_e4m3fn)
    q_x, s_x = npu.npu_grouped_dynamic_mx_quant(x, ends.int(), dst_type=torch.float8_e4m3fn)
    (dw,) = npu.npu_grouped_matmul([q_dy.t()], [q_x], scale=[s_x], per_token_scale=[s_dy.transpose(0, 1)],
                                   group_list=ends, split_item=3, group_type=2, output_dtype=15, **MX)
    start = 0
    for gi, size in enumerate(sizes):
        ref = dy[start:start + size].float().t() @ x[start:start + size].float()
        err = (dw[gi].float() - ref).norm() / max(ref.norm(), 1e-9)
        assert err < 0.1 if size else (dw[gi] == 0).all()
        start += size


# ------------------------------------------------------------------------------------------ HiF8
def test_hif8_split_m_pertensor(npu, gen):
    m, k, n, sizes = 7, 24, 5, [2, 0, 5]
    x = hif8_encode(torch.randn(m, k, generator=gen))
    w = hif8_encode(torch.randn(3, k, n, generator=gen))
    s_w, s_x = torch.rand(3, generator=gen), torch.rand(3, generator=gen)
    (out,) = npu.npu_grouped_matmul([x], [w], scale=[s_w], per_token_scale=[s_x], group_list=torch.tensor(sizes).cumsum(0),
                                    split_item=3, group_type=0, output_dtype=6, x_dtype=290, weight_dtype=290)
    start = 0
    for gi, size in enumerate(sizes):
        acc = hif8_decode(x[start:start + size]) @ hif8_decode(w[gi])
        assert torch.equal(out[start:start + size], acc * s_w[gi] * s_x[gi])
        start += size


def test_hif8_split_k_pertensor_and_empty_group(npu, gen):
    m, n, sizes = 4, 3, [10, 0, 6]
    k = sum(sizes)
    x_km, w = hif8_encode(torch.randn(k, m, generator=gen)), hif8_encode(torch.randn(k, n, generator=gen))
    s_w, s_x = torch.rand(3, generator=gen), torch.rand(3, generator=gen)
    (out,) = npu.npu_grouped_matmul([x_km.t()], [w], scale=[s_w], per_token_scale=[s_x], group_list=torch.tensor(sizes).cumsum(0),
                                    split_item=3, group_type=2, output_dtype=6, x_dtype=290, weight_dtype=290)
    assert torch.equal(out[0], (hif8_decode(x_km[:10].t()) @ hif8_decode(w[:10])) * s_w[0] * s_x[0])
    assert (out[1] == 0).all()


# ------------------------------------------------------------------------------------ rejections
def _mx_split_m_args(gen):
    x, s_x = _random_e4m3((8, 64), gen), _random_codes((8, 1, 2), gen)
    w, s_w = _random_e4m3((2, 64, 4), gen), _random_codes((2, 1, 4, 2), gen)
    return [x], [w], dict(scale=[s_w], per_token_scale=[s_x], group_list=torch.tensor([4, 8]), split_item=3,
                          group_type=0, output_dtype=6, **MX)


@pytest.mark.parametrize("change,match", [
    (dict(group_type=None), "Requires manual passing group_type"),
    (dict(group_type=1), "must be -1, 0 or 2"),
    (dict(group_list=torch.tensor([4, 8], dtype=torch.int32)), "Only int64 is supported for groupList"),
    (dict(group_list=torch.tensor([4, 8, 8])), "length of weight equals|should be equal to weight dim 0"),
    (dict(split_item=0), "single-single-single"),
    (dict(split_item=5), "split_item"),
    (dict(output_dtype=None), "y dtype"),
    (dict(per_token_scale=None), "perTokenScale cannot be nullptr"),
    (dict(per_token_scale_dtype=None), "perTokenScale dtype"),
    (dict(act_type=1), "actType"),
    (dict(group_list=torch.tensor([4, 9])), "undefined"),
], ids=lambda v: str(v)[:40])
def test_split_m_rejections(npu, gen, change, match):
    x, w, kw = _mx_split_m_args(gen)
    kw.update(change)
    with pytest.raises(RuntimeError, match=match):
        npu.npu_grouped_matmul(x, w, **kw)


def test_mx_scale_shape_and_transposition_rejections(npu, gen):
    x, w, kw = _mx_split_m_args(gen)
    wt = w[0].transpose(1, 2).contiguous().transpose(1, 2)  # weight as a transposed view
    with pytest.raises(RuntimeError, match="scale and weight transposition must be the same"):
        npu.npu_grouped_matmul(x, [wt], **kw)
    bad = dict(kw, scale=[_random_codes((2, 2, 4, 2), gen)])
    with pytest.raises(RuntimeError, match="axis K of scale must be equal to ceil"):
        npu.npu_grouped_matmul(x, w, **bad)
    with pytest.raises(RuntimeError, match="x transposition must be false"):
        npu.npu_grouped_matmul([x[0].t().contiguous().t()], w, **kw)


def test_split_k_requires_transposed_x_and_row_major_weight(npu, gen):
    sizes = [64, 64]
    x_km, w_kn, s_x, s_w = _split_k_operands(gen, sizes)
    kw = dict(scale=[s_w], per_token_scale=[s_x.transpose(0, 1)], group_list=torch.tensor([64, 128]), split_item=3,
              group_type=2, output_dtype=6, **MX)
    with pytest.raises(RuntimeError, match="x and weight transposition must be true/false"):
        npu.npu_grouped_matmul([x_km.t().contiguous()], [w_kn], **kw)
    with pytest.raises(RuntimeError, match="perTokenScale and x transposition must be the same"):
        npu.npu_grouped_matmul([x_km.t()], [w_kn], **dict(kw, per_token_scale=[s_x.transpose(0, 1).contiguous()]))
    with pytest.raises(RuntimeError, match="divided by 64, plus groupSize"):
        npu.npu_grouped_matmul([x_km.t()], [w_kn], **dict(kw, scale=[s_w[:-1]]))


def test_list_overload_and_old_cann_paths_are_not_modelled(monkeypatch, npu, gen):
    x, w, kw = _mx_split_m_args(gen)
    with pytest.raises(NotImplementedError):
        npu.npu_grouped_matmul(x, w, group_list=[4, 8], group_type=0, split_item=3)
    no_v4 = install_fake_torch_npu(monkeypatch, without_kernels=("aclnnGroupedMatmulV4",))
    with pytest.raises(RuntimeError, match="group_list don't support Tensor input"):
        no_v4.npu_grouped_matmul(x, w, **kw)


def test_910b_has_no_quantized_grouped_matmul(monkeypatch, gen):
    b3 = install_fake_torch_npu(monkeypatch, chip="Ascend910B3")
    x, w, kw = _mx_split_m_args(gen)
    with pytest.raises(RuntimeError, match="not supported on SoC Ascend910B3"):
        b3.npu_grouped_matmul(x, w, **kw)
