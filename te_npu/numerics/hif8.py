"""HiFloat8 (Huawei HiF8) codes as pure tensor functions.

A code is ``sign | dot prefix | exponent | mantissa``; the dot prefix says how many exponent and
mantissa bits follow (see ``constants.HIF8_BANDS``):

======  ===============  ==================  =============  ======================
|E|     prefix (7 bits)  exponent bits       mantissa bits  codes (positive)
======  ===============  ==================  =============  ======================
0       0001             none                3              0x08-0x0F
1       001              sign                3              0x10-0x1F
2-3     01               sign + 1            3              0x20-0x3F
4-7     10               sign + 2            2              0x40-0x5F
8-15    11               sign + 3            1              0x60-0x7F
-16..-22 0000            3 (denormal 1..7)   0              0x01-0x07
======  ===============  ==================  =============  ======================

0x00 is the only zero, 0x80 the only NaN, 0x6F/0xEF are +-Inf (the slot of 1.5 * 2**15).
Rounding is to nearest with ties away from zero, done on the FP32 bits: add half a unit of
the mantissa width chosen by the input's exponent, then truncate. A carry that reaches the next
power of two is exact in any band, so the width chosen before rounding is always the right
one. Ties-away makes ``2**-23`` (half the smallest denormal) round up to ``2**-22`` and
``40960 = 1.25 * 2**15`` round up to Inf; ``-0.0`` encodes to 0x00 (0x80 is NaN), and so do
negative values that round to zero. All of it matches ``en_dtypes.hifloat8`` (swept in tests).

The rounding / code tables are built once, at import, from :data:`constants.HIF8_BANDS` (module
constants, never written). Every function takes them on CPU by default; a caller on another
device passes its own device copy (``tables=`` / ``table=``), as ``te_npu.ops.kernels`` does, so
no table is copied per call. The functions are written once for eager torch and for
``torch.compile`` (the compiled kernels compile these very functions).
"""
import struct

import torch

from te_npu.numerics.constants import (
    FP32_ABS_MASK,
    FP32_EXP_BIAS,
    FP32_INF_BITS,
    FP32_MANTISSA_BITS,
    HIF8_BANDS,
    HIF8_DENORMAL_OFFSET,
    HIF8_MAX,
    HIF8_MAX_EXP,
    HIF8_MIN_DENORMAL_EXP,
    HIF8_NAN,
    HIF8_POS_INF,
    HIF8_SIGN,
)

_HIF8_MAX_BITS = 0x47000000  # float32 bits of HIF8_MAX = 2**15
_NO_SHIFT = 31  # shifting a positive int32 by 31 gives 0


def _band(exp: int):
    """(mantissa bits, code of mantissa 0) of a HiF8 exponent, or None if not representable."""
    if HIF8_MIN_DENORMAL_EXP <= exp < -HIF8_MAX_EXP:
        return 0, exp + HIF8_DENORMAL_OFFSET
    for low, high, mbits, prefix in HIF8_BANDS:
        if low <= abs(exp) <= high:
            if low == 0:  # prefix 0001, mantissa only
                return mbits, prefix
            # below the prefix: [exp sign][|E| - low][mantissa]; the exp sign sits at bit 3
            # for |E| == 1 (no exponent bits) and at bit 4 otherwise.
            sign_pos = 3 if low == 1 else 4
            exp_sign = 1 if exp < 0 else 0
            return mbits, prefix | (exp_sign << sign_pos) | ((abs(exp) - low) << mbits)
    return None


