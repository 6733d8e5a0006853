"""The native C++ CPU kernels (``te_npu.ops.kernels.native_cpu``) equal the eager reference bit for bit.

The kernel's bf16 fast path rounds on 16-bit integer lanes and hands rows it cannot do exactly
to the float path; the sweep below feeds it every finite bf16 value under every reachable block
scale, in both orientations.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from te_npu.numerics import hif8, mxfp8
from te_npu.ops.kernels import native_cpu


@pytest.fixture(scope="module", autouse=True)
def built_kernel():
    ok, reason = native_cpu.is_available(return_reason=True)
    assert ok, f"the native kernel must build here (C++ compiler + ninja): {reason}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"output {i}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert g.dtype == w.dtype, f"output {i}: dtype {g.dtype} != {w.dtype}"
        mismatch = (_bits(g) != _bits(w)).nonzero()
        assert mismatch.numel() == 0, f"output {i}: {mismatch.shape[0]} codes differ, first at {mismatch[0].tolist()}"


def _finite_bf16() -> torch.Tensor:
    """All 65280 finite bf16 values (both signs, zeros and subnormals included)."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return bits[torch.isfinite(bits)]


def _blocks_with_exponent(values: torch.Tensor, e: int) -> torch.Tensor:
    """Rows of 32: a leading 2**(e + 8) (so the block scale is 2**e, floor and ceil alike), then
    every value of ``values`` below 2**(e + 9) in magnitude (the range a block scaled 2**e holds)."""
    lead = torch.tensor(2.0 ** (e + 8), dtype=torch.float32).to(torch.bfloat16)
    kept = values[values.float().abs() < 2.0 ** (e + 9)]
    kept = torch.cat([kept, kept.new_zeros((-kept.numel()) % 31)]).reshape(-1, 31)
    return torch.cat([lead.expand(kept.shape[0], 1), kept], dim=1)


def test_every_finite_bf16_value_under_every_block_scale_matches_eager_in_both_orientations():
    values = _finite_bf16()
    # every reachable floor exponent: amax 2**(e+8) must be a finite bf16, e + 8 <= 127
    blocks = torch.cat([_blocks_with_exponent(values, e) for e in range(-127, 120)])  # [R, 32]
    assert blocks.shape[0] > 100_000
    assert_same(native_cpu.quantize(blocks, axis=-1), mxfp8.quantize(blocks, axis=-1))
    cols = blocks.t().contiguous()  # [32, R]: each column is one block
    assert_same(native_cpu.quantize(cols, axis=-2), mxfp8.quantize(cols, axis=-2))


def _special_tensor(shape, dtype, gen) -> torch.Tensor:
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-20, 20, shape, generator=gen).float())
    flat = x.view(-1)
    n = flat.numel()
    idx = torch.randperm(n, generator=gen)
    flat[idx[0]] = float("nan")
    flat[idx[1]] = float("inf")
    flat[idx[2]] = -float("inf")
    flat[idx[3]] = -0.0
    flat[idx[4:40]] = torch.randn(36, generator=gen) * 1e-39  # fp32 subnormals (bf16 keeps them too)
    flat[idx[40:60]] = 460.0 * 2.0 ** 20  # saturating neighbours of a huge block max
    x = x.to(dtype)
    if x.dim() == 2 and x.shape[0] >= 64 and x.shape[1] >= 64:
        x[32:64, :32] *= 2.0 ** -125  # a whole block with a tiny scale (e <= -117: the float path)
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("scale_alg", ["floor", "ceil"])
@pytest.mark.parametrize("shape", [(64, 96), (256, 2048), (3, 64, 32)])
def test_dual_matches_eager_with_nan_inf_zero_subnormal_and_saturating_values(dtype, scale_alg, shape, gen):
    x = _special_tensor(shape, dtype, gen)
    assert_same(native_cpu.quantize_dual(x, scale_alg=scale_alg), mxfp8.quantize_dual(x, scale_alg=scale_alg))


