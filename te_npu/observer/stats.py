"""Quantization statistics of one 8-bit operand against the high-precision tensor it came from.

Everything is read from the operand the GEMM consumes: its codes decoded with its own scales
(``te_npu.ops.emulation.decode`` for block formats, the NPU kernels' scale layout included;
``te_npu.numerics.hif8.dequantize`` for per-tensor / per-expert scales), never a re-quantization.

One operand gives one ``float64 [len(FIELDS)]`` vector on its device (no host sync): additive
counts and sums first, then maxima, so micro-batches and ranks combine by :func:`combine`
(sum the first part, max the rest) and the finished figures come from :func:`figures`.

========================  =============================================================================
statistic                 definition (over the finite source values ``x``; ``q``: the dequantized operand)
========================  =============================================================================
``underflow``             fraction of the non-zero ``x`` whose ``q`` is zero
``clipped``               fraction of ``x`` above the largest value its scale can hold:
                          ``|x| > element_max * scale`` (E4M3 448, HiF8 32768; saturated, or HiF8 Inf)
``amax``                  ``max |x|``
``scale_min/max``         MXFP8: the E8M0 block exponents ``code - 127`` (NaN blocks left out);
                          HiF8: the FP32 scale (per expert for a 3D weight)
``rel_error``             ``||q - x|| / ||x||`` (L2, over the positions where ``q`` is finite)
``sqnr_db``               ``10 log10(||x||^2 / ||q - x||^2)``; ``inf`` when ``q == x``
``block_dynamic_range``   MXFP8: the largest ``log2(max |x| / min non-zero |x|)`` over the operand's
                          32-element blocks (its own blocking: row, col, ragged col)
========================  =============================================================================
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from te_npu.formats import spec
from te_npu.numerics import hif8, mxfp8
from te_npu.numerics.constants import E8M0_BIAS, E8M0_NAN
from te_npu.ops.emulation import decode
from te_npu.ops.group_sizes import host_group_sizes
from te_npu.ops.layouts import to_canonical
from te_npu.ops.operand import QuantizedOperand

__all__ = ["SUM_FIELDS", "MAX_FIELDS", "FIELDS", "STATISTICS", "OperandFigures", "operand_stats", "identity", "combine",
           "figures"]

SUM_FIELDS = ("elements", "nonzero", "underflow", "clipped", "error_sq", "signal_sq")
MAX_FIELDS = ("amax", "scale_max", "neg_scale_min", "block_range")
FIELDS = SUM_FIELDS + MAX_FIELDS
_NUM_SUMS = len(SUM_FIELDS)

STATISTICS = ("underflow", "clipped", "amax", "scale_min", "scale_max", "rel_error", "sqnr_db",
              "block_dynamic_range")
"""The statistics an observer can report (``precision_observer.stats``), defined in the module doc."""


def identity(device: torch.device | str = "cpu") -> torch.Tensor:
    """The field vector of nothing observed (zero sums, ``-inf`` maxima): :func:`combine`'s unit."""
    return torch.tensor([0.0] * _NUM_SUMS + [-math.inf] * len(MAX_FIELDS), dtype=torch.float64, device=device)


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two field vectors (or ``[..., len(FIELDS)]`` stacks) of the same tensor role -> one."""
    return torch.cat([a[..., :_NUM_SUMS] + b[..., :_NUM_SUMS], torch.maximum(a[..., _NUM_SUMS:], b[..., _NUM_SUMS:])],
                     dim=-1)


def operand_stats(operand: QuantizedOperand, source: torch.Tensor) -> torch.Tensor:
    """``float64 [len(FIELDS)]`` of ``operand`` (as its GEMM reads it) against ``source``
    (the high-precision tensor of the operand's logical shape it was quantized from)."""
    op = to_canonical(operand)
    if tuple(source.shape) != tuple(op.data.shape):
        raise ValueError(f"observer: source {tuple(source.shape)} does not match the operand {tuple(op.data.shape)}")
    fmt = op.spec
    x = source.detach().float()
    q, scale_el = _dequantize(op)
    finite = torch.isfinite(x)
    ax = x.abs()
    nonzero = finite & (x != 0)
    q_ok = finite & torch.isfinite(q)
    err = torch.where(q_ok, q - x, 0.0).double()
    sig = torch.where(finite, x, 0.0).double()
    limit = fmt.element_max * scale_el
    clipped = finite & torch.isfinite(limit) & (ax > limit)
    smin, smax = _scale_range(op)
    amax = torch.where(finite, ax, 0.0).amax() if x.numel() else x.new_zeros(())
    block_range = _block_range(op, ax, finite) if fmt.blocked else x.new_tensor(-math.inf)
    parts = [finite.sum(), nonzero.sum(), (nonzero & (q == 0)).sum(), clipped.sum(), (err * err).sum(),
             (sig * sig).sum(), amax, smax, -smin, block_range]
    return torch.stack([p.double() for p in parts])


def _dequantize(op: QuantizedOperand) -> tuple[torch.Tensor, torch.Tensor]:
    """(values the GEMM reads, FP32; each element's scale, FP32), both of the data's shape."""
    if op.spec.blocked:
        ones = torch.ones(op.data.shape, dtype=torch.float32, device=op.data.device).to(op.data.dtype)
        return decode(op), decode(dataclasses.replace(op, data=ones))
    scale = op.scale.float().reshape(*op.scale.shape, *([1] * (op.data.dim() - op.scale.dim())))
    return hif8.dequantize(op.data, op.scale), scale.expand(op.data.shape)


def _scale_range(op: QuantizedOperand) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of the operand's scales: E8M0 exponents (NaN-code blocks left out), or FP32 scales."""
    scale = op.scale
    if op.group_sizes is not None:  # ragged: rows past the real block count are never read
        _, num_blocks = mxfp8.group_block_index(op.group_sizes, op.spec.block_size,
                                                host_sizes=host_group_sizes(op.group_sizes))
        scale = scale[:num_blocks]
    if op.spec.blocked:
        codes = scale.to(torch.int32).reshape(-1)
        codes = codes[codes != E8M0_NAN] - E8M0_BIAS
        values = codes.double()
    else:
        values = scale.double().reshape(-1)
    if values.numel() == 0:
        return values.new_tensor(math.inf), values.new_tensor(-math.inf)
    return values.amin(), values.amax()


def _block_range(op: QuantizedOperand, ax: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """Largest ``log2(max / min non-zero)`` of |x| over the operand's blocks (-inf: no such block)."""
    bs = op.spec.block_size
    top = torch.where(finite, ax, 0.0)
    low = torch.where(finite & (ax > 0), ax, math.inf)
    if op.orientation == "row":
        top_b = _pad_to(top, -1, bs, 0.0).unflatten(-1, (-1, bs)).amax(-1)
        low_b = _pad_to(low, -1, bs, math.inf).unflatten(-1, (-1, bs)).amin(-1)
    elif op.group_sizes is None:
        top_b = _pad_to(top, -2, bs, 0.0).unflatten(-2, (-1, bs)).amax(-2)
        low_b = _pad_to(low, -2, bs, math.inf).unflatten(-2, (-1, bs)).amin(-2)
    else:  # ragged col [T, K]: blocks of rows restart at each group
        row_to_block, num_blocks = mxfp8.group_block_index(op.group_sizes, bs,
                                                           host_sizes=host_group_sizes(op.group_sizes))
        index = row_to_block.to(ax.device).unsqueeze(1).expand_as(ax)
        shape = (num_blocks, ax.shape[1])
        top_b = top.new_zeros(shape).scatter_reduce(0, index, top, "amax")
        low_b = low.new_full(shape, math.inf).scatter_reduce(0, index, low, "amin")
    has = torch.isfinite(low_b)
    ratio = torch.where(has, torch.log2(top_b / torch.where(has, low_b, 1.0)), -math.inf)
    return ratio.amax() if ratio.numel() else ax.new_tensor(-math.inf)


def _pad_to(t: torch.Tensor, dim: int, multiple: int, value: float) -> torch.Tensor:
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    pad_shape = list(t.shape)
    pad_shape[dim] = extra
    return torch.cat([t, t.new_full(pad_shape, value)], dim=dim)


@dataclass(frozen=True)
class OperandFigures:
    """The finished statistics of one tensor role over one observed step (module doc)."""

    elements: int
    underflow: float
    clipped: float
    amax: float
    scale_min: float
    scale_max: float
    rel_error: float
    sqnr_db: float
    block_dynamic_range: float | None

    def as_dict(self, names=STATISTICS) -> dict[str, float]:
        """``{statistic: value}`` for ``names`` (a statistic the format has none of is left out)."""
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


def figures(fields: torch.Tensor) -> OperandFigures:
    """One combined host vector of :data:`FIELDS` -> :class:`OperandFigures` (``block_dynamic_range``
    None when no block held a non-zero value: always for per-tensor formats)."""
    f = dict(zip(FIELDS, fields.tolist()))
    err, sig = f["error_sq"], f["signal_sq"]
    return OperandFigures(
        elements=int(f["elements"]),
        underflow=f["underflow"] / f["nonzero"] if f["nonzero"] else 0.0,
        clipped=f["clipped"] / f["elements"] if f["elements"] else 0.0,
        amax=f["amax"],
        scale_min=-f["neg_scale_min"],
        scale_max=f["scale_max"],
        rel_error=math.sqrt(err / sig) if sig else 0.0,
        sqnr_db=(10 * math.log10(sig / err) if err else math.inf) if sig else math.nan,
        block_dynamic_range=f["block_range"] if math.isfinite(f["block_range"]) else None,
    )
