"""The native C++ MXFP8 CPU kernel equals the eager reference ``mxfp8.quantize`` bit for bit.

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

from te_npu.numerics import mxfp8, native_cpu


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


def test_env_switch_routes_emulation_quantization_to_the_native_kernel(monkeypatch, gen):
    from te_npu import ops
    from te_npu.ops import emulation

    calls = []
    monkeypatch.setattr(native_cpu, "quantize_dual", lambda *a, **k: calls.append("dual") or mxfp8.quantize_dual(*a, **k))
    monkeypatch.setattr(native_cpu, "quantize", lambda *a, **k: calls.append("one") or mxfp8.quantize(*a, **k))
    x = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
    ops.mxfp8_quantize_dual(x)
    ops.mxfp8_quantize(x, axis=-2)
    assert calls == []  # default: eager
    monkeypatch.setenv(emulation.CPU_QUANT_KERNEL_ENV, "native")
    ops.mxfp8_quantize_dual(x)
    ops.mxfp8_quantize(x, axis=-1)
    ops.mxfp8_quantize(x.reshape(64, 2, 32), axis=0)  # a leading axis: eager
    assert calls == ["dual", "one"]


def test_linear_step_under_native_kernel_matches_eager_bitwise(monkeypatch, gen):
    import te_npu
    from te_npu.ops import emulation

    x = torch.randn(64, 128, generator=gen).to(torch.bfloat16)
    eager_layer = te_npu.TELinear(128, 96, params_dtype=torch.bfloat16)
    native_layer = te_npu.TELinear(128, 96, params_dtype=torch.bfloat16)
    native_layer.load_state_dict(eager_layer.state_dict())

    def step(layer):
        inp = x.clone().requires_grad_(True)
        with te_npu.autocast(recipe=te_npu.MXFP8BlockRecipe()):
            out = layer(inp)
        out.float().square().sum().backward()
        return out.detach(), inp.grad, layer.weight.grad

    eager = step(eager_layer)
    calls = []
    for name in ("quantize", "quantize_dual"):
        original = getattr(native_cpu, name)
        monkeypatch.setattr(native_cpu, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    monkeypatch.setenv(emulation.CPU_QUANT_KERNEL_ENV, "native")
    native = step(native_layer)
    assert calls == ["quantize_dual"] * 3  # weight, input and output gradient: row + col each
    for a, b in zip(eager, native):
        assert torch.equal(a, b)


def test_unknown_env_value_is_refused_naming_the_variable(monkeypatch):
    from te_npu import ops
    from te_npu.ops import emulation

    monkeypatch.setenv(emulation.CPU_QUANT_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="TE_NPU_CPU_QUANT_KERNEL='fast'"):
        ops.mxfp8_quantize_dual(torch.zeros(64, 64))