@pytest.mark.parametrize("shape", [(7, 3, 64), (5, 32), (96, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_quantize_matches_eager_for_any_number_of_rows(shape, dtype, gen):
    x = _special_tensor(shape, dtype, gen)
    assert_same(native_cpu.quantize(x, axis=-1), mxfp8.quantize(x, axis=-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_col_quantize_of_a_3d_tensor_keeps_blocks_inside_each_matrix(dtype, gen):
    x = _special_tensor((4, 64, 96), dtype, gen)
    x[1] *= 2.0 ** 30  # neighbouring matrices with very different scales
    assert_same(native_cpu.quantize(x, axis=-2), mxfp8.quantize(x, axis=-2))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.uint16, (64, 64)), st.sampled_from(["floor", "ceil"]))
def test_any_bf16_bit_pattern_quantizes_like_eager(bits, scale_alg):
    x = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    assert_same(native_cpu.quantize_dual(x, scale_alg=scale_alg), mxfp8.quantize_dual(x, scale_alg=scale_alg))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, (32, 64), elements=st.floats(width=32, allow_nan=True, allow_infinity=True)))
def test_any_fp32_tensor_quantizes_like_eager(arr):
    x = torch.from_numpy(arr.copy())
    assert_same(native_cpu.quantize_dual(x), mxfp8.quantize_dual(x))


def test_out_tensors_are_written_in_place(gen):
    x = torch.randn(64, 128, generator=gen).to(torch.bfloat16)
    out = (torch.empty(64, 128, dtype=torch.float8_e4m3fn), torch.empty(64, 4, dtype=torch.uint8),
           torch.empty(64, 128, dtype=torch.uint8), torch.empty(2, 128, dtype=torch.uint8))
    pointers = [t.data_ptr() for t in out]
    got = native_cpu.quantize_dual(x, out=out)
    assert [t.data_ptr() for t in got] == pointers
    assert_same(got, mxfp8.quantize_dual(x))


def test_non_contiguous_input_is_quantized_by_value(gen):
    x = torch.randn(128, 64, generator=gen).to(torch.bfloat16).t()  # [64, 128] transposed view
    assert_same(native_cpu.quantize_dual(x), mxfp8.quantize_dual(x))


def test_shape_not_a_multiple_of_the_block_raises_naming_the_shape():
    with pytest.raises(ValueError, match=r"\(64, 48\)"):
        native_cpu.quantize_dual(torch.zeros(64, 48))
    with pytest.raises(ValueError, match=r"\(40, 64\)"):
        native_cpu.quantize(torch.zeros(40, 64), axis=-2)


def test_other_block_sizes_and_devices_are_refused():
    with pytest.raises(ValueError, match="block_size=32 only"):
        native_cpu.quantize_dual(torch.zeros(64, 64), block_size=16)
    with pytest.raises(ValueError, match="CPU tensors"):
        native_cpu.quantize_dual(torch.zeros(64, 64, device="meta"))


def test_wrong_out_buffers_are_refused():
    x = torch.zeros(64, 64)
    good = [torch.empty(64, 64, dtype=torch.uint8), torch.empty(64, 2, dtype=torch.uint8),
            torch.empty(64, 64, dtype=torch.uint8), torch.empty(2, 64, dtype=torch.uint8)]
    with pytest.raises(ValueError, match="row_scale"):
        native_cpu.quantize_dual(x, out=(good[0], torch.empty(64, 3, dtype=torch.uint8), good[2], good[3]))
    with pytest.raises(ValueError, match="col_data.*dtype"):
        native_cpu.quantize_dual(x, out=(good[0], good[1], torch.empty(64, 64), good[3]))


def test_native_variant_routes_emulation_quantization_to_the_native_kernel(monkeypatch, gen):
    from te_npu import ops

    calls = []
    monkeypatch.setattr(native_cpu, "quantize_dual", lambda *a, **k: calls.append("dual") or mxfp8.quantize_dual(*a, **k))
    monkeypatch.setattr(native_cpu, "quantize", lambda *a, **k: calls.append("one") or mxfp8.quantize(*a, **k))
    x = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
    ops.mxfp8_quantize_dual(x)
    ops.mxfp8_quantize(x, axis=-2)
    assert calls == []  # default: eager
    with ops.use_quant_kernel("native"):
        ops.mxfp8_quantize_dual(x)
        ops.mxfp8_quantize(x, axis=-1)
        ops.mxfp8_quantize(x.reshape(64, 2, 32), axis=0)  # a leading axis: eager
    assert calls == ["dual", "one"]


@pytest.mark.parametrize("recipe_name", ["mxfp8", "hif8"])
def test_linear_and_grouped_expert_steps_under_native_kernels_match_eager_bitwise(monkeypatch, gen, recipe_name):
    import te_npu

    recipe = te_npu.MXFP8BlockRecipe() if recipe_name == "mxfp8" else te_npu.HiF8CurrentScalingRecipe()
    x = torch.randn(64, 128, generator=gen).to(torch.bfloat16)

    def build():
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"lin": te_npu.TELinear(128, 96, params_dtype=torch.bfloat16, bias=False),
                                    "experts": te_npu.TEGroupedSwiGLUExperts(4, 128, 64, params_dtype=torch.bfloat16)})

    def step(model):
        inp = x.clone().requires_grad_(True)
        with te_npu.autocast(recipe=recipe):
            out = model["lin"](inp).float().square().sum() + model["experts"](inp, [40, 0, 7, 17]).float().square().sum()
        out.backward()
        return [out.detach(), inp.grad] + [p.grad for p in model.parameters()]

    eager = step(build())
    calls = []
    for name in ("quantize", "quantize_dual", "hif8_current_quantize", "dequantize", "hif8_decode"):
        original = getattr(native_cpu, name)
        monkeypatch.setattr(native_cpu, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    with te_npu.ops.use_quant_kernel("native"):
        native = step(build())
    # MXFP8: dual for dense operands and weights, row-only for grouped activations plus their
    # padded ragged col blocks; HiF8: one current-scaled payload per tensor; every GEMM operand
    # decodes natively (ragged col operands included)
    expected = ({"quantize_dual", "quantize", "dequantize"} if recipe_name == "mxfp8"
                else {"hif8_current_quantize", "hif8_decode"})
    assert set(calls) == expected and len(calls) >= 3, calls
    for a, b in zip(eager, native, strict=True):
        assert torch.equal(a, b)


def test_unknown_kernel_name_is_refused_naming_the_known_ones():
    from te_npu import ops

    with pytest.raises(ValueError, match=r"unknown quantization kernel 'fast'.*eager.*compiled.*native"):
        with ops.use_quant_kernel("fast"):
            pass


# ----------------------------------------------------------------------------- HiF8
def _eager_hif8(x: torch.Tensor, format_max: float, per_group: bool = False, saturate: bool = False):
    magnitude = x.abs().float()
    amax = magnitude.amax(dim=tuple(range(1, x.dim()))) if per_group else magnitude.amax()
    scale = hif8.current_scale(amax, format_max)
    return hif8.quantize(x, scale, saturate), scale, amax


def assert_same_hif8(got, want):
    codes, scale, amax = got
    want_codes, want_scale, want_amax = want
    assert torch.equal(scale, want_scale) and scale.shape == want_scale.shape
    assert torch.equal(amax, want_amax) or (amax.isnan().all() and want_amax.isnan().all())
    assert_same((codes,), (want_codes,))


def _fp32_sweep() -> torch.Tensor:
    """Every exponent field and sign x the top 12 mantissa bits x low bits {0, 1, all ones}: every
    rounding boundary of every band (ties, one ulp above, one ulp below), Inf and NaN included."""
    field = torch.arange(256, dtype=torch.int64).view(-1, 1, 1, 1)
    sign = torch.tensor([0, 1], dtype=torch.int64).view(1, -1, 1, 1) << 31
    top = torch.arange(1 << 12, dtype=torch.int64).view(1, 1, -1, 1) << 11
    low = torch.tensor([0, 1, (1 << 11) - 1], dtype=torch.int64).view(1, 1, 1, -1)
    bits = (sign | (field << 23) | top | low).flatten()
    return bits.to(torch.int32).view(torch.float32)  # int64 -> int32 wraps the sign bit in


@pytest.mark.parametrize("saturate", [False, True])
def test_hif8_every_rounding_boundary_of_every_band_matches_eager(saturate):
    x = _fp32_sweep()
    # amax = format_max = 2**126 makes the scale amax * (1.0f / format_max) exactly 1.0 (a power
    # of two has an exact reciprocal): the codes are hif8.encode(x). |x| >= 2**126 (far past
    # HiF8's overflow at 40960, which the sweep covers from there up) are dropped for that.
    x = x[~x.isnan()]  # a NaN amax would force scale 1.0 anyway; keep the amax finite ...
    x = x[x.abs() < 2.0**126]
    x = torch.cat([x, torch.tensor([2.0**126])])
    codes, scale, amax = native_cpu.hif8_current_quantize(x, 2.0**126, saturate=saturate)
    assert scale.item() == 1.0
    assert_same((codes,), (hif8.encode(x, saturate),))
    # ... and Inf / NaN elements, with scale 1.0 (amax not finite), in a second call
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), -float("nan"), 0.0, -0.0, 1.0])
    assert_same_hif8(native_cpu.hif8_current_quantize(special, 15.0, saturate=saturate),
                     _eager_hif8(special, 15.0, saturate=saturate))


