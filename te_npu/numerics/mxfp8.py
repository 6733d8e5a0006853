"""MXFP8 (OCP Microscaling, E4M3 elements + E8M0 block scales) as pure tensor functions.

Shape legend: ``x: [..., D, ...]`` with ``D`` the blocked axis; ``scale`` has the same shape
with ``D // block_size`` along that axis. ``T``: rows (tokens) of a grouped operand, ``K``:
its columns, ``B``: number of ragged blocks.

Bit-exactness notes
-------------------
* Floor scale (OCP MX v1.0, ``scale_alg="floor"``): ``e = floor(log2(amax)) - 8`` read from the
  FP32 exponent field of ``amax``, clamped to [-127, 127]; code ``e + 127``. A subnormal FP32
  ``amax`` has ``floor(log2(amax)) <= -127``, so its ``e`` is always clamped to -127 (code 0),
  exactly like an all-zero block; reading the exponent field (0) gives that directly.
* Ceil scale (``scale_alg="ceil"``, torch_npu ``scale_alg=1``): the smallest power of two
  ``>= amax / 448``. ``amax / 448`` in FP32 is exact enough: a rounded quotient can only land on
  a power of two when the exact one does (448 = 7 * 2**6 and 7 has 3 significant bits).
* Elements are ``x * 2**-e``: the multiplier is built from bits and is a normal power of two
  for every reachable ``e`` (-127..120), so the product is exact (bar FP32/BF16 subnormal
  results, which are far below half the smallest E4M3 subnormal and round to zero either way).
  The product is clamped to +-448 and cast with round-to-nearest-even. PyTorch's cast is not
  relied on to saturate.
* A block with NaN or +-Inf gets scale code 0xFF and all its elements the NaN code 0x7F.
* BF16 input is scaled in BF16 (exact: BF16 has FP32's exponent range), any other dtype in FP32;
  the results are identical, BF16 just moves half the bytes.
"""
from functools import lru_cache

import torch

from te_npu.numerics.constants import (
    E4M3_EMAX,
    E4M3_MAX,
    E8M0_BIAS,
    E8M0_MAX_EXP,
    E4M3_NAN_CODE,
    E8M0_NAN,
    FP32_EXP_MASK,
    FP32_MANTISSA_BITS,
    FP32_NAN_BITS,
    MX_BLOCK_SIZE,
)
from te_npu.numerics.groups import host_group_sizes

_MANTISSA_MASK = (1 << FP32_MANTISSA_BITS) - 1
_SCALE_ALGS = ("floor", "ceil")


# ----------------------------------------------------------------------------- element codecs
def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even cast to ``float8_e4m3fn``; NaN stays NaN.

    ``x`` may be any float dtype; values beyond +-448 (including +-Inf) become +-448.
    """
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


@lru_cache(maxsize=None)
def _e8m0_table(device: torch.device) -> torch.Tensor:
    """[256] float32: E8M0 code -> 2**(code - 127); 0xFF -> NaN."""
    codes = torch.arange(256, dtype=torch.int32, device=device)
    return _e8m0_bits_to_float(codes)


def _e8m0_bits_to_float(codes_i32: torch.Tensor) -> torch.Tensor:
    # code c in 1..254 is the normal float 2**(c-127): exponent field c. Code 0 is 2**-127,
    # the float32 subnormal with only mantissa bit 22 set. 0xFF is NaN.
    bits = torch.where(codes_i32 == 0, 1 << (FP32_MANTISSA_BITS - 1), codes_i32 << FP32_MANTISSA_BITS)
    bits = torch.where(codes_i32 == E8M0_NAN, FP32_NAN_BITS, bits)
    return bits.view(torch.float32)


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8) -> float32 ``2**(code - 127)``; code 0xFF -> NaN. Exact."""
    return _e8m0_bits_to_float(codes.to(torch.int32))


