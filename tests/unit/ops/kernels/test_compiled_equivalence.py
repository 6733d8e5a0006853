"""The ``compiled`` kernels (te_npu.ops.kernels.compiled: torch.compile of the numerics functions)
equal the eager ones bit for bit.

Every case compiles (30-100 s each on a loaded 2-core CPU), so every case is marked slow:
run them with ``python -m pytest -q -m slow tests/unit/ops/kernels/test_compiled_equivalence.py``. Inputs mix ordinary values with the edge cases of each format: zeros of
both signs, FP32/BF16 subnormals, ties, values beyond the format, +-Inf and NaN.
"""
import math

import numpy as np
import pytest
import torch

from te_npu.numerics import hif8, mxfp8
from te_npu.ops.kernels import KERNELS

compiled = KERNELS["compiled"]


def hif8_encode_compiled(x, saturate):
    """The compiled form of ``hif8.encode`` itself (the kernels call it through ``hif8.quantize``)."""
    return compiled.compiled(hif8.encode)(x, saturate, tables=compiled.encode_tables(x.device))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_bitwise_equal(got, ref):
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert torch.equal(_bits(g), _bits(r)), f"{int((_bits(g) != _bits(r)).sum())} codes differ"


def mixed_input(shape, gen, dtype=torch.float32, specials=True) -> torch.Tensor:
    """Normal values over a wide exponent range, plus one block of special values."""
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-30, 30, shape, generator=gen).float())
    if specials:
        flat = x.view(-1)
        special = torch.tensor([0.0, -0.0, 1e-40, -1e-42, 2.0**-126, 448.0, 464.0, -480.0, 1.0625,
                                2.0**-23, 40960.0, 1e30, -3e38])
        flat[: special.numel()] = special
        flat[200] = math.nan
        flat[333] = math.inf
        flat[500] = -math.inf
        flat[-64:-32] = 0.0  # an all-zero block
        flat[-32:] *= 2.0**-120  # a tiny block: scale code 0 / subnormal elements
    return x.to(dtype)


@pytest.mark.slow
def test_compiled_mxfp8_dual_small_bf16(gen):
    """The smallest case: dual-axis MXFP8 of a small bf16 weight with special values."""
    x = mixed_input((64, 96), gen, torch.bfloat16)
    assert_bitwise_equal(compiled.mxfp8_quantize_dual(x), mxfp8.quantize_dual(x))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("alg", ["floor", "ceil"])
def test_compiled_mxfp8_quantize_equals_eager(dtype, alg, gen):
    x = mixed_input((64, 128), gen, dtype)
    for axis in (-1, 0):
        got = compiled.mxfp8_quantize(x, axis, scale_alg=alg)
        assert_bitwise_equal(got, mxfp8.quantize(x, axis, scale_alg=alg))


@pytest.mark.slow
def test_compiled_mxfp8_every_bf16_value_equals_eager():
    # all 65536 bf16 bit patterns, blocked both ways, with and without huge neighbours
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)  # keep most blocks finite
    assert_bitwise_equal(compiled.mxfp8_quantize_dual(x), mxfp8.quantize_dual(x))
    y = x.clone()
    y[::7, ::5] = 3e38
    assert_bitwise_equal(compiled.mxfp8_quantize_dual(y), mxfp8.quantize_dual(y))


@pytest.mark.slow
def test_compiled_mxfp8_random_fp32_bits_equal_eager(np_rng):
    bits = np_rng.integers(-(2**31), 2**31, size=(128, 256), dtype=np.int64).astype(np.int32)
    x = torch.from_numpy(bits.view(np.float32))
    x[:64] = x[:64].abs() * 2.0**-100  # many finite blocks with tiny/subnormal members
    assert_bitwise_equal(compiled.mxfp8_quantize_dual(x), mxfp8.quantize_dual(x))


@pytest.mark.slow
def test_compiled_mxfp8_dual_3d(gen):
    x = mixed_input((2, 64, 64), gen, torch.bfloat16)
    assert_bitwise_equal(compiled.mxfp8_quantize_dual(x), mxfp8.quantize_dual(x))


@pytest.mark.slow
@pytest.mark.parametrize("saturate", [False, True], ids=["inf", "saturate"])
def test_compiled_hif8_encode_equals_eager(saturate, np_rng):
    bits = np_rng.integers(-(2**31), 2**31, size=(1 << 16,), dtype=np.int64).astype(np.int32)
    x = torch.from_numpy(bits.view(np.float32)).clone()
    x[:4096] = x[:4096] * 2.0**-100  # denormal HiF8 band and underflow
    x[4096:8192] = torch.from_numpy(np_rng.standard_normal(4096).astype(np.float32)) * 2.0**16
    x[:16] = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, 2.0**-23, -(2.0**-23), 40960.0,
                           -40960.0, 1.0625, 15.5, 240.0, 2.0**-16 * 1.5, 1e-45, 32768.0, 40959.996])
    assert_bitwise_equal([hif8_encode_compiled(x, saturate)], [hif8.encode(x, saturate)])