@pytest.mark.parametrize("format_max", [15.0, 224.0])
def test_hif8_native_scale_is_amax_times_fp32_reciprocal(format_max, gen):
    """The native kernel's scale is ``amax * (1.0f / format_max)`` (ops-nn dynamic_quant arch35
    pertensor kernel), checked against numpy FP32 on amax values where that differs from the
    spec's ``amax / format_max`` (most of them)."""
    amaxes = (torch.rand(64, generator=gen) * 100 + 1).numpy().astype(np.float32)
    kernel = amaxes * (np.float32(1.0) / np.float32(format_max))
    assert np.count_nonzero(kernel != amaxes / np.float32(format_max)) > 0
    x = torch.from_numpy(amaxes).view(64, 1, 1) * torch.ones(64, 2, 32)
    x[:, 1] *= -0.5
    _, scale, _ = native_cpu.hif8_current_quantize(x, format_max, per_group=True)
    assert np.array_equal(scale.numpy().view(np.uint32), kernel.view(np.uint32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("format_max", [15.0, 224.0])
def test_hif8_current_scaling_matches_eager(dtype, format_max, gen):
    x = _special_tensor((96, 160), torch.float32, gen)
    x = x[torch.isfinite(x).all(dim=1)].to(dtype)  # finite rows: a real amax
    assert_same_hif8(native_cpu.hif8_current_quantize(x, format_max), _eager_hif8(x, format_max))
    x[3, 5] = float("nan")
    assert_same_hif8(native_cpu.hif8_current_quantize(x, format_max), _eager_hif8(x, format_max))


def test_hif8_per_expert_scales_match_eager(gen):
    x = torch.randn(4, 64, 96, generator=gen) * torch.tensor([1e-3, 1.0, 1e3, 0.0]).view(4, 1, 1)
    x = x.to(torch.bfloat16)
    assert_same_hif8(native_cpu.hif8_current_quantize(x, 15.0, per_group=True),
                     _eager_hif8(x, 15.0, per_group=True))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, (16, 40), elements=st.floats(width=32, allow_nan=False, allow_infinity=False)),
       st.sampled_from([15.0, 224.0]))
