"""What every low-precision GEMM family shares: the frozen numerics object, role-tagged
quantization of activations / gradients, saving operands for backward, and shape checks.

Shape legend: ``M`` rows (tokens) of the 2D activation, ``K`` input features (the fprop
reduction dim), ``N`` output features, ``G`` groups (experts), ``T`` rows of a grouped operand.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Sequence

import torch

from te_npu import events
from te_npu.errors import LowPrecisionUnavailableError
from te_npu.formats import Format, Orientation, QuantizationRole, spec
from te_npu.ops.group_sizes import group_sizes_tensor, host_group_sizes
from te_npu.quantizers import Quantizer
from te_npu.recipe import Recipe
from te_npu.ops.operand import QuantizedOperand

__all__ = [
    "GemmNumerics",
    "GemmContext",
    "quantize_operand",
    "quantize_pair",
    "save_operands",
    "load_operands",
    "group_list_tensor",
    "unavailable",
]

@dataclass(frozen=True, eq=False)
class GemmNumerics:
    """The numerics-only arguments of one low-precision linear call, captured in forward.

    Backward reads the recipe from here, never from the autocast state, so a backward that
    runs outside ``te_npu.autocast`` still computes in the forward's format.

    recipe: the frozen recipe; quantizers: role -> quantizer (default ``recipe.quantizers()``).
    """

    recipe: Recipe
    quantizers: Mapping[QuantizationRole, Quantizer]

    @classmethod
    def from_recipe(cls, recipe: Recipe, quantizers: Mapping[QuantizationRole, Quantizer] | None = None) -> "GemmNumerics":
        """Numerics of ``recipe``; ``quantizers`` overrides the recipe's role -> quantizer map."""
        return cls(recipe, MappingProxyType(dict(recipe.quantizers() if quantizers is None else quantizers)))

    @property
    def format(self) -> Format:
        return self.recipe.format

    @property
    def block_size(self) -> int:
        """Elements sharing one scale along a blocked dim: the quantizer's (MXFP8: 32 by default,
        the format's ``spec(...).block_size``); 1 for per-tensor formats."""
        return getattr(self.quantizers[QuantizationRole.INPUT_FWD], "block_size", None) or spec(self.format).block_size or 1

    def quantizer(self, role: QuantizationRole) -> Quantizer:
        return self.quantizers[role]


_CONSUMING_GEMM = {
    (QuantizationRole.INPUT_FWD, "row"): "fprop",
    (QuantizationRole.WEIGHT_FWD, "row"): "fprop",
    (QuantizationRole.GRAD_OUTPUT, "row"): "dgrad",
    (QuantizationRole.WEIGHT_BWD, "col"): "dgrad",
    (QuantizationRole.GRAD_OUTPUT, "col"): "wgrad",
    (QuantizationRole.INPUT_BWD, "col"): "wgrad",
}
"""(role, orientation the GEMM reads) -> the GEMM that consumes the operand (the tables of
``linear.py`` / ``grouped_linear.py``)."""


@dataclass(frozen=True)
class GemmContext:
    """Non-numerics call context: the GEMM's name, for error messages and ``OperandEvent`` s.

    name: module FQN (or class name + shape) used in ``LowPrecisionUnavailableError``.
    """

    name: str = "te_npu.functional"

    def record(self, role: QuantizationRole, orientation: str, quantizer: Quantizer, source: torch.Tensor,
               operand: QuantizedOperand, slot: Orientation | None = None) -> None:
        """Report one operand of this GEMM to the event stream (nothing when nobody listens).
        ``slot``: the orientation the consuming GEMM reads it in (default ``orientation``)."""
        if events.has_subscribers(events.OperandEvent):
            events.emit(events.OperandEvent(self.name, role, orientation, tuple(source.shape), operand.format.value,
                                            operand.scale.detach(), getattr(quantizer, "format_max", None),
                                            gemm=_CONSUMING_GEMM[role, slot or orientation], operand=operand,
                                            source=source.detach()))


def unavailable(context: GemmContext, numerics: GemmNumerics, reason: str) -> LowPrecisionUnavailableError:
    """The error raised instead of any high-precision fallback."""
    return LowPrecisionUnavailableError(f"{context.name}: {numerics.format.value} GEMM cannot run: {reason}")


def quantize_operand(numerics: GemmNumerics, context: GemmContext, tensor: torch.Tensor, role: QuantizationRole,
                     orientation: Orientation, group_list: torch.Tensor | None = None) -> QuantizedOperand:
    """Quantize ``tensor`` with the quantizer of ``role`` for one GEMM orientation."""
    quantizer = numerics.quantizer(role)
    operand = quantizer.quantize(tensor, orientation=orientation, group_list=group_list)
    context.record(role, orientation, quantizer, tensor, operand)
    return operand


