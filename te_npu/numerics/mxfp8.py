"""MXFP8 (OCP Microscaling, E4M3 elements + E8M0 block scales) as pure tensor functions.

Shape legend: ``x: [..., D, ...]`` with ``D`` the blocked axis; ``scale`` has the same shape
with ``D // block_size`` along that axis. ``T``: rows (tokens) of a grouped operand, ``K``:
its columns, ``B``: number of ragged blocks.

Bit-exactness notes
-------------------
* Ceil scale (``scale_alg="ceil"``, the default; torch_npu ``scale_alg=1``) and floor scale
  (``"floor"``, opt-in) are both below; ``te_npu.numerics.constants.MX_SCALE_ALGS`` says why
  ceil is the default (no element of a block is clipped).
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
* Every function is written once for both eager torch and ``torch.compile`` (the compiled
  kernels of ``te_npu.ops.kernels`` compile these very functions): exponents and powers of two
  come from FP32 bits (no lookup tables), no Python branch reads tensor data, and ragged layouts
  take their group sizes as host ints (``host_sizes``), so nothing here reads a device value.
"""
from collections.abc import Sequence

import torch

from te_npu.numerics.constants import (
    E4M3_EMAX,
    E4M3_MAX,
    E8M0_BIAS,
    E8M0_MAX_EXP,
    E8M0_NAN,
    FP32_EXP_MASK,
    FP32_MANTISSA_BITS,
    FP32_NAN_BITS,
    MX_BLOCK_SIZE,
    MX_DEFAULT_SCALE_ALG,
    MX_SCALE_ALGS,
)

__all__ = [
    "check_blocked",
    "decode_e4m3",
    "decode_e4m3_as",
    "dequantize",
    "dequantize_grouped",
    "dequantize_ragged",
    "dual_block_scales",
    "e8m0_to_float",
    "encode_e4m3",
    "gather_ragged",
    "group_block_index",
    "pad_ragged",
    "quantize",
    "quantize_dual",
    "quantize_grouped",
    "quantize_ragged",
    "quantize_with_dual_scales",
    "ragged_block_count",
    "ragged_layout",
    "scale_codes_from_amax",
]

_SCALE_ALGS = MX_SCALE_ALGS
_SUBNORMAL_2_POW_M127 = 1 << (FP32_MANTISSA_BITS - 1)  # float32 bits of 2**-127 (the subnormal with bit 22 set)


# ----------------------------------------------------------------------------- FP32 bits
def _exponent_field(x32: torch.Tensor) -> torch.Tensor:
    """FP32 exponent field (int32 0..255) of ``x32`` (sign ignored; 255 for Inf / NaN)."""
    return (x32.view(torch.int32) >> FP32_MANTISSA_BITS) & FP32_EXP_MASK


def _power_of_two(field: torch.Tensor) -> torch.Tensor:
    """int32 exponent fields 0..254 -> float32 ``2**(field - 127)`` from bits (field 0: the
    subnormal 2**-127)."""
    return torch.where(field == 0, _SUBNORMAL_2_POW_M127, field << FP32_MANTISSA_BITS).view(torch.float32)


# ----------------------------------------------------------------------------- element codecs
def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even cast to ``float8_e4m3fn``; NaN stays NaN.

    ``x`` may be any float dtype; values beyond +-448 (including +-Inf) become +-448.
    """
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8) -> float32 ``2**(code - 127)``; code 0xFF -> NaN. Exact."""
    # code c in 1..254 is the normal float 2**(c-127): exponent field c. Code 0 is 2**-127,
    # the float32 subnormal with only mantissa bit 22 set. 0xFF is NaN.
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, _SUBNORMAL_2_POW_M127, c << FP32_MANTISSA_BITS)
    return torch.where(c == E8M0_NAN, FP32_NAN_BITS, bits).view(torch.float32)


