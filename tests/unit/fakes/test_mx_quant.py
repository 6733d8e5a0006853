"""The fake's MX quant ops against the vendor goldens, hand-computed vectors and kernel rules."""
import math

import pytest
import torch

from tests.fakes import install_fake_torch_npu
from tests.fakes.mx_quant import POISON_SCALE, grouped_scale_rows
from tests.unit.fakes import vendor_goldens

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMT_NAME = {E4M3: "float8_e4m3fn", E5M2: "float8_e5m2"}


def _bytes(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _golden(x, fmt, axis=-1, block_size=32, scale_alg=0):
    y, s = vendor_goldens.mx_quantize(x.float().numpy(), FMT_NAME[fmt], axis=axis, block_size=block_size,
                                      scale_alg=scale_alg)
    return torch.from_numpy(y.copy()), torch.from_numpy(s.copy())


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_alg", [0, 1], ids=["ocp", "cublas"])
@pytest.mark.parametrize("shape,axis", [((5, 96), -1), ((70, 3), -2), ((2, 33, 40), 1), ((3, 4, 65), 2)],
                         ids=["tail", "axis0", "middle-odd", "3d-tail"])
def test_dynamic_mx_quant_matches_golden(npu, gen, fmt, scale_alg, shape, axis):
    x = (torch.randn(shape, generator=gen) * 4).bfloat16()
    y, scale = npu.npu_dynamic_mx_quant(x, axis=axis, dst_type=fmt, scale_alg=scale_alg)
    gy, gs = _golden(x, fmt, axis, scale_alg=scale_alg)
    assert y.dtype == fmt and scale.dtype == torch.uint8
    assert torch.equal(scale, gs) and torch.equal(_bytes(y), gy)


def test_dynamic_mx_quant_block_size_64_matches_golden(npu, gen):
    x = torch.randn(4, 200, generator=gen).half()
    y, scale = npu.npu_dynamic_mx_quant(x, dst_type=E4M3, block_size=64)
    gy, gs = _golden(x, E4M3, block_size=64)
    assert scale.shape == (4, 2, 2) and torch.equal(scale, gs) and torch.equal(_bytes(y), gy)


def test_dual_axis_doc_example_hand_computed(npu):
    # torch_npu docs example: input (0, 8, 64, 512) bf16, dst_type=torch.float8_e4m3fn.
    # amax 512 = 2**9 -> biased exponent 136, code 136 - 8 = 128 (scale 2); y = (0, 4, 32, 256).
    x = torch.tensor([[0, 8, 64, 512]], dtype=torch.bfloat16)
    y1, s1, y2, s2 = npu.npu_dynamic_mx_quant_with_dual_axis(x, dst_type=torch.float8_e4m3fn)
    assert y1.float().tolist() == [[0.0, 4.0, 32.0, 256.0]]
    assert s1.tolist() == [[[128, 0]]]  # one block, odd count padded with code 0
    # along -2 each column is its own block: 8 -> code 3+127-8 = 122 (scale 2**-5) -> 256
    assert s2.shape == (1, 4, 2) and s2[0, :, 0].tolist() == [0, 122, 125, 128]
    assert y2.float().tolist() == [[0.0, 256.0, 256.0, 256.0]]


def test_dual_axis_equals_two_single_axis_golden_quantizations(npu, gen):
    x = (torch.randn(2, 96, 80, generator=gen) * 3).bfloat16()
    y1, s1, y2, s2 = npu.npu_dynamic_mx_quant_with_dual_axis(x, dst_type=E4M3, scale_alg=1)
    gy1, gs1 = _golden(x, E4M3, -1, scale_alg=1)
    gy2, gs2 = _golden(x, E4M3, -2, scale_alg=1)
    assert s1.shape == (2, 96, 2, 2) and s2.shape == (2, 2, 80, 2)
    assert torch.equal(s1, gs1) and torch.equal(s2, gs2)
    assert torch.equal(_bytes(y1), gy1) and torch.equal(_bytes(y2), gy2)


def test_mx_special_blocks_nan_inf_zero_and_saturation(npu):
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    x[0, 3] = float("nan")
    x[1, 0] = float("-inf")
    x[1, 1] = 1.0
    x[3, :] = 1.9375  # amax mantissa high: 1.9375 / 2**-8 = 496 > 448 -> saturates to 448
    y, scale = npu.npu_dynamic_mx_quant(x, dst_type=E4M3)
    codes = scale.flatten(1)[:, 0].tolist()
    assert codes == [255, 255, 0, 127 - 8]  # NaN, Inf -> E8M0 NaN; zero block -> 0; 2**0 / 2**8
    # NaN scale blocks: x * NaN then the SAT cast -> +0 (golden: "NPU will cast NaN ... to positive ZERO")
    assert _bytes(y)[0].tolist() == [0] * 32 and _bytes(y)[1].tolist() == [0] * 32
    assert _bytes(y)[2].tolist() == [0] * 32
    assert set(y[3].float().tolist()) == {448.0}


def test_tiny_blocks_zeroed_by_single_axis_kept_by_dual_axis_unlike_golden(npu):
    # |amax| = 2**-120: biased exponent 7 <= emax 8 -> shared exponent clamps to 0 (code 0).
    # dynamic_mx_quant / grouped zero the elements (zero mask on the shared exponent); the dual-axis
    # kernel masks on the raw exponent and keeps x * 2**127 = 2**7; the golden keeps 2**7 too.
    x = torch.full((32, 32), 2.0**-120, dtype=torch.bfloat16)
    y, scale = npu.npu_dynamic_mx_quant(x, dst_type=E4M3)
    assert scale[:, 0, 0].tolist() == [0] * 32 and y.float().abs().max().item() == 0.0
    gy, _ = _golden(x, E4M3)
    assert set(gy.view(E4M3).float().flatten().tolist()) == {128.0}
    y1, s1, y2, s2 = npu.npu_dynamic_mx_quant_with_dual_axis(x, dst_type=E4M3)
    assert s1[:, 0, 0].tolist() == [0] * 32 and set(y1.float().flatten().tolist()) == {128.0}
    yg, _ = npu.npu_grouped_dynamic_mx_quant(x, torch.tensor([32], dtype=torch.int32), dst_type=E4M3)
    assert yg.float().abs().max().item() == 0.0


def test_cublas_scale_hand_vector(npu):
    # scale_alg 1: S = fp32(amax) * fp32(1/448); amax 500 -> S = 1.116.. -> exponent rounded up to 2**1,
    # code 128; 500 / 2 = 250 -> E4M3 256 (step 16 in [128, 256)); OCP: floor(log2 500) - 8 = 0 -> code 127,
    # 500 saturates to 448
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0] = 500
    y1, s1 = npu.npu_dynamic_mx_quant(x, dst_type=E4M3, scale_alg=1)
    y0, s0 = npu.npu_dynamic_mx_quant(x, dst_type=E4M3, scale_alg=0)
    assert s1[0, 0, 0].item() == 128 and y1[0, 0].float().item() == 256.0
    assert s0[0, 0, 0].item() == 127 and y0[0, 0].float().item() == 448.0


