"""``torch.compile``-d MXFP8 / HiF8 quantizers, bit-identical to the eager functions.

The eager functions in :mod:`te_npu.numerics.mxfp8` / :mod:`te_npu.numerics.hif8` stay the
default (tests, small tensors, anything where compile time would dominate). The functions here
wrap trace-friendly re-writes of the same arithmetic -- no ``lru_cache``, no ``.item()``, no
Python branch on data, lookup tables passed in as tensors -- in
``torch.compile(fullgraph=True, dynamic=False)``, so inductor fuses each quantizer into a few
loops. Integer bit operations are fine here: inductor emits them inside its generated,
vectorized loop, whereas in eager mode every int op is a separate full-tensor pass.

The compiled callables are built lazily on first use (one per function); each new input
shape/dtype recompiles once (``dynamic=False``). Results equal the eager ones bitwise, which
``tests/unit/numerics/test_compiled_equivalence.py`` checks.

Shape legend as in :mod:`te_npu.numerics.mxfp8`: ``x: [..., N, K]``; ``bs``: block size.
"""
import torch

from te_npu.numerics import hif8, mxfp8
from te_npu.numerics.constants import (
    E4M3_EMAX,
    E4M3_MAX,
    E4M3_NAN_CODE,
    E8M0_BIAS,
    E8M0_MAX_EXP,
    E8M0_NAN,
    FP32_EXP_MASK,
    FP32_MANTISSA_BITS,
    FP32_NAN_BITS,
    MX_BLOCK_SIZE,
)

_SUBNORMAL_2_POW_M127 = 1 << (FP32_MANTISSA_BITS - 1)  # float32 bits of 2**-127
_E4M3_MIN_NORMAL_BITS = 0x3C800000  # float32 bits of 2**-6, the smallest normal E4M3 value


# ----------------------------------------------------------------------------- MXFP8 (traced)
def _field(x32: torch.Tensor) -> torch.Tensor:
    """FP32 exponent field (int32 0..255) of ``x32`` (sign ignored)."""
    return (x32.view(torch.int32) >> FP32_MANTISSA_BITS) & FP32_EXP_MASK


def _scale_codes(amax: torch.Tensor, scale_alg: str) -> torch.Tensor:
    """Same as :func:`mxfp8.scale_codes_from_amax`, as int32 codes (traced; ``scale_alg`` is static)."""
    amax32 = amax.to(torch.float32)
    exp_field = _field(amax32)
    if scale_alg == "floor":
        codes = (exp_field - E4M3_EMAX).clamp(min=0)
    else:
        quotient = amax32 / E4M3_MAX
        q_exp = _field(quotient)
        # 2**(q_exp - 127) from bits (2**-127 is the subnormal with bit 22 set); q_exp == 255
        # only for a non-finite amax, which the NaN override below handles.
        truncated = torch.where(q_exp == 0, _SUBNORMAL_2_POW_M127, q_exp << FP32_MANTISSA_BITS).view(torch.float32)
        codes = (q_exp + (quotient > truncated).to(torch.int32)).clamp(max=E8M0_MAX_EXP + E8M0_BIAS)
    return torch.where(exp_field == FP32_EXP_MASK, E8M0_NAN, codes)