def decode_e4m3(data: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn`` (or its uint8 bit view) -> float32. Exact.

    Uses PyTorch's widening cast, which is exact for every code. A 256-entry lookup table was
    measured slower on CPU (index tensors must be int64), see ``scripts/bench_quant.py``.
    """
    return decode_e4m3_as(data, torch.float32)


def decode_e4m3_as(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``float8_e4m3fn`` (or uint8) codes cast straight to ``dtype`` (exact in bf16 / fp16 / fp32)."""
    if data.dtype == torch.uint8:
        data = data.view(torch.float8_e4m3fn)
    return data.to(dtype)


# ----------------------------------------------------------------------------- scales
def check_blocked(x: torch.Tensor, axis: int, block_size: int, scale_alg: str) -> int:
    """Validate a blocked quantization of ``x`` along ``axis``; returns the non-negative axis.

    Raises ``ValueError`` (unknown ``scale_alg``, a scalar, a dim not a multiple of
    ``block_size``, naming the shape) or ``TypeError`` (not a float tensor)."""
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


def scale_codes_from_amax(amax: torch.Tensor, scale_alg: str = MX_DEFAULT_SCALE_ALG) -> torch.Tensor:
    """Block amax (any float dtype, >= 0 or NaN) -> E8M0 codes (uint8), from FP32 bits."""
    amax32 = amax.to(torch.float32)
    exp_field = _exponent_field(amax32)
    if scale_alg == "floor":
        # code = floor(log2 amax) - 8 + 127 = exp_field - 8; subnormal/zero amax -> clamped to 0.
        codes = (exp_field - E4M3_EMAX).clamp(min=0)
    else:
        quotient = amax32 / E4M3_MAX
        q_exp = _exponent_field(quotient)
        # ceil(log2 q) = q_exp - 127 + (q > 2**(q_exp - 127)). For subnormal q (q_exp == 0) that
        # power is 2**-127, so code 1 exactly when q > 2**-127, else 0. q_exp == 255 only for a
        # non-finite amax, which the NaN code below overrides.
        truncated = _power_of_two(q_exp)
        codes = (q_exp + (quotient > truncated).to(torch.int32)).clamp(max=E8M0_MAX_EXP + E8M0_BIAS)
    codes = torch.where(exp_field == FP32_EXP_MASK, E8M0_NAN, codes)  # NaN or Inf in block
    return codes.to(torch.uint8)


def _inverse_scale(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E8M0 codes -> ``2**-e`` in ``dtype``, from bits (a normal power of two for every reachable
    code; code 0 gives 2**127, as 2**-e would need 2**127 as well); 0xFF -> NaN."""
    c = codes.to(torch.int32)
    bits = (2 * E8M0_BIAS - c).clamp(min=1) << FP32_MANTISSA_BITS
    return torch.where(c == E8M0_NAN, FP32_NAN_BITS, bits).view(torch.float32).to(dtype)


def _compute_dtype(x: torch.Tensor) -> torch.Tensor:
    # BF16 keeps FP32's exponent range, so x * 2**-e is exact in BF16; FP16 is widened.
    return x if x.dtype in (torch.bfloat16, torch.float32) else x.to(torch.float32)


def _encode_scaled(xb: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of ``xb * inverse`` (``inverse`` broadcast over each block), saturated to
    +-448; blocks whose inverse scale is NaN (scale code 0xFF) get the canonical NaN 0x7F in
    every element (a positive NaN casts to 0x7F; the NaN sign would otherwise depend on the
    dtype / path). No host read of "any NaN block?"."""
    y = (xb * inverse).clamp_(-E4M3_MAX, E4M3_MAX)
    return torch.where(inverse.isnan(), float("nan"), y).to(torch.float8_e4m3fn)


def _quantize_blocked(xc: torch.Tensor, axis: int, block_size: int, scale_alg: str):
    """xc: compute-dtype tensor, ``axis`` non-negative and already validated."""
    shape = tuple(xc.shape)
    blocked = shape[:axis] + (shape[axis] // block_size, block_size) + shape[axis + 1:]
    xb = xc.reshape(blocked)  # a view for contiguous (and most strided) inputs
    codes = scale_codes_from_amax(xb.abs().amax(dim=axis + 1, keepdim=True), scale_alg)
    data = _encode_scaled(xb, _inverse_scale(codes, xc.dtype))
    return data.reshape(shape), codes.squeeze(axis + 1)


# ----------------------------------------------------------------------------- public API
def quantize(x: torch.Tensor, axis: int = -1, block_size: int = MX_BLOCK_SIZE, scale_alg: str = MX_DEFAULT_SCALE_ALG):
    """MXFP8-quantize ``x`` in blocks of ``block_size`` consecutive elements along ``axis``.

    Args:
        x: ``[..., D, ...]`` bf16/fp16/fp32 tensor, ``D % block_size == 0``.
        axis: the blocked dim (negative allowed).
        scale_alg: ``"ceil"`` (default: smallest power of two >= amax/448) or ``"floor"`` (OCP MX).
    Returns:
        ``data``: ``float8_e4m3fn`` with ``x``'s shape; ``scale``: uint8 E8M0 codes shaped like
        ``x`` with ``D // block_size`` along ``axis``.
    Raises:
        ValueError: ``D`` is not a multiple of ``block_size`` (message names the shape).
    """
    axis = check_blocked(x, axis, block_size, scale_alg)
    return _quantize_blocked(_compute_dtype(x), axis, block_size, scale_alg)


def _block_expand(scale: torch.Tensor, values: torch.Tensor, axis: int, block_size: int) -> torch.Tensor:
    """``values * scale`` with each scale entry covering ``block_size`` consecutive elements
    along ``axis`` (a last block may be short: ``scale.shape[axis] == ceil(n / block_size)``)."""
    n = values.shape[axis]
    if n % block_size == 0:
        shape = tuple(values.shape)
        blocked = shape[:axis] + (n // block_size, block_size) + shape[axis + 1:]
        return (values.reshape(blocked) * scale.unsqueeze(axis + 1)).reshape(shape)
    expanded = scale.repeat_interleave(block_size, dim=axis).narrow(axis, 0, n)
    return values * expanded


def dequantize(data: torch.Tensor, scale: torch.Tensor, axis: int = -1, block_size: int = MX_BLOCK_SIZE, *,
               dtype: torch.dtype = torch.float32, scale_shift: int = 0) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``decode_e4m3(data) * (2**(scale - 127) * 2**scale_shift)``.

    Args:
        data: ``float8_e4m3fn`` (or uint8) ``[..., D, ...]``; ``scale``: uint8 E8M0 codes with
            ``ceil(D / block_size)`` along ``axis``.
        dtype: result dtype; the values and the (raised) scales are cast to it first and
            multiplied in it: exact whenever the products are representable (always in float32;
            in bfloat16 see ``te_npu.ops.emulation``'s BF16 plan).
        scale_shift: raise every block scale by ``2**scale_shift`` first (exact).
    """
    axis = axis % data.dim()
    if scale.shape[axis] != -(-data.shape[axis] // block_size):
        raise ValueError(f"MXFP8: scale shape {tuple(scale.shape)} does not match data shape {tuple(data.shape)} "
                         f"with block_size={block_size} along dim {axis}")
    block_scale = e8m0_to_float(scale)
    if scale_shift:
        block_scale = block_scale * float(2**scale_shift)
    return _block_expand(block_scale.to(dtype), decode_e4m3_as(data, dtype), axis, block_size)


def dual_block_scales(x: torch.Tensor, block_size: int = MX_BLOCK_SIZE, scale_alg: str = MX_DEFAULT_SCALE_ALG):
    """First half of :func:`quantize_dual`: the row and col block scales of ``x: [..., N, K]``.

    Returns ``(row_scale [..., N, K/bs], row_inverse, col_scale [..., N/bs, K], col_inverse)``:
    uint8 E8M0 codes and the inverse scales ``2**-e`` (x's compute dtype, NaN for code 0xFF)
    that :func:`quantize_with_dual_scales` multiplies by. Shapes must already be checked."""
    xc = _compute_dtype(x)
    *lead, n, k = xc.shape
    row_codes = scale_codes_from_amax(xc.reshape(*lead, n, k // block_size, block_size).abs().amax(dim=-1), scale_alg)
    col_codes = scale_codes_from_amax(xc.reshape(*lead, n // block_size, block_size, k).abs().amax(dim=-2), scale_alg)
    return (row_codes, _inverse_scale(row_codes, xc.dtype), col_codes, _inverse_scale(col_codes, xc.dtype))


def quantize_with_dual_scales(x: torch.Tensor, row_inverse: torch.Tensor, col_inverse: torch.Tensor,
                              block_size: int = MX_BLOCK_SIZE):
    """Second half of :func:`quantize_dual`: ``(row_data, col_data)``, both ``float8_e4m3fn``
    ``[..., N, K]``, from the inverse scales of :func:`dual_block_scales` (one elementwise pass)."""
    xc = _compute_dtype(x)
    shape = tuple(xc.shape)
    *lead, n, k = shape
    row_data = _encode_scaled(xc.reshape(*lead, n, k // block_size, block_size), row_inverse.unsqueeze(-1))
    col_data = _encode_scaled(xc.reshape(*lead, n // block_size, block_size, k), col_inverse.unsqueeze(-2))
    return row_data.reshape(shape), col_data.reshape(shape)


def quantize_dual(x: torch.Tensor, block_size: int = MX_BLOCK_SIZE, scale_alg: str = MX_DEFAULT_SCALE_ALG):
    """Row- and column-blocked MXFP8 copies of a weight ``x: [..., N, K]``.

    Both copies come from the high-precision ``x``: quantizing the column copy from the row
    copy would round twice and break bit-equality with ``quantize(x, axis=-2)``. Two stages
    (:func:`dual_block_scales`, then :func:`quantize_with_dual_scales`), so a compiled kernel
    materializes each block scale once instead of recomputing it per element.

    Returns:
        ``(row_data [..., N, K], row_scale [..., N, K // bs], col_data [..., N, K],
        col_scale [..., N // bs, K])``, identical to ``quantize(x, -1)`` and ``quantize(x, -2)``.
    """
    if x.dim() < 2:
        raise ValueError(f"quantize_dual needs a [..., N, K] tensor, got shape {tuple(x.shape)}")
    check_blocked(x, -1, block_size, scale_alg)
    check_blocked(x, -2, block_size, scale_alg)
    row_scale, row_inverse, col_scale, col_inverse = dual_block_scales(x, block_size, scale_alg)
    row_data, col_data = quantize_with_dual_scales(x, row_inverse, col_inverse, block_size)
    return row_data, row_scale, col_data, col_scale


# ----------------------------------------------------------------------------- ragged blocks
def _host_sizes(group_sizes: torch.Tensor, host_sizes: Sequence[int] | None) -> tuple[int, ...]:
    """The group sizes as Python ints: ``host_sizes`` when the caller has them (no device read),
    else the tensor's values (one host read on an accelerator)."""
    return tuple(int(s) for s in (group_sizes.tolist() if host_sizes is None else host_sizes))


def ragged_block_count(host_sizes: Sequence[int], block_size: int = MX_BLOCK_SIZE) -> int:
    """Blocks of a ragged col operand, ``sum(ceil(T_g / bs))``, from host group sizes."""
    return sum(-(-int(s) // block_size) for s in host_sizes)


def ragged_layout(group_sizes: torch.Tensor, host_sizes: Sequence[int], num_rows: int,
                  block_size: int = MX_BLOCK_SIZE):
    """Per row: (block index, row in the zero-padded layout); plus the number of blocks.

    Args:
        group_sizes: int64 ``[G]`` rows per group, on the operand's device (index math runs there).
        host_sizes: the same sizes as Python ints (shapes and the row-count check).
    Returns:
        ``(row_to_block [T] int64, padded_row [T] int64, num_blocks)``: groups are padded to
        multiples of ``block_size``; padded row = block * bs + offset in block.
    """
    if sum(host_sizes) != num_rows:
        raise ValueError(f"group_sizes sum to {sum(host_sizes)}, operand has {num_rows} rows")
    num_blocks = ragged_block_count(host_sizes, block_size)
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


def group_block_index(group_sizes: torch.Tensor, block_size: int = MX_BLOCK_SIZE, *,
                      host_sizes: Sequence[int] | None = None):
    """Ragged blocks along dim 0: blocks of ``block_size`` rows restart at each group start.

    Args:
        group_sizes: ``[G]`` int64 rows per group (zeros allowed); ``host_sizes`` the same as
            Python ints if the caller has them (else read from the tensor).
    Returns:
        ``(row_to_block [T] int64, num_blocks)`` with ``num_blocks = sum(ceil(g / bs))``.
    """
    sizes = _host_sizes(group_sizes, host_sizes)
    row_to_block, _, num_blocks = ragged_layout(group_sizes, sizes, sum(sizes), block_size)
    return row_to_block, num_blocks


def pad_ragged(x: torch.Tensor, padded_row: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Rows of ``x [T, K]`` scattered to ``padded_row`` of a zero ``[padded_rows, K]`` buffer in x's
    compute dtype (zeros leave every block's amax unchanged)."""
    xc = _compute_dtype(x)
    return xc.new_zeros((padded_rows, x.shape[1])).index_copy(0, padded_row, xc)


def gather_ragged(data_padded: torch.Tensor, padded_row: torch.Tensor) -> torch.Tensor:
    """The ``float8_e4m3fn`` rows of the real tokens back out of the padded layout: ``[T, K]``."""
    return data_padded.view(torch.uint8).index_select(0, padded_row).view(torch.float8_e4m3fn)


def quantize_ragged(x: torch.Tensor, padded_row: torch.Tensor, padded_rows: int, block_size: int = MX_BLOCK_SIZE,
                    scale_alg: str = MX_DEFAULT_SCALE_ALG):
    """Ragged col quantization on a given padded layout (:func:`ragged_layout`): pad, block along
    dim 0, gather. ``padded_rows`` may exceed the layout's ``num_blocks * bs`` (a static bound):
    the extra blocks are all-zero padding with scale code 0.

    Returns ``data [T, K]`` float8_e4m3fn and ``scale [padded_rows / bs, K]`` uint8."""
    data_padded, scale = _quantize_blocked(pad_ragged(x, padded_row, padded_rows), 0, block_size, scale_alg)
    return gather_ragged(data_padded, padded_row), scale


def quantize_grouped(x: torch.Tensor, group_sizes: torch.Tensor, block_size: int = MX_BLOCK_SIZE,
                     scale_alg: str = MX_DEFAULT_SCALE_ALG, *, host_sizes: Sequence[int] | None = None):
    """MXFP8 along dim 0 of ``x: [T, K]`` with ragged blocks (see :func:`group_block_index`).

    Each group is zero-padded to a multiple of ``block_size`` (zeros leave a block's amax
    unchanged), quantized with :func:`quantize` along dim 0 and gathered back, so a group's
    short last block is scaled by its own rows only. ``host_sizes``: the group sizes as Python
    ints, if the caller has them (else read from ``group_sizes``).

    Returns:
        ``data [T, K]`` float8_e4m3fn, ``scale [B, K]`` uint8 E8M0 codes.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_grouped needs a [T, K] tensor, got shape {tuple(x.shape)}")
    check_blocked(x, -1, 1, scale_alg)
    _, padded_row, num_blocks = ragged_layout(group_sizes, _host_sizes(group_sizes, host_sizes), x.shape[0],
                                              block_size)
    return quantize_ragged(x, padded_row, num_blocks * block_size, block_size, scale_alg)


def dequantize_ragged(data: torch.Tensor, scale: torch.Tensor, row_to_block: torch.Tensor, *,
                      dtype: torch.dtype = torch.float32, scale_shift: int = 0) -> torch.Tensor:
    """Ragged col decode: row ``t`` of ``data [T, K]`` times scale row ``row_to_block[t]`` of
    ``scale [B, K]`` (raised by ``2**scale_shift`` first), in ``dtype`` as :func:`dequantize`.
    ``B`` may exceed the real block count (rows past it are never read)."""
    block_scale = e8m0_to_float(scale)
    if scale_shift:
        block_scale = block_scale * float(2**scale_shift)
    return decode_e4m3_as(data, dtype) * block_scale.to(dtype).index_select(0, row_to_block)


def dequantize_grouped(data: torch.Tensor, scale: torch.Tensor, group_sizes: torch.Tensor,
                       block_size: int = MX_BLOCK_SIZE, *, host_sizes: Sequence[int] | None = None,
                       dtype: torch.dtype = torch.float32, scale_shift: int = 0) -> torch.Tensor:
    """Inverse of :func:`quantize_grouped`: ``data [T, K]``, ``scale [B, K]`` -> ``[T, K]`` (float32 by
    default; ``dtype`` / ``scale_shift`` as :func:`dequantize`)."""
    row_to_block, num_blocks = group_block_index(group_sizes, block_size, host_sizes=host_sizes)
    if scale.shape[0] != num_blocks or data.shape[0] != row_to_block.numel():
        raise ValueError(f"grouped MXFP8: data {tuple(data.shape)} / scale {tuple(scale.shape)} do not "
                         f"match group_sizes with {num_blocks} blocks")
    return dequantize_ragged(data, scale, row_to_block, dtype=dtype, scale_shift=scale_shift)
