"""NPU wrappers through the recording fake torch_npu: every argument sent, layouts, no fallback."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import te_npu.ops as ops
from te_npu.errors import LowPrecisionUnavailableError
from te_npu.formats import Format
from te_npu.ops import emulation, npu, registry
from te_npu.quantizers import HiF8Quantizer, MXFP8Quantizer
from tests.fakes import install_fake_torch_npu


@pytest.fixture
def fake(monkeypatch):
    return install_fake_torch_npu(monkeypatch)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


def _rand(gen, *shape):
    return (torch.randn(*shape, generator=gen) * 2).to(torch.bfloat16)


# ---------------------------------------------------------------- scale layouts
@pytest.mark.parametrize("blocks", [1, 2, 3, 4])
def test_row_scale_layout_round_trips(gen, blocks):
    scale = torch.randint(0, 255, (5, blocks), generator=gen, dtype=torch.uint8)
    npu_scale = npu.to_npu_row_scale(scale)
    assert npu_scale.shape == (5, (blocks + 1) // 2, 2)
    if blocks % 2:
        assert torch.all(npu_scale[:, -1, 1] == 0)  # odd count padded with a zero code
    assert torch.equal(npu.from_npu_row_scale(npu_scale, 32 * blocks), scale)


@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_col_scale_layout_round_trips_and_interleaves(gen, blocks):
    scale = torch.randint(0, 255, (2, blocks, 6), generator=gen, dtype=torch.uint8)
    npu_scale = npu.to_npu_col_scale(scale)
    assert npu_scale.shape == (2, (blocks + 1) // 2, 6, 2)
    assert torch.equal(npu_scale[:, 0, :, 0], scale[:, 0])  # out[p, n, j] = in[2p + j, n]
    if blocks > 1:
        assert torch.equal(npu_scale[:, 0, :, 1], scale[:, 1])
    assert torch.equal(npu.from_npu_col_scale(npu_scale, 32 * blocks), scale)


def test_grouped_scale_layout_round_trips(gen):
    sizes = torch.tensor([33, 0, 64, 5])  # 2, 0, 2, 1 blocks
    scale = torch.randint(1, 255, (5, 8), generator=gen, dtype=torch.uint8)
    npu_scale = npu.to_npu_grouped_scale(scale, sizes)
    assert npu_scale.shape == (102 // 64 + 4, 8, 2)
    assert torch.equal(npu_scale[2, :, 0], scale[4]) and torch.all(npu_scale[2, :, 1] == 0)
    assert torch.equal(npu.from_npu_grouped_scale(npu_scale, sizes), scale)


# ---------------------------------------------------------------- quantization
@pytest.mark.parametrize("axis", [-1, -2])
def test_mxfp8_quantize_sends_documented_args_and_matches_numerics(fake, gen, axis):
    x = _rand(gen, 64, 96)
    data, scale = npu.mxfp8_quantize(x, axis, 32, "ceil")
    (call,) = fake.calls_of("npu_dynamic_mx_quant")
    assert call.kwargs == dict(axis=axis, round_mode="rint", dst_type=torch.float8_e4m3fn, block_size=32,
                               scale_alg=1, dst_type_max=0.0)
    ref_data, ref_scale = emulation.mxfp8_quantize(x, axis, 32, "ceil")
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8)) and torch.equal(scale, ref_scale)


def test_mxfp8_quantize_dual_and_grouped_convert_back(fake, gen):
    w = _rand(gen, 2, 96, 64)
    got = npu.mxfp8_quantize_dual(w, 32, "floor")
    ref = emulation.mxfp8_quantize_dual(w, 32, "floor")
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, ref))
    assert fake.calls_of("npu_dynamic_mx_quant_with_dual_axis")[0].kwargs["scale_alg"] == 0
    x, sizes = _rand(gen, 70, 64), torch.tensor([31, 0, 39])
    data, scale = npu.mxfp8_quantize_grouped(x, sizes, 32, "floor")
    (call,) = fake.calls_of("npu_grouped_dynamic_mx_quant")
    assert call.args[1].dtype == torch.int32 and call.args[1].tolist() == [31, 31, 70]  # cumsum group_index
    assert call.kwargs["blocksize"] == 32 and call.kwargs["dst_type"] == torch.float8_e4m3fn
    assert torch.equal(scale, emulation.mxfp8_quantize_grouped(x, sizes, 32, "floor")[1])


@pytest.mark.parametrize("format_max", [15.0, 224.0])
def test_hif8_quantize_sends_pertensor_and_format_max(fake, gen, format_max):
    x = _rand(gen, 16, 32)
    codes, scale, _ = npu.hif8_quantize(x, format_max)
    (call,) = fake.calls_of("npu_dynamic_quant")
    assert call.kwargs["dst_type"] is fake.hifloat8
    assert call.kwargs["quant_mode"] == "pertensor" and call.kwargs["dst_type_max"] == format_max
    ref_codes, ref_scale, _ = emulation.hif8_quantize(x, format_max)
    assert scale.shape == () and torch.equal(scale, ref_scale) and torch.equal(codes, ref_codes)


def test_hif8_quantize_3d_is_per_expert_and_with_scale(fake, gen):
    w = _rand(gen, 3, 8, 32)
    codes, scale, _ = npu.hif8_quantize(w, 15.0)
    assert scale.shape == (3,) and len(fake.calls_of("npu_dynamic_quant")) == 3
    again = npu.hif8_quantize_with_scale(w, scale)
    assert torch.equal(again, codes) and all(c.args[3] is fake.hifloat8 for c in fake.calls_of("npu_quantize"))


# ---------------------------------------------------------------- GEMMs
ORIENT = {"NT": ("row", "row"), "NN": ("row", "col"), "TN": ("col", "col")}
SHAPES = {"NT": ((64, 128), (96, 128)), "NN": ((64, 96), (96, 128)), "TN": ((64, 96), (64, 128))}


def _dense(gen, fmt, layout):
    q = MXFP8Quantizer() if fmt == Format.MXFP8_E4M3 else HiF8Quantizer(15.0)
    (ls, rs), (lo, ro) = SHAPES[layout], ORIENT[layout]
    return q.quantize(_rand(gen, *ls), orientation=lo), q.quantize(_rand(gen, *rs), orientation=ro)


@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
def test_mxfp8_matmul_sends_mx_mode_args(fake, gen, layout):
    left, right = _dense(gen, Format.MXFP8_E4M3, layout)
    out = npu.matmul(left, right, layout, torch.bfloat16)
    (call,) = fake.calls_of("npu_quant_matmul")
    x1, x2, x2_scale = call.args
    assert call.kwargs["scale_dtype"] is fake.float8_e8m0fnu
    assert call.kwargs["pertoken_scale_dtype"] is fake.float8_e8m0fnu
    assert call.kwargs["group_sizes"] == [1, 1, 32] and call.kwargs["output_dtype"] == torch.bfloat16
    m, k = x1.shape
    pairs = -(-k // 64)
    assert x2.shape[0] == k and x2_scale.shape == (pairs, x2.shape[1], 2)
    assert call.kwargs["pertoken_scale"].shape == (m, pairs, 2)
    assert x1.dtype == x2.dtype == torch.float8_e4m3fn
    assert (layout == "NT") == (not x2.is_contiguous())  # W^T passed as a view
    assert (layout == "TN") == (not x1.is_contiguous())  # dY^T passed as a view
    ref = emulation.matmul(left, right, layout, torch.bfloat16)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
def test_hif8_matmul_sends_hifloat8_and_fp32_scales(fake, gen, layout):
    left, right = _dense(gen, Format.HIF8, layout)
    out = npu.matmul(left, right, layout, torch.float32)
    (call,) = fake.calls_of("npu_quant_matmul")
    assert call.kwargs["x1_dtype"] is fake.hifloat8 and call.kwargs["x2_dtype"] is fake.hifloat8
    assert call.args[2].dtype == torch.float32 and call.args[2].shape == (1,)
    assert torch.equal(call.kwargs["pertoken_scale"], left.scale.reshape(1))
    assert call.kwargs["group_sizes"] is None and call.kwargs["scale_dtype"] is None
    torch.testing.assert_close(out, emulation.matmul(left, right, layout, torch.float32))


def _grouped(gen, fmt, layout, sizes):
    q = MXFP8Quantizer() if fmt == Format.MXFP8_E4M3 else HiF8Quantizer(15.0)
    gl = torch.tensor(sizes)
    T = sum(sizes)
    if layout == "TN":
        return (q.quantize(_rand(gen, T, 64), orientation="col", group_list=gl),
                q.quantize(_rand(gen, T, 96), orientation="col", group_list=gl), gl)
    shape = (T, 96) if layout == "NT" else (T, 64)
    return q.quantize(_rand(gen, *shape), orientation="row"), q.quantize(_rand(gen, 3, 64, 96), orientation=ORIENT[layout][1]), gl


@pytest.mark.parametrize("layout", ["NT", "NN", "TN"])
@pytest.mark.parametrize("fmt", [Format.MXFP8_E4M3, Format.HIF8], ids=lambda f: f.value)
def test_grouped_matmul_sends_group_args(fake, gen, fmt, layout):
    left, right, gl = _grouped(gen, fmt, layout, [40, 0, 35])
    out = npu.grouped_matmul(left, right, gl, layout, torch.float32)
    (call,) = fake.calls_of("npu_grouped_matmul")
    kw = call.kwargs
    assert kw["group_list"].tolist() == [40, 40, 75] and kw["group_list_type"] == 0  # cumsum
    assert kw["group_type"] == (2 if layout == "TN" else 0) and kw["split_item"] == 3
    assert kw["output_dtype"] == torch.float32
    if fmt == Format.HIF8:
        assert kw["x_dtype"] is fake.hifloat8 and kw["weight_dtype"] is fake.hifloat8
        assert kw["scale"][0].dtype == torch.float32 and kw["scale"][0].shape == (3,)
        assert kw["per_token_scale"][0].shape == ((3,) if layout == "TN" else (75,))
    else:
        assert kw["scale_dtype"] is fake.float8_e8m0fnu and kw["per_token_scale_dtype"] is fake.float8_e8m0fnu
    if layout == "NT":
        assert call.args[1][0].shape == (3, 96, 64)  # W^T view [G, K, N]
    torch.testing.assert_close(out, emulation.grouped_matmul(left, right, gl, layout, torch.float32))


# ---------------------------------------------------------------- failure semantics
def _forbid_high_precision(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("high-precision GEMM ran")

    for target, name in ((torch, "mm"), (torch, "matmul"), (F, "linear"), (torch, "_grouped_mm")):
        monkeypatch.setattr(target, name, boom)


@pytest.mark.parametrize("fmt", [Format.MXFP8_E4M3, Format.HIF8], ids=lambda f: f.value)
def test_kernel_error_propagates_without_fallback(fake, gen, monkeypatch, fmt):
    left, right = _dense(gen, fmt, "NT")
    gl_left, gl_right, gl = _grouped(gen, fmt, "NN", [10, 20, 3])
    monkeypatch.setitem(registry._BY_DEVICE_TYPE, "cpu", npu)  # route CPU tensors to the NPU backend
    _forbid_high_precision(monkeypatch)
    fake.fail("npu_quant_matmul", RuntimeError("aclnnQuantMatmul failed: 561103"))
    fake.fail("npu_grouped_matmul", RuntimeError("aclnnGroupedMatmul failed"))
    with pytest.raises(RuntimeError, match="561103"):
        ops.low_precision_matmul(left, right, layout="NT", output_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="aclnnGroupedMatmul"):
        ops.low_precision_grouped_matmul(gl_left, gl_right, gl, layout="NN", output_dtype=torch.bfloat16)


def test_npu_backend_is_reported_in_events(fake, gen, monkeypatch):
    left, right = _dense(gen, Format.HIF8, "NN")
    monkeypatch.setitem(registry._BY_DEVICE_TYPE, "cpu", npu)
    events = []
    with ops.observe(events.append):
        ops.low_precision_matmul(left, right, layout="NN", output_dtype=torch.float32)
    assert [(e.backend, e.gemm) for e in events] == [("npu", "dgrad")]


# ---------------------------------------------------------------- capability
def test_capability_without_torch_npu_is_false_and_never_raises(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)  # import raises ImportError
    ok, reason = ops.is_mxfp8_available(return_reason=True)
    assert not ok and "torch_npu" in reason and ops.is_hif8_available() is False
    assert ops.require_low_precision("hif8", "cpu") == "emulation"
    with pytest.raises(LowPrecisionUnavailableError, match="not importable"):
        ops.require_low_precision(Format.MXFP8_E4M3, "npu")


def test_capability_with_fake_torch_npu(fake, monkeypatch):
    assert ops.is_mxfp8_available() and ops.is_hif8_available(return_reason=True)[0]
    assert ops.require_low_precision("mxfp8_e4m3", "npu:0") == "npu"
    monkeypatch.delattr(fake, "hifloat8")
    ok, reason = ops.is_hif8_available(return_reason=True)
    assert not ok and "hifloat8" in reason
    with pytest.raises(LowPrecisionUnavailableError, match="hifloat8"):
        ops.require_low_precision("hif8", "npu")


def test_capability_without_device(monkeypatch):
    install_fake_torch_npu(monkeypatch, device_count=0)
    assert ops.is_mxfp8_available(return_reason=True) == (False, "no NPU device is visible")


def test_registry_routes_by_device():
    assert registry.backend_for("cpu") is emulation and registry.backend_for("npu:0") is npu
    assert registry.backend_for("cpu", override="npu") is npu