def _build_encode_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tables indexed by the FP32 exponent field (0..255), int32 ``[256]`` each, on CPU.

    ``half``/``keep``: rounding addend (half a unit at the band's width) and truncation mask, by
    the exponent *before* rounding. ``packed``: ``shift | (offset << 8)`` by the exponent *after*
    rounding, so that ``code = (bits >> shift) + offset``.
    """
    half, keep, packed = [], [], []
    for field in range(256):
        exp = field - FP32_EXP_BIAS
        band = _band(exp)
        if exp == HIF8_MIN_DENORMAL_EXP - 1:  # [2**-23, 2**-22): ties away -> 2**-22
            half.append(1 << FP32_MANTISSA_BITS)
            keep.append(~((1 << FP32_MANTISSA_BITS) - 1))
        elif band is not None:
            drop = FP32_MANTISSA_BITS - band[0]
            half.append(1 << (drop - 1))
            keep.append(~((1 << drop) - 1))
        elif exp < HIF8_MIN_DENORMAL_EXP:  # below 2**-23: zero
            half.append(0)
            keep.append(0)
        else:  # beyond 2**16, Inf, NaN: left as is, mapped to Inf below (NaN fixed later)
            half.append(0)
            keep.append(-1)
        if band is not None:
            mbits, code = band
            shift = FP32_MANTISSA_BITS - mbits
            packed.append(shift | ((code - (field << mbits)) << 8))
        elif exp > HIF8_MAX_EXP:
            packed.append(_NO_SHIFT | (HIF8_POS_INF << 8))
        else:  # zero (only field 0 is reachable after rounding)
            packed.append(_NO_SHIFT)
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return as_tensor(half), as_tensor(keep), as_tensor(packed)


def _build_decode_table() -> torch.Tensor:
    """[256] float32 on CPU: HiF8 code -> value."""
    values = [0.0] * 128
    for field in range(256):
        band = _band(field - FP32_EXP_BIAS)
        if band is None:
            continue
        mbits, code = band
        for mant in range(1 << mbits):
            values[code + mant] = (1.0 + mant / (1 << mbits)) * 2.0 ** (field - FP32_EXP_BIAS)
    values[HIF8_POS_INF] = float("inf")
    table = torch.tensor(values + [-v for v in values], dtype=torch.float32)
    table[HIF8_NAN] = float("nan")
    return table


ENCODE_TABLES = _build_encode_tables()
"""``(half, keep, packed)``: int32 ``[256]`` rounding tables of :func:`encode` (CPU constants)."""
DECODE_TABLE = _build_decode_table()
"""float32 ``[256]``: the value of every HiF8 code (CPU constant; NaN at 0x80, +-Inf at 0x6F / 0xEF)."""


def encode_tables(device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:data:`ENCODE_TABLES` on ``device`` (the constants themselves on CPU, else a copy)."""
    return tuple(t.to(device) for t in ENCODE_TABLES)


def decode_table(device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:data:`DECODE_TABLE` as ``dtype`` on ``device`` (every HiF8 value is exact in bf16 / fp16 / fp32;
    the constant itself for float32 on CPU, else a copy)."""
    return DECODE_TABLE.to(device=device, dtype=dtype)


def encode(x: torch.Tensor, saturate: bool = False, *, tables=None) -> torch.Tensor:
    """Round ``x`` (any float dtype) to HiF8, ties away from zero; returns uint8 codes.

    Finite values that round past 32768 (``|x| >= 40960``) become +-Inf (0x6F/0xEF), or +-32768
    (0x6E/0xEE) when ``saturate``. +-Inf always stays +-Inf, NaN -> 0x80, ``|x| < 2**-23`` -> 0x00.
    ``tables``: :func:`encode_tables` on x's device (default: made here).
    """
    half_t, keep_t, packed_t = encode_tables(x.device) if tables is None else tables
    bits = x.to(torch.float32).view(torch.int32)
    mag = bits & FP32_ABS_MASK
    if saturate:
        mag = torch.where((mag > _HIF8_MAX_BITS) & (mag < FP32_INF_BITS), _HIF8_MAX_BITS, mag)
    field = mag >> FP32_MANTISSA_BITS
    rounded = (mag + torch.index_select(half_t, 0, field.flatten()).view_as(mag))
    rounded &= torch.index_select(keep_t, 0, field.flatten()).view_as(mag)
    packed = torch.index_select(packed_t, 0, (rounded >> FP32_MANTISSA_BITS).flatten()).view_as(mag)
    code = (rounded >> (packed & 0xFF)) + (packed >> 8)
    code = torch.where(code == 0, 0, code | ((bits >> 24) & HIF8_SIGN))  # no -0: 0x80 is NaN
    code = torch.where(mag > FP32_INF_BITS, HIF8_NAN, code)
    return code.to(torch.uint8)


def decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32, *, table=None) -> torch.Tensor:
    """uint8 HiF8 codes -> values in ``dtype`` (exact in float32 / bf16 / fp16), through a 256-entry
    table. ``table``: :func:`decode_table` for codes' device and ``dtype`` (default: made here)."""
    table = decode_table(codes.device, dtype) if table is None else table
    return torch.index_select(table, 0, codes.reshape(-1).to(torch.int32)).view(codes.shape)


def round_to_hif8(x: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """``decode(encode(x))``: ``x`` rounded to the nearest HiF8 value, as float32."""
    return decode(encode(x, saturate))


def reciprocal_format_max(format_max: float) -> float:
    """``1.0f / format_max`` rounded to FP32 (returned as the Python float holding that FP32 value).

    The constant the vendor's per-tensor kernels multiply by (``float(1.0) / maxValue``, see
    :func:`current_scale`). The double quotient rounded once to FP32 is the correctly rounded FP32
    quotient of two FP32 values (double rounding is innocuous for division: 53 >= 2 * 24 + 2 bits);
    ``format_max`` (15, 224) is an FP32 value. Pure Python, so it folds into a compiled graph.
    """
    return struct.unpack("<f", struct.pack("<f", 1.0 / float(format_max)))[0]


def current_scale(amax: torch.Tensor, format_max: float) -> torch.Tensor:
    """Current-scaling factor, float32: ``amax * (1.0f / format_max)`` where finite and > 0, else 1.0.

    Computed as Ascend's kernels compute it, not as the plain division
    (``amax / format_max``): ops-nn ``quant/dynamic_quant/op_kernel/arch35/
    dynamic_quant_regbase_full_load_pertensor.h`` (``ComputeMaxRowScaleVF``) takes
    ``max(|x| * (float(1.0) / maxValue))`` in FP32, i.e. the FP32 product of the amax and the
    FP32 reciprocal (the max commutes with the monotone rounded multiply). The two differ by
    one ulp for most amax values; at exact rounding ties of ``x / scale`` that flips codes, so
    the CPU reference follows the kernel. Elementwise: a scalar ``amax`` gives a scalar scale
    and ``[E]`` gives ``[E]``. A zero / non-finite amax gives 1.0 (the kernel has no such guard:
    te_npu's NPU path applies it explicitly).
    """
    amax = amax.to(torch.float32)
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, amax * reciprocal_format_max(format_max), torch.ones_like(amax))


def amax(x: torch.Tensor, per_group: bool = False) -> torch.Tensor:
    """FP32 amax of ``|x|``: ``[]``, or ``[E]`` over each leading group of a 3D ``[E, ...]`` weight
    with ``per_group`` (NaN propagates; abs and max are exact in any dtype)."""
    return x.detach().abs().amax(dim=tuple(range(1 if per_group else 0, x.dim()))).to(torch.float32)


def _broadcast_scale(scale: torch.Tensor, ndim: int) -> torch.Tensor:
    """Scalar stays scalar; ``[E]`` (leading groups) becomes ``[E, 1, ..., 1]``."""
    scale = torch.as_tensor(scale, dtype=torch.float32)
    return scale.reshape(tuple(scale.shape) + (1,) * (ndim - scale.dim()))


def quantize(x: torch.Tensor, scale: torch.Tensor, saturate: bool = False, *, tables=None) -> torch.Tensor:
    """HiF8 codes of ``x / scale`` (true FP32 division), ``x: [E, ...]``, ``scale`` scalar or ``[E]``.

    A division, as the kernels divide: ops-nn ``dynamic_quant`` arch35 ``ComputeYVF``
    (``MicroAPI::Div(x, scale)``) and ``quantize`` (aclnnQuantize, ``TPL_DIV_MODE_DIV``), both then
    casting FP32 -> HiFloat8 with ``CAST_ROUND`` (ties away from zero), as :func:`encode` does.

    ``saturate`` defaults to False: with ``scale = amax * (1 / format_max)`` every finite element
    lands inside +-format_max (<= 224 << 32768) so nothing saturates, and a NaN/Inf input keeps
    its NaN/Inf code instead of being hidden as 32768. ``tables``: as :func:`encode`.
    """
    return encode(x.to(torch.float32) / _broadcast_scale(scale, x.dim()).to(x.device), saturate, tables=tables)


def quantize_current(x: torch.Tensor, format_max: float, *, per_group: bool = False, saturate: bool = False,
                     tables=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current scaling: ``amax -> current_scale -> quantize`` of ``x``.

    Args:
        x: float tensor; with ``per_group`` a 3D ``[E, N, K]`` weight gets one scale per expert.
        format_max: the scaled amax target (15.0 inputs / weights, 224.0 gradients).
    Returns:
        ``(codes uint8 like x, scale fp32 [] or [E], amax fp32 [] or [E])``.
    """
    current_amax = amax(x, per_group)
    scale = current_scale(current_amax, format_max)
    return quantize(x, scale, saturate, tables=tables), scale, current_amax


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``decode(codes) * scale``, ``scale`` scalar or ``[E]`` for ``codes: [E, ...]``."""
    return decode(codes) * _broadcast_scale(scale, codes.dim()).to(codes.device)


__all__ = [
    "DECODE_TABLE",
    "ENCODE_TABLES",
    "HIF8_MAX",
    "amax",
    "current_scale",
    "decode",
    "decode_table",
    "dequantize",
    "encode",
    "encode_tables",
    "quantize",
    "quantize_current",
    "reciprocal_format_max",
    "round_to_hif8",
]
