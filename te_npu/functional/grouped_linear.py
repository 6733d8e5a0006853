"""Grouped low-precision linear (MoE experts): ``y_g = x_g @ weight[g].T`` per row group.

Legend: ``T`` rows of ``x`` (tokens x top-k, sorted by group), ``G`` groups (experts),
``K`` in_features, ``N`` out_features; ``group_list`` = int64 ``[G]`` row counts.

=======  ==========================  ==============================  ======  =============
GEMM     left                        right                           layout  output
=======  ==========================  ==============================  ======  =============
fprop    X [T, K] row (input_fwd)    W [G, N, K] row (weight_fwd)    NT      Y [T, N]
dgrad    dY [T, N] row (grad_out)    W [G, N, K] col (weight_bwd)    NN      dX [T, K]
wgrad    dY [T, N] col, ragged       X [T, K] col, ragged            TN      dW [G, N, K]
=======  ==========================  ==============================  ======  =============

MXFP8: fprop/dgrad blocks run along K / N, inside one row, so groups do not matter there;
the wgrad col blocks run along T and restart at every group boundary (a group's last block
may be short), so a block never mixes two experts' tokens. Hence the result equals one dense
GEMM per group, and empty, single, uneven and non-multiple-of-32 groups all work. K and N
must be multiples of 32. HiF8: one FP32 scale per expert for the weight ([G]) and one
per-tensor scale for each 2D activation / gradient operand.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from te_npu.formats import QuantizationRole as Role
from te_npu.functional.operands import (
    GemmContext,
    GemmNumerics,
    group_list_tensor,
    load_operands,
    quantize_pair,
    save_operands,
    unavailable,
)
from te_npu.functional.dtypes import torch_autocast_off
from te_npu.functional.main_grad import MainGradWrite, require_main_grad, write_main_grad
from te_npu.functional.no_tokens import no_tokens
from te_npu.ops.group_sizes import host_group_sizes
from te_npu.functional.weight_cache import WeightCache, WeightOperands, col_operand, weight_operands
from te_npu.ops import low_precision_grouped_matmul
from te_npu.quantizers import Quantizer
from te_npu.recipe import Recipe
from te_npu.ops.operand import QuantizedOperand

__all__ = ["grouped_linear"]


def _fprop(x_row: QuantizedOperand, w_row: QuantizedOperand, group_list: torch.Tensor,
           bias_GN: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Y_g[T_g, N] = X_g[T_g, K] . W[g]^T (+ bias[g], added to the FP32 result)."""
    if bias_GN is None:
        return low_precision_grouped_matmul(x_row, w_row, group_list, layout="NT", output_dtype=out_dtype)
    y_TN = low_precision_grouped_matmul(x_row, w_row, group_list, layout="NT", output_dtype=torch.float32)
    rows = torch.repeat_interleave(bias_GN.float(), group_list, dim=0, output_size=y_TN.shape[0])
    return y_TN.add_(rows).to(out_dtype)