def test_max_low_bound_raises_the_block_amax_on_v3(npu):
    x = torch.full((1, 32), 1.0, dtype=torch.bfloat16)
    _, plain = npu.npu_dynamic_mx_quant(x, dst_type=E4M3, scale_alg=1)
    _, bounded = npu.npu_dynamic_mx_quant(x, dst_type=E4M3, scale_alg=1, max_low_bound=448.0)
    assert plain[0, 0, 0].item() == 127 - 8 and bounded[0, 0, 0].item() == 127


@pytest.mark.parametrize("sizes", [[64, 64], [0, 33, 0, 31, 100], [1, 127, 64, 0], [200]],
                         ids=["64-64", "empty-and-ragged", "unaligned", "one"])
def test_grouped_mx_quant_layout_and_gaps(npu, gen, sizes):
    m, n = sum(sizes), 24
    x = (torch.randn(m, n, generator=gen) * 2).bfloat16()
    ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    y, scale = npu.npu_grouped_dynamic_mx_quant(x, ends, dst_type=E4M3)
    assert scale.shape == (m // 64 + len(sizes), n, 2)
    written = torch.zeros(scale.shape[0], dtype=torch.bool)
    start = 0
    for g, (first, count) in enumerate(grouped_scale_rows(sizes)):
        ref_y, ref_s = npu.npu_dynamic_mx_quant(x[start:start + sizes[g]], axis=0, dst_type=E4M3) if sizes[g] else (None, None)
        if sizes[g]:
            assert first == start // 64 + g
            assert torch.equal(scale[first:first + count], ref_s)
            assert torch.equal(_bytes(y[start:start + sizes[g]]), _bytes(ref_y))
        written[first:first + count] = True
        start += sizes[g]
    assert (scale[~written] == POISON_SCALE).all()  # never written by the kernel -> poison


def test_grouped_64_64_starts_group_one_at_pair_row_two(npu):
    x = torch.ones(128, 2, dtype=torch.bfloat16)
    x[64:] = 4.0
    _, scale = npu.npu_grouped_dynamic_mx_quant(x, torch.tensor([64, 128], dtype=torch.int32), dst_type=E4M3)
    assert scale[:, 0, :].tolist() == [[119, 119], [255, 255], [121, 121], [255, 255]]


def test_grouped_matches_golden_on_written_rows_golden_fills_gaps_with_ones(npu, gen):
    sizes = [40, 0, 90, 64]
    x = (torch.randn(sum(sizes), 16, generator=gen) * 3).half()
    ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    y, scale = npu.npu_grouped_dynamic_mx_quant(x, ends, dst_type=E5M2)
    gy, gs = vendor_goldens.grouped_mx_quantize(x.float().numpy(), ends.tolist(), "float8_e5m2")
    gs = torch.from_numpy(gs.copy())
    gap = scale == POISON_SCALE
    assert torch.equal(_bytes(y), torch.from_numpy(gy.copy()))
    assert torch.equal(scale[~gap], gs[~gap]) and (gs[gap] == 127).all()


def test_grouped_rows_after_the_last_group_end_are_never_written(npu, gen):
    x = torch.randn(64, 4, generator=gen).bfloat16()
    y, scale = npu.npu_grouped_dynamic_mx_quant(x, torch.tensor([32], dtype=torch.int32), dst_type=E4M3)
    assert (_bytes(y[32:]) == 0x7F).all() and (scale[1] == POISON_SCALE).all()
    assert torch.equal(scale[0], npu.npu_dynamic_mx_quant(x[:32], axis=0, dst_type=E4M3)[1][0])


def test_fp16_extremes_follow_the_truncated_exponent(npu):
    # fp16 -> bf16 CAST_TRUNC keeps each value's exponent: 65504 stays in binade 2**15, fp16
    # subnormals get their own binade; the golden's floor(log2) agrees.
    x = torch.tensor([[65504.0] + [1.0] * 31, [2.0**-24] + [0.0] * 31, [6.1e-5] * 32], dtype=torch.float16)
    y, scale = npu.npu_dynamic_mx_quant(x, dst_type=E5M2)
    gy, gs = _golden(x, E5M2)
    assert scale[:, 0, 0].tolist() == [127 + 15 - 15, 127 - 24 - 15, 127 - 15 - 15]
    assert torch.equal(scale, gs) and torch.equal(_bytes(y), gy)


def test_grouped_empty_x_gives_all_poison_scale(npu):
    y, scale = npu.npu_grouped_dynamic_mx_quant(torch.zeros(0, 8, dtype=torch.bfloat16),
                                                torch.tensor([0, 0], dtype=torch.int32), dst_type=E4M3)
    assert y.shape == (0, 8) and scale.shape == (2, 8, 2) and (scale == POISON_SCALE).all()


# ------------------------------------------------------------------------------------- rejections
@pytest.mark.parametrize("op", ["dual", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dual_and_grouped_reject_non_half_inputs(npu, op, dtype):
    x = torch.randn(64, 64, dtype=dtype)
    with pytest.raises(RuntimeError, match="FLOAT16|DT_FLOAT16"):
        if op == "dual":
            npu.npu_dynamic_mx_quant_with_dual_axis(x, dst_type=E4M3)
        else:
            npu.npu_grouped_dynamic_mx_quant(x, torch.tensor([64], dtype=torch.int32), dst_type=E4M3)


def test_dynamic_mx_quant_fp32_only_from_cann_9_1_and_block_32(monkeypatch, gen):
    x = torch.randn(2, 64, generator=gen)
    old = install_fake_torch_npu(monkeypatch, cann_version="9.0.0")
    with pytest.raises(RuntimeError, match="x dtype torch.float32 is not supported"):
        old.npu_dynamic_mx_quant(x, dst_type=E4M3)
    new = install_fake_torch_npu(monkeypatch, cann_version="9.1.0")
    y, s = new.npu_dynamic_mx_quant(x, dst_type=E4M3)
    assert torch.equal(s, _golden(x, E4M3)[1])
    with pytest.raises(RuntimeError, match="block_size must be 32"):
        new.npu_dynamic_mx_quant(x, dst_type=E4M3, block_size=64)
    with pytest.raises(RuntimeError, match="less than 32"):
        new.npu_dynamic_mx_quant(torch.randn(64, 16), dst_type=E4M3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(axis=2), "axis"), (dict(block_size=48), "block_size"), (dict(block_size=2048), "block_size"),
    (dict(dst_type=15), "dtype of y"), (dict(dst_type=290), "dtype of y"), (dict(round_mode="floor"), "must be rint"),
    (dict(round_mode="ceil"), "round_mode"), (dict(scale_alg=2), "scale_alg must be 0 or 1"),
    (dict(scale_alg=3), "scale_alg"), (dict(dst_type_max=5.0), "dst_type_max"),
    (dict(max_low_bound=1.0), "max_low_bound must be 0"), (dict(scale_alg=1, max_low_bound=-1.0), "non-negative"),
], ids=lambda v: str(v))
def test_dynamic_mx_quant_rejections(npu, kwargs, match):
    args = dict(dst_type=E4M3)
    args.update(kwargs)
    with pytest.raises(RuntimeError, match=match):
        npu.npu_dynamic_mx_quant(torch.randn(4, 64).bfloat16(), **args)


def test_dynamic_mx_quant_accepts_torch_npu_dtype_codes(npu):
    x = torch.randn(4, 64).bfloat16()
    a, _ = npu.npu_dynamic_mx_quant(x, dst_type=npu.float8_e4m3fn)  # 292
    b, _ = npu.npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn)  # 24 via the int argument
    assert a.dtype == b.dtype == E4M3 and torch.equal(_bytes(a), _bytes(b))