@pytest.mark.slow
def test_compiled_hif8_quantize_and_current_scaling_equal_eager(gen):
    x = mixed_input((64, 128), gen, torch.bfloat16, specials=False)
    scale = hif8.current_scale(x.abs().amax(), 15.0)
    assert_bitwise_equal([compiled.hif8_quantize_with_scale(x, scale)], [hif8.quantize(x, scale)])
    codes, got_scale, _ = compiled.hif8_quantize(x, 15.0)
    assert torch.equal(got_scale, scale)
    # the kernel's formula (ops-nn dynamic_quant arch35 pertensor): amax * (1.0f / 15.0f), in FP32
    amax = np.float32(x.abs().amax().float().item())
    assert got_scale.item() == float(amax * (np.float32(1.0) / np.float32(15.0)))
    assert torch.equal(codes, hif8.quantize(x, scale))
    x3 = mixed_input((3, 32, 64), gen, torch.float32, specials=False)
    scales = hif8.current_scale(x3.abs().amax(dim=(1, 2)), 224.0)  # per-group [E] scale
    assert_bitwise_equal([compiled.hif8_quantize_with_scale(x3, scales)], [hif8.quantize(x3, scales)])


@pytest.mark.slow
def test_compiled_mxfp8_dual_column_aligned_special_blocks(gen):
    """Special blocks aligned to the column blocking (the split dual kernel computes row and
    column scales in a separate graph from the elementwise pass): zero, tiny, Inf/NaN blocks."""
    x = mixed_input((256, 256), gen, torch.float32, specials=False)
    x[64:96, 32:64] = 0.0  # all-zero row and column blocks
    x[128:160, :32] *= 2.0**-120  # tiny blocks: scale code 0, subnormal elements
    x[200, :32] *= 2.0**-130
    x[3, 5] = math.nan
    x[40, 77] = math.inf
    x[100, 200] = -math.inf
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-40, 448.0, 464.0, -480.0, 1.0625, -3e38])
    xb = x.to(torch.bfloat16)
    assert_bitwise_equal(compiled.mxfp8_quantize_dual(xb), mxfp8.quantize_dual(xb))


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton path of the compiled kernels: needs a CUDA device")
def test_cuda_compiled_kernels_equal_cpu_eager(gen):
    """On CUDA inductor emits Triton instead of C++: same graphs, same bits as the CPU reference."""
    x = mixed_input((256, 512), gen, dtype=torch.bfloat16)
    cuda_dual = compiled.mxfp8_quantize_dual(x.cuda())
    assert_bitwise_equal([t.cpu() for t in cuda_dual], mxfp8.quantize_dual(x))
    cuda_row = compiled.mxfp8_quantize(x.cuda(), -1)
    assert_bitwise_equal([t.cpu() for t in cuda_row], mxfp8.quantize(x, -1))
    scale = hif8.current_scale(x.float().abs().amax(), 15.0)
    codes = compiled.hif8_quantize_with_scale(x.cuda(), scale.cuda())
    assert torch.equal(codes.cpu(), hif8.quantize(x, scale))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_decodes_equal_eager(gen, dtype):
    x = mixed_input((96, 128), gen)
    for axis in (-1, -2):
        data, scale = mxfp8.quantize(x, axis=axis)
        want = mxfp8.dequantize(data, scale, axis=axis).to(dtype)
        got = compiled.mxfp8_decode(data, scale, axis, dtype=dtype)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        # the BF16 GEMM plan's raised scales (te_npu.ops.emulation.BF16_MXFP8_SCALE_SHIFT)
        raised = compiled.mxfp8_decode(data, scale, axis, dtype=dtype, scale_shift=3)
        torch.testing.assert_close(raised, (mxfp8.dequantize(data, scale, axis=axis) * 8).to(dtype),
                                   rtol=0, atol=0, equal_nan=True)
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    torch.testing.assert_close(compiled.hif8_decode(codes, dtype), hif8.decode(codes).to(dtype),
                               rtol=0, atol=0, equal_nan=True)


@pytest.mark.slow
@pytest.mark.parametrize("alg", ["floor", "ceil"])
def test_compiled_ragged_col_quantize_and_decode_equal_eager_without_recompiling(gen, alg):
    """Routing changes the block count every step; the static block bound keeps one graph."""
    from te_npu.ops.group_sizes import group_sizes_tensor

    x = mixed_input((81, 64), gen, dtype=torch.bfloat16)
    x[3, 5] = float("nan")
    splits = ([40, 0, 7, 33, 1], [1, 80, 0, 0, 0], [81, 0, 0, 0, 0], [0, 0, 0, 0, 81], [17, 16, 16, 16, 16])
    compiles_before = None
    for i, sizes in enumerate(splits):
        group_sizes = group_sizes_tensor(sizes)
        data, scale = compiled.mxfp8_quantize_grouped(x, group_sizes, scale_alg=alg)
        assert_bitwise_equal([data, scale], mxfp8.quantize_grouped(x, group_sizes, scale_alg=alg))
        for dtype, shift in ((torch.float32, 0), (torch.bfloat16, 3)):
            got = compiled.mxfp8_decode_grouped(data, scale, group_sizes, dtype, shift)
            row_to_block, _ = mxfp8.group_block_index(group_sizes)
            raised = (mxfp8.e8m0_to_float(scale) * 2.0**shift)[row_to_block]
            torch.testing.assert_close(got, (mxfp8.decode_e4m3(data) * raised).to(dtype), rtol=0, atol=0, equal_nan=True)
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if i == 0:
            compiles_before = frames
        else:
            assert frames == compiles_before, f"split {sizes} recompiled"