def _bias_grad(dy_TN: torch.Tensor, group_list: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dBias[g] = sum of dY_g's rows, in FP32 (zeros for an empty group), then ``out_dtype``."""
    chunks = dy_TN.split(list(host_group_sizes(group_list)))
    return torch.stack([chunk.sum(0, dtype=torch.float32) for chunk in chunks]).to(out_dtype)


def _dgrad(dy_row: QuantizedOperand, w_col: QuantizedOperand, group_list: torch.Tensor,
           out_dtype: torch.dtype) -> torch.Tensor:
    """dX_g[T_g, K] = dY_g[T_g, N] . W[g]."""
    return low_precision_grouped_matmul(dy_row, w_col, group_list, layout="NN", output_dtype=out_dtype)


def _wgrad(dy_col: QuantizedOperand, x_col: QuantizedOperand, group_list: torch.Tensor,
           out_dtype: torch.dtype) -> torch.Tensor:
    """dW[g] = dY_g^T . X_g (zeros for an empty group)."""
    return low_precision_grouped_matmul(dy_col, x_col, group_list, layout="TN", output_dtype=out_dtype)


class _GroupedLinearFunction(torch.autograd.Function):
    """Autograd shell: forward = quantize X + ``_fprop``; backward = quantize dY + ``_dgrad`` / ``_wgrad``."""

    @staticmethod
    def forward(ctx, x_TK: torch.Tensor, weight: torch.Tensor, bias_GN: torch.Tensor | None, group_list: torch.Tensor,
                w_ops: WeightOperands, numerics: GemmNumerics, context: GemmContext, grad_enabled: bool,
                main_grad: MainGradWrite | None) -> torch.Tensor:
        # needs_input_grad ignores no_grad mode; nothing is saved when no backward can run
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and ctx.needs_input_grad[1]
        x_row, x_col = quantize_pair(numerics, context, x_TK, Role.INPUT_FWD, Role.INPUT_BWD,
                                     group_list=group_list, need_col=need_dw)
        y_TN = _fprop(x_row, w_ops.row, group_list, bias_GN, x_TK.dtype)
        save_operands(ctx, [x_col, w_ops.col if need_dx else None])
        ctx.col_weight = weight if need_dx and w_ops.col is None else None  # quantized: col read in backward
        ctx.group_list, ctx.numerics, ctx.context = group_list, numerics, context
        ctx.x_dtype, ctx.weight_dtype = x_TK.dtype, weight.dtype
        ctx.bias_dtype = None if bias_GN is None else bias_GN.dtype
        ctx.device_type = x_TK.device.type
        ctx.main_grad, ctx.main_grad_weight = main_grad, weight if main_grad is not None and need_dw else None
        return y_TN

    @staticmethod
    def backward(ctx, dy_TN: torch.Tensor):
        with torch_autocast_off(ctx.device_type):
            return _GroupedLinearFunction._backward(ctx, dy_TN)

    @staticmethod
    def _backward(ctx, dy_TN: torch.Tensor):
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        x_col, w_col = load_operands(ctx)
        w_col = col_operand(w_col, ctx.col_weight)
        dy_row, dy_col = quantize_pair(ctx.numerics, ctx.context, dy_TN.contiguous(), Role.GRAD_OUTPUT,
                                       Role.GRAD_OUTPUT, group_list=ctx.group_list,
                                       need_row=need_dx, need_col=need_dw)
        dx_TK = _dgrad(dy_row, w_col, ctx.group_list, ctx.x_dtype) if need_dx else None
        if need_dw and ctx.main_grad is not None:  # TE's fuse_wgrad_accumulation: FP32 wgrad into main_grad
            dw_GNK = write_main_grad(ctx.main_grad_weight, _wgrad(dy_col, x_col, ctx.group_list, torch.float32),
                                     ctx.main_grad)
        else:
            dw_GNK = _wgrad(dy_col, x_col, ctx.group_list, ctx.weight_dtype) if need_dw else None
        db_GN = _bias_grad(dy_TN, ctx.group_list, ctx.bias_dtype) if need_db else None
        return dx_TK, dw_GNK, db_GN, None, None, None, None, None, None


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    m_splits: Sequence[int] | torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: Recipe,
    quantizers: Mapping[Role, Quantizer] | None = None,
    weight_cache: WeightCache | None = None,
    is_first_microbatch: bool | None = None,
    name: str | None = None,
    main_grad: MainGradWrite | None = None,
) -> torch.Tensor:
    """Per-group ``x_g @ weight[g].T`` with fprop, dgrad and wgrad in ``recipe``'s format.

    Args:
        x: ``[T, K]`` rows sorted by group.
        weight: ``[G, N, K]`` high-precision tensor or ``QuantizedWeightTensor``.
        m_splits: ``[G]`` row counts (list or int tensor) summing to T; zeros allowed.
        bias: ``[G, N]`` or None, kept in high precision: row group g adds ``bias[g]`` to the FP32
            GEMM result; dBias[g] is the FP32 sum of dY_g's rows.
        recipe, quantizers, weight_cache, is_first_microbatch, name, main_grad: as in
            :func:`te_npu.functional.linear`.
    Returns:
        ``[T, N]`` in ``x.dtype``; dX in x's dtype, dW ``[G, N, K]`` in the weight's dtype.
    Raises:
        LowPrecisionUnavailableError: MXFP8 with K or N not a multiple of 32, a quantized
            weight of another format, or a backend that cannot run the GEMM.
    """
    numerics = GemmNumerics.from_recipe(recipe, quantizers)
    g, n, k = weight.shape
    context = GemmContext(name or f"grouped_linear(weight [{g}, {n}, {k}])")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{context.name}: input must be [T, K={k}], got {list(x.shape)}")
    if k % numerics.block_size or n % numerics.block_size:
        raise unavailable(context, numerics, f"weight [G={g}, N={n}, K={k}]: K and N must be multiples of "
                                             f"{numerics.block_size} (blocks run along the reduction dims)")
    if bias is not None and list(bias.shape) != [g, n]:
        raise ValueError(f"{context.name}: bias must be [G={g}, N={n}], got {list(bias.shape)}")
    group_list = group_list_tensor(m_splits, g, x.shape[0], x.device)
    if main_grad is not None and torch.is_grad_enabled() and weight.requires_grad:
        require_main_grad(weight, context.name)
    if x.shape[0] == 0:  # no token rows in any group: an empty output, zero wgrad, no GEMM
        return no_tokens(x, weight, bias, main_grad)
    with torch_autocast_off(x.device.type):
        w_ops = weight_operands(weight, numerics, weight_cache, context, is_first_microbatch)
        return _GroupedLinearFunction.apply(x, weight, bias, group_list, w_ops, numerics, context,
                                            torch.is_grad_enabled(), main_grad)