def test_hif8_any_finite_fp32_tensor_matches_eager(arr, format_max):
    x = torch.from_numpy(arr.copy())
    assert_same_hif8(native_cpu.hif8_current_quantize(x, format_max), _eager_hif8(x, format_max))


def test_a_kernel_that_cannot_build_raises_with_the_reason_instead_of_running_eager(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    from te_npu import ops
    from te_npu.ops.kernels import QuantKernelUnavailable, choose_quant_kernel

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    native_cpu._load.cache_clear()
    try:
        assert native_cpu.is_available(return_reason=True) == (False, "RuntimeError: Ninja is required to load C++ extensions")
        with pytest.raises(native_cpu.NativeKernelUnavailable, match="Ninja is required"):
            native_cpu.quantize_dual(torch.zeros(64, 64))
        with pytest.raises(QuantKernelUnavailable, match="'native' kernels cannot run here: .*Ninja is required"):
            with ops.use_quant_kernel("native"):
                ops.mxfp8_quantize_dual(torch.zeros(64, 64))
        with pytest.raises(QuantKernelUnavailable, match="Ninja is required"):
            choose_quant_kernel("native", "cpu")
        # auto alone falls back, and says why
        choice = choose_quant_kernel("auto", "cpu")
        assert choice.name == "eager" and "Ninja is required" in choice.reason
    finally:
        native_cpu._load.cache_clear()  # the next caller builds (or loads the cached build) again


# ----------------------------------------------------------------------------- table decode
def _every_code_under_every_scale():
    """data [256, 256]: row i, col j holds E4M3 code j; row scale code of row i is i (i = 255: the
    NaN scale). Returned as (data, row_scale [256, 8]) with every block of a row sharing code i."""
    data = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(torch.float8_e4m3fn)
    scale = torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, 8)
    return data, scale