def _inverse_scale(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int32 E8M0 codes -> ``2**-(code - 127)`` in ``dtype`` (NaN for 0xFF), from bits."""
    bits = (2 * E8M0_BIAS - codes).clamp(min=1) << FP32_MANTISSA_BITS
    bits = torch.where(codes == E8M0_NAN, FP32_NAN_BITS, bits)
    return bits.view(torch.float32).to(dtype)


def _e4m3_codes(y: torch.Tensor) -> torch.Tensor:
    """Float32 ``float8_e4m3fn`` codes (exact integers 0..255) of ``y``; |y| > 448 saturates to 448.

    Round-to-nearest-even like PyTorch's cast (inductor's CPU float8 cast is a scalar loop, so
    it is written out in float ops that vectorize): a 4-step binary search finds the E4M3
    exponent ``E`` (clamped below at -6) while rescaling ``|y|`` to ``t = |y| * 2**-(E + 6)``;
    then ``code = 8 * (E + 6) + round_half_even(t * 2**9)``, which covers normals (``t * 2**9``
    in [8, 16], 16 being the carry into the next binade) and subnormals (E = -6). The sign bit
    is copied with ``copysign`` (so -0.0 and negatives that round to zero give 0x80, as PyTorch's
    cast does). NaN (only in blocks with scale 0xFF) -> 0x7F, like eager ``mxfp8.quantize``.
    """
    a = y.abs().clamp(max=E4M3_MAX)  # saturate here (NaN propagates): callers need not clamp y
    t = a
    base = torch.zeros_like(a)
    for k in (8, 4, 2, 1):
        c = t >= 2.0 ** (k - 6)
        t = torch.where(c, t * 2.0 ** -k, t)
        base = torch.where(c, base + 8.0 * k, base)
    code = base + torch.round(t * 512.0)
    neg = torch.copysign(torch.ones_like(y), y) < 0
    code = torch.where(neg, code + 128.0, code)
    return torch.where(y != y, float(E4M3_NAN_CODE), code)


def _blocked(xc: torch.Tensor, axis: int, block_size: int, scale_alg: str):
    """Traced twin of ``mxfp8._quantize_blocked``: ``axis`` non-negative, shape already checked.

    Returns uint8 data (the caller views it as ``float8_e4m3fn``) and uint8 scale codes.
    """
    shape = tuple(xc.shape)
    blocked = shape[:axis] + (shape[axis] // block_size, block_size) + shape[axis + 1:]
    xb = xc.reshape(blocked)
    amax = xb.abs().amax(dim=axis + 1, keepdim=True)
    codes = _scale_codes(amax, scale_alg)
    inv = _inverse_scale(codes, torch.float32)
    # x * 2**-e is exact in FP32 (and in BF16, where eager computes it), bar results far below
    # the smallest E4M3 subnormal, which round to (signed) zero either way.
    y = xb.to(torch.float32) * inv
    data = _e4m3_codes(y.clamp(-E4M3_MAX, E4M3_MAX)).to(torch.uint8)
    return data.reshape(shape), codes.squeeze(axis + 1).to(torch.uint8)


def _quantize_impl(x: torch.Tensor, axis: int, block_size: int, scale_alg: str):
    return _blocked(mxfp8._compute_dtype(x), axis, block_size, scale_alg)


def _ragged_col_impl(x: torch.Tensor, padded_row: torch.Tensor, padded_rows: int, block_size: int, scale_alg: str):
    """Ragged col quantization at a static padded size: rows scattered to ``padded_row`` in a
    zero ``[padded_rows, K]`` buffer, blocked along dim 0, gathered back. Returns uint8 ``data
    [T, K]`` and ``scale [padded_rows / bs, K]`` (blocks past the groups' are all-zero padding)."""
    xc = mxfp8._compute_dtype(x)
    padded = xc.new_zeros((padded_rows, x.shape[1])).index_copy(0, padded_row, xc)
    data, scale = _blocked(padded, 0, block_size, scale_alg)
    return data.index_select(0, padded_row), scale


def _dual_views(xc: torch.Tensor, block_size: int):
    """``xc: [..., N, K]`` -> row-blocked ``[..., N, K/bs, bs]`` and col-blocked ``[..., N/bs, bs, K]`` views."""
    *lead, n, k = xc.shape
    return (xc.reshape(*lead, n, k // block_size, block_size),
            xc.reshape(*lead, n // block_size, block_size, k))


def _dual_scales_impl(x: torch.Tensor, block_size: int, scale_alg: str):
    """Stage 1 of the split dual quantizer: block amax (one reduction per orientation) and, on
    the 32x smaller per-block tensors only, the E8M0 codes and inverse scales ``2**-e`` (fp32).

    Returns ``(row_codes [..., N, K/bs], row_inv, col_codes [..., N/bs, K], col_inv)``; codes uint8.
    """
    xr, xcol = _dual_views(mxfp8._compute_dtype(x), block_size)
    row_codes = _scale_codes(xr.abs().amax(dim=-1), scale_alg)
    col_codes = _scale_codes(xcol.abs().amax(dim=-2), scale_alg)
    return (row_codes.to(torch.uint8), _inverse_scale(row_codes, torch.float32),
            col_codes.to(torch.uint8), _inverse_scale(col_codes, torch.float32))


def _dual_apply_impl(x: torch.Tensor, row_inv: torch.Tensor, col_inv: torch.Tensor, block_size: int):
    """Stage 2: elementwise ``x * 2**-e`` (scale broadcast over its block), saturating E4M3 codes --
    float ops only (no int bit views), one pass over ``x`` for both orientations."""
    shape = tuple(x.shape)
    xr, xcol = _dual_views(mxfp8._compute_dtype(x), block_size)
    y_row = (xr.to(torch.float32) * row_inv.unsqueeze(-1)).reshape(shape)
    y_col = (xcol.to(torch.float32) * col_inv.unsqueeze(-2)).reshape(shape)
    # no separate clamp: _e4m3_codes saturates |y| itself (one min instead of max + min)
    row_data = _e4m3_codes(y_row).to(torch.uint8)
    col_data = _e4m3_codes(y_col).to(torch.uint8)
    return row_data, col_data


# ----------------------------------------------------------------------------- HiF8 (traced)
def _hif8_encode_impl(x32: torch.Tensor, saturate: bool, half_t, keep_t, packed_t) -> torch.Tensor:
    """Traced twin of :func:`hif8.encode` on float32 input; tables from ``hif8._encode_tables``."""
    bits = x32.view(torch.int32)
    mag = bits & hif8.FP32_ABS_MASK
    if saturate:
        mag = torch.where((mag > hif8._HIF8_MAX_BITS) & (mag < hif8.FP32_INF_BITS), hif8._HIF8_MAX_BITS, mag)
    field = mag >> FP32_MANTISSA_BITS
    rounded = (mag + half_t[field]) & keep_t[field]
    packed = packed_t[rounded >> FP32_MANTISSA_BITS]
    code = (rounded >> (packed & 0xFF)) + (packed >> 8)
    code = torch.where(code == 0, 0, code | ((bits >> 24) & hif8.HIF8_SIGN))
    code = torch.where(mag > hif8.FP32_INF_BITS, hif8.HIF8_NAN, code)
    return code.to(torch.uint8)


def _hif8_quantize_impl(x: torch.Tensor, scale: torch.Tensor, saturate: bool, half_t, keep_t, packed_t):
    scale = scale.to(torch.float32).reshape(tuple(scale.shape) + (1,) * (x.dim() - scale.dim()))
    return _hif8_encode_impl(x.to(torch.float32) / scale, saturate, half_t, keep_t, packed_t)


def _hif8_current_impl(x: torch.Tensor, reciprocal: float, saturate: bool, half_t, keep_t, packed_t):
    """amax -> current scale -> codes, one graph (per-tensor scale, as ``hif8.current_scale``:
    ``amax * reciprocal`` with ``reciprocal`` the FP32 ``1.0f / format_max``, as the kernel)."""
    amax = x.abs().amax().to(torch.float32)
    ok = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(ok, amax * reciprocal, torch.ones_like(amax))
    return _hif8_quantize_impl(x, scale, saturate, half_t, keep_t, packed_t), scale


# ----------------------------------------------------------------------------- decode (traced)
def _e8m0_value(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 codes -> float32 ``2**(code - 127)`` (code 0: the subnormal 2**-127; 0xFF: NaN)."""
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, _SUBNORMAL_2_POW_M127, c << FP32_MANTISSA_BITS)
    return torch.where(c == E8M0_NAN, FP32_NAN_BITS, bits).view(torch.float32)


def _mxfp8_decode_impl(data: torch.Tensor, scale: torch.Tensor, axis: int, block_size: int, dtype: torch.dtype,
                       scale_shift: int):
    """E4M3 values times their block's scale (raised by ``2**scale_shift``), in fp32 (exact),
    then cast to ``dtype``."""
    shape = tuple(data.shape)
    blocked = shape[:axis] + (shape[axis] // block_size, block_size) + shape[axis + 1:]
    values = data.view(torch.float8_e4m3fn).to(torch.float32).reshape(blocked)
    block_scale = _e8m0_value(scale) * float(2**scale_shift)
    return (values * block_scale.unsqueeze(axis + 1)).reshape(shape).to(dtype)


def _ragged_decode_impl(data: torch.Tensor, scale: torch.Tensor, row_to_block: torch.Tensor, dtype: torch.dtype,
                       scale_shift: int):
    """Ragged col decode: row ``t`` of ``data [T, K]`` times scale row ``row_to_block[t]``."""
    values = data.view(torch.float8_e4m3fn).to(torch.float32)
    block_scale = _e8m0_value(scale) * float(2**scale_shift)
    return (values * block_scale.index_select(0, row_to_block)).to(dtype)


def _hif8_decode_impl(codes: torch.Tensor, table: torch.Tensor, dtype: torch.dtype):
    return table[codes.to(torch.int64)].to(dtype)


# ----------------------------------------------------------------------------- compiled entry points
_COMPILED: dict = {}


_RECOMPILE_LIMIT = 256
"""Each (shape, dtype, option) is its own graph (``dynamic=False``); dynamo's default limit of 8
graphs per code object is a hard error under ``fullgraph``, so calls raise it, scoped."""


def _compiled(fn):
    """``torch.compile(fn, fullgraph=True, dynamic=False)``, built once per function; calling the
    result runs it with dynamo's recompile limit raised to ``_RECOMPILE_LIMIT`` (scoped patch)."""
    if fn not in _COMPILED:
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)

        def run(*args):
            with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT,
                                            accumulated_recompile_limit=4 * _RECOMPILE_LIMIT):
                return compiled(*args)

        _COMPILED[fn] = run
    return _COMPILED[fn]


def quantize_compiled(x: torch.Tensor, axis: int = -1, block_size: int = MX_BLOCK_SIZE, scale_alg: str = "floor"):
    """Compiled :func:`mxfp8.quantize` (same arguments, same checks, bitwise-equal results)."""
    axis = mxfp8._check(x, axis, block_size, scale_alg)
    data, scale = _compiled(_quantize_impl)(x, axis, block_size, scale_alg)
    return data.view(torch.float8_e4m3fn), scale


def quantize_dual_compiled(x: torch.Tensor, block_size: int = MX_BLOCK_SIZE, scale_alg: str = "floor"):
    """Compiled :func:`mxfp8.quantize_dual`: ``(row_data, row_scale, col_data, col_scale)``."""
    if x.dim() < 2:
        raise ValueError(f"quantize_dual needs a [..., N, K] tensor, got shape {tuple(x.shape)}")
    mxfp8._check(x, -1, block_size, scale_alg)
    mxfp8._check(x, -2, block_size, scale_alg)
    # Two graphs so each block scale is materialized once: fused into one graph, inductor
    # recomputes the column scale inside the elementwise loop.
    row_scale, row_inv, col_scale, col_inv = _compiled(_dual_scales_impl)(x, block_size, scale_alg)
    row_data, col_data = _compiled(_dual_apply_impl)(x, row_inv, col_inv, block_size)
    return row_data.view(torch.float8_e4m3fn), row_scale, col_data.view(torch.float8_e4m3fn), col_scale


def _max_ragged_blocks(num_rows: int, num_groups: int, block_size: int) -> int:
    """An upper bound of ``sum(ceil(T_g / bs))`` that depends on T and G only (static shapes):
    each group adds at most one partial block to ``T // bs``."""
    return num_rows // block_size + num_groups


def quantize_grouped_compiled(x: torch.Tensor, group_sizes: torch.Tensor, block_size: int = MX_BLOCK_SIZE,
                              scale_alg: str = "floor"):
    """Compiled :func:`mxfp8.quantize_grouped` (bitwise equal). The block count changes with the
    group sizes, so the graph runs at the static upper bound T // bs + G blocks (one compile per
    T, G, K) and the scale is cut to the real count, a host int from the group sizes' mirror."""
    if x.dim() != 2:
        raise ValueError(f"quantize_grouped needs a [T, K] tensor, got shape {tuple(x.shape)}")
    mxfp8._check(x, -1, 1, scale_alg)
    _, padded_row, num_blocks = mxfp8._group_layout(group_sizes, x.shape[0], block_size)
    bound = _max_ragged_blocks(x.shape[0], group_sizes.numel(), block_size)
    data, scale = _compiled(_ragged_col_impl)(x, padded_row, bound * block_size, block_size, scale_alg)
    return data.view(torch.float8_e4m3fn), scale[:num_blocks]


def mxfp8_dequantize_grouped_compiled(data: torch.Tensor, scale: torch.Tensor, group_sizes: torch.Tensor,
                                      dtype: torch.dtype = torch.float32, scale_shift: int = 0) -> torch.Tensor:
    """Compiled ``(mxfp8.dequantize_grouped(...) * 2**scale_shift).to(dtype)`` (scale raised first),
    run at the static block bound of :func:`quantize_grouped_compiled` (the scale is zero-padded)."""
    row_to_block, num_blocks = mxfp8.group_block_index(group_sizes, MX_BLOCK_SIZE)
    if scale.shape[0] != num_blocks or data.shape[0] != row_to_block.numel():
        raise ValueError(f"grouped MXFP8: data {tuple(data.shape)} / scale {tuple(scale.shape)} do not "
                         f"match group_sizes with {num_blocks} blocks")
    bound = _max_ragged_blocks(data.shape[0], group_sizes.numel(), MX_BLOCK_SIZE)
    padded_scale = torch.nn.functional.pad(scale, (0, 0, 0, bound - num_blocks))
    return _compiled(_ragged_decode_impl)(data.view(torch.uint8), padded_scale, row_to_block, dtype, scale_shift)


def hif8_encode_compiled(x: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """Compiled :func:`hif8.encode`."""
    return _compiled(_hif8_encode_impl)(x.to(torch.float32), saturate, *hif8._encode_tables(x.device))


def hif8_quantize_compiled(x: torch.Tensor, scale: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """Compiled :func:`hif8.quantize`: codes of ``x / scale``, ``scale`` scalar or ``[E]``."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return _compiled(_hif8_quantize_impl)(x, scale, saturate, *hif8._encode_tables(x.device))


def hif8_current_quantize_compiled(x: torch.Tensor, format_max: float, saturate: bool = False):
    """Per-tensor current scaling in one compiled graph: ``(codes, scale)`` equal to
    ``scale = hif8.current_scale(x.abs().amax(), format_max); hif8.quantize(x, scale)``."""
    reciprocal = hif8.reciprocal_format_max(float(format_max))
    return _compiled(_hif8_current_impl)(x, reciprocal, saturate, *hif8._encode_tables(x.device))


def mxfp8_dequantize_compiled(data: torch.Tensor, scale: torch.Tensor, axis: int = -1,
                              block_size: int = MX_BLOCK_SIZE, dtype: torch.dtype = torch.float32,
                              scale_shift: int = 0) -> torch.Tensor:
    """Compiled ``(mxfp8.dequantize(...) * 2**scale_shift).to(dtype)``: equal to it bitwise wherever
    the values are exactly representable in ``dtype`` (always for float32; for bf16 see
    ``te_npu.ops.emulation``)."""
    axis = axis % data.dim()
    if scale.shape[axis] * block_size != data.shape[axis]:
        raise ValueError(f"MXFP8: scale shape {tuple(scale.shape)} does not match data shape {tuple(data.shape)} "
                         f"with block_size={block_size} along dim {axis}")
    return _compiled(_mxfp8_decode_impl)(data.view(torch.uint8), scale, axis, block_size, dtype, scale_shift)


def hif8_decode_compiled(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Compiled ``hif8.decode(codes).to(dtype)`` (HiF8 values are exact in bf16 and fp32)."""
    return _compiled(_hif8_decode_impl)(codes, hif8._decode_table(codes.device), dtype)


__all__ = [
    "hif8_current_quantize_compiled",
    "hif8_decode_compiled",
    "mxfp8_dequantize_compiled",
    "mxfp8_dequantize_grouped_compiled",
    "quantize_grouped_compiled",
    "hif8_encode_compiled",
    "hif8_quantize_compiled",
    "quantize_compiled",
    "quantize_dual_compiled",
]