def test_fp4_dst_types_are_not_modelled(npu):
    with pytest.raises(NotImplementedError, match="FP4"):
        npu.npu_dynamic_mx_quant(torch.randn(4, 64).bfloat16())  # default dst_type 296 (float4_e2m1fn_x2)


def test_grouped_rejections(npu):
    x = torch.randn(64, 8).bfloat16()
    gi = torch.tensor([64], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="X dimNum should be 2"):
        npu.npu_grouped_dynamic_mx_quant(x[None], gi, dst_type=E4M3)
    with pytest.raises(RuntimeError, match="Group_index dimNum should be 1"):
        npu.npu_grouped_dynamic_mx_quant(x, gi[None], dst_type=E4M3)
    with pytest.raises(RuntimeError, match="blocksize must be 32"):
        npu.npu_grouped_dynamic_mx_quant(x, gi, dst_type=E4M3, blocksize=64)
    with pytest.raises(RuntimeError, match="INT32"):
        npu.npu_grouped_dynamic_mx_quant(x, gi.long(), dst_type=E4M3)
    with pytest.raises(RuntimeError, match="empty"):
        npu.npu_grouped_dynamic_mx_quant(x, torch.zeros(0, dtype=torch.int32), dst_type=E4M3)
    with pytest.raises(RuntimeError, match="undefined"):
        npu.npu_grouped_dynamic_mx_quant(x, torch.tensor([40, 30], dtype=torch.int32), dst_type=E4M3)
    with pytest.raises(RuntimeError, match="scale_alg must be 0 or 1"):
        npu.npu_grouped_dynamic_mx_quant(x, gi, dst_type=E4M3, scale_alg=2)