def quantize_pair(numerics: GemmNumerics, context: GemmContext, tensor: torch.Tensor,
                  row_role: QuantizationRole, col_role: QuantizationRole, *,
                  group_list: torch.Tensor | None = None, need_row: bool = True,
                  need_col: bool = True) -> tuple[QuantizedOperand | None, QuantizedOperand | None]:
    """Row operand (role ``row_role``) and col operand (role ``col_role``) of ``tensor``.

    Only the needed ones are made (None otherwise). Both come from the high-precision
    ``tensor``: deriving the col copy from the row copy would round twice. HiF8 with one
    quantizer for both roles quantizes once and relabels the operand (same codes and scale).
    MXFP8 dense uses the dual-axis quantizer; with ``group_list`` the col copy gets blocks
    that restart at every group boundary (ragged blocks, dim 0).
    """
    if not (need_row and need_col):
        row = quantize_operand(numerics, context, tensor, row_role, "row") if need_row else None
        col = quantize_operand(numerics, context, tensor, col_role, "col", group_list) if need_col else None
        return row, col
    row_q, col_q = numerics.quantizer(row_role), numerics.quantizer(col_role)
    # one copy serves both orientations when the scale does not depend on the blocking
    # direction (per-tensor formats); block formats need a copy per orientation
    if row_q == col_q and spec(numerics.format).one_copy_for_both_orientations:
        row = row_q.quantize(tensor, orientation="row", group_list=group_list)
        context.record(row_role, "both", row_q, tensor, row, slot="row")
        context.record(col_role, "both", col_q, tensor, row, slot="col")
        return row, dataclasses.replace(row, orientation="col")
    if row_q == col_q and group_list is None and hasattr(row_q, "quantize_dual"):
        row, col = row_q.quantize_dual(tensor)
        context.record(row_role, "row", row_q, tensor, row)
        context.record(col_role, "col", col_q, tensor, col)
        return row, col
    row = quantize_operand(numerics, context, tensor, row_role, "row")
    col = quantize_operand(numerics, context, tensor, col_role, "col", group_list)
    return row, col


def save_operands(ctx, operands: Sequence[QuantizedOperand | None]) -> None:
    """``save_for_backward`` the payloads (so saved-tensor hooks and checkpointing see them)."""
    tensors, meta = [], []
    for operand in operands:
        if operand is None:
            meta.append(None)
            continue
        tensors += [operand.data, operand.scale]
        meta.append(dataclasses.replace(operand, data=None, scale=None))
    ctx.save_for_backward(*tensors)
    ctx.operand_meta = meta


def load_operands(ctx) -> list[QuantizedOperand | None]:
    """Inverse of :func:`save_operands`."""
    saved = iter(ctx.saved_tensors)
    return [None if m is None else dataclasses.replace(m, data=next(saved), scale=next(saved))
            for m in ctx.operand_meta]


def group_list_tensor(m_splits: Sequence[int] | torch.Tensor, num_groups: int, num_rows: int,
                      device: torch.device) -> torch.Tensor:
    """int64 ``[G]`` row counts on ``device`` with their host mirror (``te_npu.ops.group_sizes``),
    checked against G and T on the host. A list costs no host sync; a tensor costs one read
    (none if it already carries a mirror), and every later GEMM and ragged layout reads the
    mirror. Sizes must be integers (a float is refused, never truncated); a meta tensor holds
    no sizes to read and is refused."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1:
            raise ValueError(f"m_splits must hold {num_groups} group sizes, got shape {tuple(m_splits.shape)}")
        if m_splits.dtype.is_floating_point or m_splits.dtype.is_complex or m_splits.dtype == torch.bool:
            raise TypeError(f"m_splits must hold integer group sizes, got a {m_splits.dtype} tensor")
        if m_splits.is_meta:
            raise ValueError("m_splits is a meta tensor: it holds no group sizes to read; pass a list of ints or a "
                             "tensor on a real device (the meta device runs only the plain path, for shapes)")
        sizes = host_group_sizes(m_splits)
    else:
        bad = [s for s in m_splits if not isinstance(s, numbers.Integral)]
        if bad:
            raise TypeError(f"m_splits must hold integer group sizes, got {bad[0]!r} ({type(bad[0]).__name__}) "
                            f"in {list(m_splits)}")
        sizes = tuple(int(s) for s in m_splits)
    if len(sizes) != num_groups:
        raise ValueError(f"m_splits must hold {num_groups} group sizes, got {len(sizes)}")
    if sum(sizes) != num_rows or any(s < 0 for s in sizes):
        raise ValueError(f"m_splits {list(sizes)} must be non-negative and sum to the {num_rows} input rows")
    return group_sizes_tensor(sizes, device)
