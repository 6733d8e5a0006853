"""The default MXFP8 scale rule (round-up, ``scale_alg="ceil"``) against references that share no
code with te_npu: every finite bf16 value as a block amax, and every finite bf16 value under every
reachable block scale, in codes and E4M3 data.

References:
- hand-derived math in numpy: the scale is the least power of two ``2**e >= amax / 448``, read
  from float64 (``amax / 448`` of an exact bf16 is exact in float64, so ``ceil(log2)`` is exact);
  elements ``x * 2**-e`` clipped to +-448 and cast by ``ml_dtypes`` (RNE);
- torchao's ``to_mx(..., scaling_mode=ScaleCalculationMode.RCEIL)`` (the rule Transformer Engine
  and the A5 training stacks use), compared bit for bit: every scale, and the data of every block
  but those of scale code 0, where torchao multiplies by 1.0 instead of 2**127 (asserted below).
"""
import numpy as np
import pytest
import torch

from te_npu.numerics import mxfp8

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is the E4M3 reference")


def _finite_bf16() -> torch.Tensor:
    """All 65280 finite bf16 values (both signs, zeros and subnormals)."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return bits[torch.isfinite(bits)]


def _ceil_codes(amax: np.ndarray) -> np.ndarray:
    """E8M0 codes of float64 block amaxes (finite, >= 0): least e with 2**e >= amax / 448, clamped
    to [-127, 127]; a zero block has code 0 (e = -127)."""
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(amax / 448.0))
    e = np.where(amax == 0, -127, e)
    return (np.clip(e, -127, 127) + 127).astype(np.uint8)


def _reference(blocks: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(E4M3 codes [R, 32] uint8, E8M0 codes [R] uint8) of finite bf16 rows of 32."""
    x = blocks.float().numpy().astype(np.float64)
    codes = _ceil_codes(np.abs(x).max(axis=-1))
    scaled = np.clip(np.ldexp(x, -(codes.astype(np.int64) - 127)[:, None]), -448.0, 448.0)
    return scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), codes


def _blocks_under_scale(values: torch.Tensor, e: int) -> torch.Tensor:
    """Rows of 32 whose block scale is exactly 2**e under the ceil rule: a leading 448 * 2**e (an
    exact bf16 for e in -127..119, 448 = 1.75 * 2**8), then every value of ``values`` with
    |v| <= 448 * 2**e (everything a block of that scale can hold)."""
    top = 448.0 * 2.0 ** e
    lead = torch.tensor(top, dtype=torch.float32).to(torch.bfloat16)
    assert float(lead) == top
    kept = values[values.float().abs() <= top]
    kept = torch.cat([kept, kept.new_zeros((-kept.numel()) % 31)]).reshape(-1, 31)
    return torch.cat([lead.expand(kept.shape[0], 1), kept], dim=1)


@pytest.fixture(scope="module")
def sweep() -> torch.Tensor:
    """Every finite bf16 value under every ceil block scale 2**-127 .. 2**119 (the largest whose
    amax 448 * 2**e is a finite bf16): [R, 32] bf16, R > 250,000."""
    values = _finite_bf16()
    return torch.cat([_blocks_under_scale(values, e) for e in range(-127, 120)])


def test_mxfp8_ceil_code_of_every_finite_bf16_amax_versus_hand_derived_reference():
    amax = _finite_bf16().abs()
    blocks = torch.cat([amax[:, None], torch.zeros(amax.numel(), 31, dtype=torch.bfloat16)], dim=1)
    _, scale = mxfp8.quantize(blocks, scale_alg="ceil")
    assert np.array_equal(scale[:, 0].numpy(), _ceil_codes(amax.float().numpy().astype(np.float64)))


def test_mxfp8_ceil_every_finite_bf16_value_under_every_block_scale_versus_hand_derived_reference(sweep):
    data, scale = mxfp8.quantize(sweep, scale_alg="ceil")
    ref_data, ref_codes = _reference(sweep)
    assert sweep.shape[0] > 250_000
    assert np.array_equal(scale[:, 0].numpy(), ref_codes)
    assert np.array_equal(np.unique(ref_codes), np.arange(0, 247, dtype=np.uint8))  # every scale 2**-127..2**119
    mismatch = np.argwhere(data.view(torch.uint8).numpy() != ref_data)
    assert mismatch.size == 0, f"{len(mismatch)} E4M3 codes differ, first at {mismatch[0].tolist()}"


def test_mxfp8_default_scale_rule_is_the_ceil_rule_bitwise(sweep):
    data, scale = mxfp8.quantize(sweep)
    ceil_data, ceil_scale = mxfp8.quantize(sweep, scale_alg="ceil")
    assert torch.equal(scale, ceil_scale) and torch.equal(data.view(torch.uint8), ceil_data.view(torch.uint8))


def test_mxfp8_default_quantization_equals_torchao_rceil_bitwise(sweep):
    """Scales equal everywhere; data equal in every block with a scale code > 0. A block with code 0
    (amax <= 448 * 2**-127) is the one documented difference: torchao (after TE's ``exp2f_rcp``)
    scales its elements by 1.0, te_npu (as the Ascend kernels, ``tests/fakes/mx_block.py``) by
    2**127, the exact reciprocal of its scale 2**-127."""
    pytest.importorskip("torchao", reason="torchao (the test extra) is the RCEIL reference")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    rng = torch.Generator().manual_seed(0)
    signs = torch.where(torch.rand(sweep.shape, generator=rng) < 0.5, -1.0, 1.0).to(torch.bfloat16)
    for x in (sweep, sweep * signs, sweep.float()):
        ao_scale, ao_data = to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)
        data, scale = mxfp8.quantize(x)  # the default rule
        ao_data = ao_data.view(torch.uint8).reshape(data.shape)
        assert torch.equal(scale, ao_scale.view(torch.uint8).reshape(scale.shape))
        normal = scale[:, 0] > 0
        assert torch.equal(data.view(torch.uint8)[normal], ao_data[normal])
        tiny = x[~normal].float()
        assert tiny.shape[0] > 0
        assert torch.equal(ao_data[~normal], mxfp8.encode_e4m3(tiny).view(torch.uint8))  # x * 1.0
        assert torch.equal(data.view(torch.uint8)[~normal], mxfp8.encode_e4m3(tiny * 2.0**127).view(torch.uint8))