def test_grouped_without_v2_kernel_rejects_even_the_defaults(monkeypatch):
    # op-plugin: the schema defaults count as "set" and scale_alg=None fails the 0/1/2 check, so the
    # op cannot run on a CANN without aclnnGroupedDynamicMxQuantV2 (< 9.1.0).
    old = install_fake_torch_npu(monkeypatch, cann_version="9.0.0")
    x, gi = torch.randn(64, 8).bfloat16(), torch.tensor([64], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="does not support the parameter scale_alg"):
        old.npu_grouped_dynamic_mx_quant(x, gi, dst_type=E4M3)
    with pytest.raises(RuntimeError, match="scale_alg must be 0, 1 or 2"):
        old.npu_grouped_dynamic_mx_quant(x, gi, dst_type=E4M3, scale_alg=None, dst_type_max=None)


@pytest.mark.parametrize("chip,ok", [("Ascend950DT_9571", True), ("Ascend950PR_9579", False), ("Ascend910B3", False)])
def test_chip_gates(monkeypatch, chip, ok):
    npu = install_fake_torch_npu(monkeypatch, chip=chip)
    x = torch.randn(64, 64).bfloat16()
    calls = [lambda: npu.npu_dynamic_mx_quant_with_dual_axis(x, dst_type=E4M3),
             lambda: npu.npu_grouped_dynamic_mx_quant(x, torch.tensor([64], dtype=torch.int32), dst_type=E4M3)]
    for call in calls:
        if ok:
            call()
        else:
            with pytest.raises(RuntimeError, match="SoC"):
                call()
    if chip.startswith("Ascend950"):
        npu.npu_dynamic_mx_quant(x, dst_type=E4M3)  # single-axis: 950PR/950DT
    else:
        with pytest.raises(RuntimeError, match="SoC"):
            npu.npu_dynamic_mx_quant(x, dst_type=E4M3)