def _assert_equal_nan(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shift", [0, 3])
def test_decode_every_e4m3_code_under_every_scale_code_matches_eager(shift):
    data, row_scale = _every_code_under_every_scale()
    # the scale is raised before it multiplies (codes >= 252 raised by 2**3 overflow to inf; no
    # finite input reaches them, but the order is pinned): value * (2**(code - 127) * 2**shift)
    raised = (mxfp8.e8m0_to_float(row_scale) * 2.0**shift).repeat_interleave(32, dim=1)
    want = mxfp8.decode_e4m3(data) * raised
    if shift == 0:
        _assert_equal_nan(want, mxfp8.dequantize(data, row_scale, axis=-1))
    _assert_equal_nan(native_cpu.dequantize(data, row_scale, -1, scale_shift=shift), want)
    # the same values transposed: blocks along dim -2
    col_data, col_scale = data.t().contiguous(), row_scale.t().contiguous()
    _assert_equal_nan(native_cpu.dequantize(col_data, col_scale, -2, scale_shift=shift), want.t())


def test_decode_3d_weights_in_both_orientations_matches_eager(gen):
    w = torch.randn(3, 64, 96, generator=gen) * 10
    for axis in (-1, -2):
        data, scale = mxfp8.quantize(w, axis=axis)
        _assert_equal_nan(native_cpu.dequantize(data, scale, axis), mxfp8.dequantize(data, scale, axis=axis))


def test_decode_ragged_col_operand_matches_eager(gen):
    sizes = torch.tensor([40, 0, 7, 33, 1])
    x = torch.randn(81, 64, generator=gen) * torch.logspace(-30, 30, 81).unsqueeze(1)
    data, scale = mxfp8.quantize_grouped(x, sizes)
    row_to_block, _ = mxfp8.group_block_index(sizes)
    _assert_equal_nan(native_cpu.dequantize(data, scale, -2, row_to_block=row_to_block),
                      mxfp8.dequantize_grouped(data, scale, sizes))


def test_decode_every_hif8_code_matches_eager():
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    _assert_equal_nan(native_cpu.hif8_decode(codes), hif8.decode(codes))
    big = torch.randint(0, 256, (3, 100, 64), dtype=torch.uint8)
    _assert_equal_nan(native_cpu.hif8_decode(big), hif8.decode(big))


def test_decode_rejects_bad_block_maps_and_shapes():
    data, scale = mxfp8.quantize(torch.randn(64, 32), axis=-2)
    with pytest.raises(RuntimeError, match="outside"):
        native_cpu.dequantize(data, scale, -2, row_to_block=torch.full((64,), 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="row_to_block"):
        native_cpu.dequantize(data, scale, -2, row_to_block=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="scale of shape"):
        native_cpu.dequantize(data, scale, -1)


@pytest.mark.parametrize("scale_alg", ["floor", "ceil"])
def test_ragged_col_quantization_through_the_native_kernel_matches_eager(monkeypatch, gen, scale_alg):
    from te_npu import ops

    sizes = torch.tensor([40, 0, 7, 33, 1])
    x = (torch.randn(81, 64, generator=gen) * torch.logspace(-30, 30, 81).unsqueeze(1)).to(torch.bfloat16)
    x[3, 5] = float("nan")
    want = mxfp8.quantize_grouped(x, sizes, scale_alg=scale_alg)
    calls = []
    original = native_cpu.quantize
    monkeypatch.setattr(native_cpu, "quantize", lambda *a, **k: calls.append(k.get("axis")) or original(*a, **k))
    with ops.use_quant_kernel("native"):
        got = ops.mxfp8_quantize_grouped(x, sizes, scale_alg=scale_alg)
    assert calls == [-2]
    assert_same(got, want)