def decode_e4m3(data: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn`` (or its uint8 bit view) -> float32. Exact.

    Uses PyTorch's widening cast, which is exact for every code. A 256-entry lookup table was
    measured slower on CPU (index tensors must be int64), see ``scripts/bench_quant.py``.
    """
    if data.dtype == torch.uint8:
        data = data.view(torch.float8_e4m3fn)
    return data.to(torch.float32)


# ----------------------------------------------------------------------------- scales
def _check(x: torch.Tensor, axis: int, block_size: int, scale_alg: str) -> int:
    if scale_alg not in _SCALE_ALGS:
        raise ValueError(f"scale_alg must be one of {_SCALE_ALGS}, got {scale_alg!r}")
    if not x.is_floating_point():
        raise TypeError(f"MXFP8 quantization needs a float tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("MXFP8 quantization needs a tensor with at least one dim, got a scalar")
    axis = axis % x.dim()
    if block_size <= 0 or x.shape[axis] % block_size != 0:
        raise ValueError(
            f"MXFP8: size {x.shape[axis]} of dim {axis} of shape {tuple(x.shape)} is not a "
            f"multiple of block_size={block_size}"
        )
    return axis


def _exponent_field(x32: torch.Tensor) -> torch.Tensor:
    """FP32 exponent field of ``x32 >= 0`` (or NaN), as exact float32 integers 0..255.

    Read from the two high bytes (little-endian) and combined in float arithmetic: PyTorch's
    CPU int32 elementwise kernels measured ~10-100x slower than float ones on the scale tensor.
    """
    as_bytes = x32.contiguous().view(torch.uint8)
    high = as_bytes[..., 3::4].to(torch.float32)  # sign | exponent[7:1]
    low = as_bytes[..., 2::4].to(torch.float32)  # exponent[0] | mantissa[22:16]
    return torch.remainder(high, 128.0).mul_(2.0).add_(low >= 128.0)


def scale_codes_from_amax(amax: torch.Tensor, scale_alg: str = "floor") -> torch.Tensor:
    """Block amax (any float dtype, >= 0 or NaN) -> E8M0 codes (uint8), from FP32 bits."""
    amax32 = amax.to(torch.float32)
    exp_field = _exponent_field(amax32)
    if scale_alg == "floor":
        # code = floor(log2 amax) - 8 + 127 = exp_field - 8; subnormal/zero amax -> clamped to 0.
        codes = (exp_field - E4M3_EMAX).clamp_(min=0)
    else:
        quotient = amax32 / E4M3_MAX
        q_exp = _exponent_field(quotient)
        # ceil(log2 q) = q_exp - 127 + (q > 2**(q_exp - 127)). For subnormal q (q_exp == 0) the
        # table gives 2**-127, so code 1 exactly when q > 2**-127, else 0.
        truncated = _e8m0_table(amax.device)[q_exp.to(torch.int64)]
        codes = q_exp.add_(quotient > truncated).clamp_(max=E8M0_MAX_EXP + E8M0_BIAS)
    codes = torch.where(exp_field == FP32_EXP_MASK, float(E8M0_NAN), codes)  # NaN or Inf in block
    return codes.to(torch.uint8)


@lru_cache(maxsize=None)
def _inverse_scale_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256] ``dtype``: E8M0 code -> 2**-(code - 127) (exact for reachable codes); 0xFF -> NaN."""
    c = torch.arange(256, dtype=torch.int32)
    # 2**-(c - 127) has exponent field 254 - c; code 0 would need 2**127 as well (field 254).
    bits = torch.where(c == E8M0_NAN, FP32_NAN_BITS, (2 * E8M0_BIAS - c).clamp(min=1) << FP32_MANTISSA_BITS)
    return bits.view(torch.float32).to(dtype).to(device)


def _inverse_scale(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E8M0 codes -> 2**-e in ``dtype`` (a normal power of two for every reachable code)."""
    return _inverse_scale_table(codes.device, dtype)[codes.to(torch.int64)]


def _compute_dtype(x: torch.Tensor) -> torch.Tensor:
    # BF16 keeps FP32's exponent range, so x * 2**-e is exact in BF16; FP16 is widened.
    return x if x.dtype in (torch.bfloat16, torch.float32) else x.to(torch.float32)


def _quantize_blocked(xc: torch.Tensor, axis: int, block_size: int, scale_alg: str):
    """xc: compute-dtype tensor, ``axis`` non-negative and already validated."""
    shape = tuple(xc.shape)
    blocked = shape[:axis] + (shape[axis] // block_size, block_size) + shape[axis + 1:]
    xb = xc.reshape(blocked)  # a view for contiguous (and most strided) inputs
    amax = xb.abs().amax(dim=axis + 1, keepdim=True)
    codes = scale_codes_from_amax(amax, scale_alg)
    y = xb * _inverse_scale(codes, xc.dtype)
    data = y.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    # canonical NaN 0x7F in NaN blocks (the NaN sign would otherwise depend on dtype / path);
    # unconditional, so no host read of "any NaN block?"
    data = torch.where(codes == E8M0_NAN, E4M3_NAN_CODE, data.view(torch.uint8)).to(torch.uint8).view(torch.float8_e4m3fn)
    return data.reshape(shape), codes.squeeze(axis + 1)


# ----------------------------------------------------------------------------- public API
def quantize(x: torch.Tensor, axis: int = -1, block_size: int = MX_BLOCK_SIZE, scale_alg: str = "floor"):
    """MXFP8-quantize ``x`` in blocks of ``block_size`` consecutive elements along ``axis``.

    Args:
        x: ``[..., D, ...]`` bf16/fp16/fp32 tensor, ``D % block_size == 0``.
        axis: the blocked dim (negative allowed).
        scale_alg: ``"floor"`` (OCP MX) or ``"ceil"`` (smallest power of two >= amax/448).
    Returns:
        ``data``: ``float8_e4m3fn`` with ``x``'s shape; ``scale``: uint8 E8M0 codes shaped like
        ``x`` with ``D // block_size`` along ``axis``.
    Raises:
        ValueError: ``D`` is not a multiple of ``block_size`` (message names the shape).
    """
    axis = _check(x, axis, block_size, scale_alg)
    return _quantize_blocked(_compute_dtype(x), axis, block_size, scale_alg)


def dequantize(data: torch.Tensor, scale: torch.Tensor, axis: int = -1, block_size: int = MX_BLOCK_SIZE):
    """Inverse of :func:`quantize`: ``decode_e4m3(data) * 2**(scale - 127)`` as float32 (exact)."""
    axis = axis % data.dim()
    shape = tuple(data.shape)
    if scale.shape[axis] * block_size != shape[axis]:
        raise ValueError(f"MXFP8: scale shape {tuple(scale.shape)} does not match data shape {shape} "
                         f"with block_size={block_size} along dim {axis}")
    blocked = shape[:axis] + (shape[axis] // block_size, block_size) + shape[axis + 1:]
    values = decode_e4m3(data).reshape(blocked)
    values *= e8m0_to_float(scale).unsqueeze(axis + 1)
    return values.reshape(shape)


def quantize_dual(x: torch.Tensor, block_size: int = MX_BLOCK_SIZE, scale_alg: str = "floor"):
    """Row- and column-blocked MXFP8 copies of a weight ``x: [..., N, K]``.

    Both copies come from the high-precision ``x``: quantizing the column copy from the row
    copy would round twice and break bit-equality with ``quantize(x, axis=-2)``.

    Returns:
        ``(row_data [..., N, K], row_scale [..., N, K // bs], col_data [..., N, K],
        col_scale [..., N // bs, K])``, identical to ``quantize(x, -1)`` and ``quantize(x, -2)``.
    """
    if x.dim() < 2:
        raise ValueError(f"quantize_dual needs a [..., N, K] tensor, got shape {tuple(x.shape)}")
    row_axis = _check(x, -1, block_size, scale_alg)
    col_axis = _check(x, -2, block_size, scale_alg)
    xc = _compute_dtype(x)  # widened once, shared by both orientations
    row_data, row_scale = _quantize_blocked(xc, row_axis, block_size, scale_alg)
    col_data, col_scale = _quantize_blocked(xc, col_axis, block_size, scale_alg)
    return row_data, row_scale, col_data, col_scale


# ----------------------------------------------------------------------------- ragged blocks
def ragged_block_count(group_sizes: torch.Tensor, block_size: int = MX_BLOCK_SIZE) -> int:
    """Blocks of a ragged col operand, ``sum(ceil(T_g / bs))``, from the sizes' host mirror."""
    return sum(-(-s // block_size) for s in host_group_sizes(group_sizes))


def _group_layout(group_sizes: torch.Tensor, num_rows: int, block_size: int):
    """Per row: (block index, row in the zero-padded layout); plus the number of blocks.

    Groups are padded to multiples of ``block_size``; padded row = block * bs + offset in block.
    """
    sizes = host_group_sizes(group_sizes)  # the host mirror, if any: no sync
    num_blocks = ragged_block_count(group_sizes, block_size)
    if sum(sizes) != num_rows:
        raise ValueError(f"group_sizes sum to {sum(sizes)}, operand has {num_rows} rows")
    group_sizes = group_sizes.to(torch.int64)
    blocks_per_group = (group_sizes + block_size - 1) // block_size  # [G]
    first_row = torch.cumsum(group_sizes, 0) - group_sizes  # [G] first row of each group
    first_block = torch.cumsum(blocks_per_group, 0) - blocks_per_group  # [G]
    group_ids = torch.arange(group_sizes.numel(), device=group_sizes.device)
    row_group = torch.repeat_interleave(group_ids, group_sizes, output_size=num_rows)  # [T]
    row_in_group = torch.arange(num_rows, device=group_sizes.device) - first_row[row_group]
    row_to_block = first_block[row_group] + row_in_group // block_size
    padded_row = row_to_block * block_size + row_in_group % block_size
    return row_to_block, padded_row, num_blocks


def group_block_index(group_sizes: torch.Tensor, block_size: int = MX_BLOCK_SIZE):
    """Ragged blocks along dim 0: blocks of ``block_size`` rows restart at each group start.

    Args:
        group_sizes: ``[G]`` int64 rows per group (zeros allowed).
    Returns:
        ``(row_to_block [T] int64, num_blocks)`` with ``num_blocks = sum(ceil(g / bs))``.
    """
    num_rows = sum(host_group_sizes(group_sizes))
    row_to_block, _, num_blocks = _group_layout(group_sizes, num_rows, block_size)
    return row_to_block, num_blocks


def quantize_grouped(x: torch.Tensor, group_sizes: torch.Tensor, block_size: int = MX_BLOCK_SIZE,
                     scale_alg: str = "floor", *, padded_col_quantize=None):
    """MXFP8 along dim 0 of ``x: [T, K]`` with ragged blocks (see :func:`group_block_index`).

    Each group is zero-padded to a multiple of ``block_size`` (zeros leave a block's amax
    unchanged), quantized with :func:`quantize` along dim 0 and gathered back, so a group's
    short last block is scaled by its own rows only. ``padded_col_quantize`` optionally
    replaces that middle step with a bit-identical kernel: ``[B * bs, K] -> (data, scale [B, K])``.

    Returns:
        ``data [T, K]`` float8_e4m3fn, ``scale [B, K]`` uint8 E8M0 codes.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_grouped needs a [T, K] tensor, got shape {tuple(x.shape)}")
    _check(x, -1, 1, scale_alg)
    _, padded_row, num_blocks = _group_layout(group_sizes, x.shape[0], block_size)
    xc = _compute_dtype(x)
    x_padded = xc.new_zeros((num_blocks * block_size, x.shape[1]))  # [B * bs, K]
    x_padded.index_copy_(0, padded_row, xc)
    if padded_col_quantize is None:
        data_padded, scale = _quantize_blocked(x_padded, 0, block_size, scale_alg)
    else:
        data_padded, scale = padded_col_quantize(x_padded)
    data = data_padded.view(torch.uint8).index_select(0, padded_row).view(torch.float8_e4m3fn)
    return data, scale


def dequantize_grouped(data: torch.Tensor, scale: torch.Tensor, group_sizes: torch.Tensor,
                       block_size: int = MX_BLOCK_SIZE):
    """Inverse of :func:`quantize_grouped`: ``data [T, K]``, ``scale [B, K]`` -> float32 ``[T, K]``."""
    row_to_block, num_blocks = group_block_index(group_sizes, block_size)
    if scale.shape[0] != num_blocks or data.shape[0] != row_to_block.numel():
        raise ValueError(f"grouped MXFP8: data {tuple(data.shape)} / scale {tuple(scale.shape)} do not "
                         f"match group_sizes with {num_blocks} blocks")
    return decode_e4m3(data) * e8m0_to_float(scale).index_select(0, row_to_block)