def test_missing_kernels_fail_like_exec_npu_cmd(monkeypatch):
    npu = install_fake_torch_npu(monkeypatch, cann_version="8.5.0")
    with pytest.raises(RuntimeError, match="aclnnDynamicMxQuantWithDualAxis or .* not in libopapi.so"):
        npu.npu_dynamic_mx_quant_with_dual_axis(torch.randn(64, 64).bfloat16(), dst_type=E4M3)
    none = install_fake_torch_npu(monkeypatch, cann_version="8.3.0")
    with pytest.raises(RuntimeError, match="aclnnDynamicMxQuant or .* not in libopapi.so"):
        none.npu_dynamic_mx_quant(torch.randn(4, 64).bfloat16(), dst_type=E4M3)


def test_v1_kernel_ignores_dst_type_max_and_max_low_bound(monkeypatch):
    npu = install_fake_torch_npu(monkeypatch, cann_version="9.0.0")  # only aclnnDynamicMxQuant
    x = torch.randn(4, 64).bfloat16()
    a = npu.npu_dynamic_mx_quant(x, dst_type=E4M3, scale_alg=1, max_low_bound=448.0)
    b = npu.npu_dynamic_mx_quant(x, dst_type=E4M3, scale_alg=1)
    assert torch.equal(a[1], b[1])


def test_mxscale_pair_count_matches_ceil_of_half_blocks(npu):
    for d in (1, 31, 32, 33, 64, 65, 97):
        _, scale = npu.npu_dynamic_mx_quant(torch.randn(3, d).bfloat16(), dst_type=E4M3)
        assert scale.shape == (3, math.ceil(math.ceil(d / 32) / 2), 2)


@pytest.mark.parametrize("op", ["dense", "dual", "grouped"])
def test_scale_alg_1_is_accepted_by_every_mx_op_and_rounds_the_scale_up(npu, op):
    """te_npu's default sends scale_alg=1 to every MX quantization op (dense, dual-axis, grouped):
    each accepts it for an FP8 dst type (aclnnDynamicMxQuant.md: scaleAlg 1 "只涉及FP8类型";
    aclnnGroupedDynamicMxQuantV2, ops-nn !3577) and rounds amax / 448 up to a power of two, where
    scale_alg 0 takes floor(log2 amax) - 8: block amax 450 -> code 128 vs 127, amax 448 -> 127 both."""
    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    x[:, :32], x[:, 32:] = 450.0, 448.0  # row blocks; every col block has amax 450 (cols < 32) or 448

    def codes(scale_alg):
        if op == "dense":
            return npu.npu_dynamic_mx_quant(x, axis=-1, dst_type=E4M3, scale_alg=scale_alg)[1][0, 0].tolist()
        if op == "dual":
            return npu.npu_dynamic_mx_quant_with_dual_axis(x, dst_type=E4M3, scale_alg=scale_alg)[1][0, 0].tolist()
        gi = torch.tensor([64], dtype=torch.int32)
        scale = npu.npu_grouped_dynamic_mx_quant(x, gi, dst_type=E4M3, scale_alg=scale_alg)[1]
        return [int(scale[0, 0, 0]), int(scale[0, 32, 0])]

    assert codes(1) == [128, 127] and codes(0) == [127, 127]


@pytest.mark.parametrize("op", ["dense", "dual", "grouped"])
def test_scale_alg_2_is_refused_for_fp8_by_every_mx_op(npu, op):
    # tiling: "If the dtype of output y is FLOAT8_E4M3FN/FLOAT8_E5M2, parameter scale_alg must be 0 or 1"
    x = torch.ones(64, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="scale_alg must be 0 or 1"):
        if op == "dense":
            npu.npu_dynamic_mx_quant(x, dst_type=E4M3, scale_alg=2)
        elif op == "dual":
            npu.npu_dynamic_mx_quant_with_dual_axis(x, dst_type=E4M3, scale_alg=2)
        else:
            npu.npu_grouped_dynamic_mx_quant(x, torch.tensor([64], dtype=torch.int32), dst_type=E4M3, scale_alg=2)
