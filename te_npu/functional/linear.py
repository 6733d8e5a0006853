"""Dense low-precision linear: ``y = x @ weight.T + bias`` with all three GEMMs in 8 bits.

Spec sections 8 and 13.4. Legend: ``M`` tokens (all leading dims of ``x`` flattened),
``K`` in_features, ``N`` out_features.

=======  ========================  ===========================  ======  ==================
GEMM     left                      right                        layout  output
=======  ========================  ===========================  ======  ==================
fprop    X [M, K] row (input_fwd)  W [N, K] row (weight_fwd)    NT      Y [M, N], x dtype
dgrad    dY [M, N] row (grad_out)  W [N, K] col (weight_bwd)    NN      dX [M, K], x dtype
wgrad    dY [M, N] col (grad_out)  X [M, K] col (input_bwd)     TN      dW [N, K], w dtype
=======  ========================  ===========================  ======  ==================

Forward quantizes X once per orientation (MXFP8: row for fprop and a separate col copy for
wgrad, both from the high-precision X; HiF8: one copy serves both) and saves only the col
operand: never the BF16 input. The weight's col operand is saved by reference (the cached
or stored payload, not a copy). Backward quantizes dY for its row use (dgrad) and col use
(wgrad) (HiF8: once, gradient max 224). The bias stays high precision: it is added to the
FP32 GEMM result and its gradient is ``dY.sum(0)``.

MXFP8 shape rule: K and N must be multiples of 32 (blocks along the reduction dims), and so
must M when the weight needs a gradient, since the dense TN wgrad blocks dY and X along M.
A shape that breaks it raises ``LowPrecisionUnavailableError`` naming the module, the shape
and the reason, in forward, before anything runs: never a silent high-precision fallback.
(Grouped GEMMs have no M rule: their col blocks are ragged per group.) HiF8 has no shape rule.
"""
from __future__ import annotations

from typing import Mapping

import torch

from te_npu.formats import QuantizationRole as Role
from te_npu.functional.operands import (
    GemmContext,
    GemmNumerics,
    load_operands,
    quantize_pair,
    save_operands,
    unavailable,
)
from te_npu.functional.dtypes import torch_autocast_off
from te_npu.functional.main_grad import MainGradWrite, require_main_grad, write_main_grad
from te_npu.functional.no_tokens import no_tokens
from te_npu.functional.weight_cache import WeightCache, WeightOperands, col_operand, weight_operands
from te_npu.ops import low_precision_matmul
from te_npu.quantizers import Quantizer
from te_npu.recipe import Recipe
from te_npu.ops.operand import QuantizedOperand

__all__ = ["linear"]


def _fprop(x_row: QuantizedOperand, w_row: QuantizedOperand, bias: torch.Tensor | None,
           out_dtype: torch.dtype) -> torch.Tensor:
    """Y[M, N] = X[M, K] . W[N, K]^T (+ bias, added to the FP32 result)."""
    if bias is None:
        return low_precision_matmul(x_row, w_row, layout="NT", output_dtype=out_dtype)
    y_MN = low_precision_matmul(x_row, w_row, layout="NT", output_dtype=torch.float32)
    return y_MN.add_(bias.float()).to(out_dtype)


def _dgrad(dy_row: QuantizedOperand, w_col: QuantizedOperand, out_dtype: torch.dtype) -> torch.Tensor:
    """dX[M, K] = dY[M, N] . W[N, K]."""
    return low_precision_matmul(dy_row, w_col, layout="NN", output_dtype=out_dtype)


def _wgrad(dy_col: QuantizedOperand, x_col: QuantizedOperand, out_dtype: torch.dtype) -> torch.Tensor:
    """dW[N, K] = dY[M, N]^T . X[M, K]."""
    return low_precision_matmul(dy_col, x_col, layout="TN", output_dtype=out_dtype)


class _LinearFunction(torch.autograd.Function):
    """Autograd shell: forward = quantize X + ``_fprop``; backward = quantize dY + ``_dgrad`` / ``_wgrad``."""

    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                w_ops: WeightOperands, numerics: GemmNumerics, context: GemmContext,
                grad_enabled: bool, main_grad: MainGradWrite | None) -> torch.Tensor:
        # needs_input_grad ignores no_grad mode; nothing is saved when no backward can run
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and ctx.needs_input_grad[1]
        x_row, x_col = quantize_pair(numerics, context, x_MK, Role.INPUT_FWD, Role.INPUT_BWD, need_col=need_dw)
        y_MN = _fprop(x_row, w_ops.row, bias, x_MK.dtype)
        save_operands(ctx, [x_col, w_ops.col if need_dx else None])
        ctx.col_weight = weight if need_dx and w_ops.col is None else None  # quantized: col read in backward
        ctx.numerics, ctx.context = numerics, context
        ctx.x_dtype, ctx.weight_dtype = x_MK.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.device_type = x_MK.device.type
        ctx.main_grad, ctx.main_grad_weight = main_grad, weight if main_grad is not None and need_dw else None
        return y_MN

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):
        with torch_autocast_off(ctx.device_type):
            return _LinearFunction._backward(ctx, dy_MN)

    @staticmethod
    def _backward(ctx, dy_MN: torch.Tensor):
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        x_col, w_col = load_operands(ctx)
        w_col = col_operand(w_col, ctx.col_weight)
        dy_MN = dy_MN.contiguous()
        dy_row, dy_col = quantize_pair(ctx.numerics, ctx.context, dy_MN, Role.GRAD_OUTPUT, Role.GRAD_OUTPUT,
                                       need_row=need_dx, need_col=need_dw)
        dx_MK = _dgrad(dy_row, w_col, ctx.x_dtype) if need_dx else None
        if need_dw and ctx.main_grad is not None:  # TE's fuse_wgrad_accumulation: FP32 wgrad into main_grad
            dw_NK = write_main_grad(ctx.main_grad_weight, _wgrad(dy_col, x_col, torch.float32), ctx.main_grad)
        else:
            dw_NK = _wgrad(dy_col, x_col, ctx.weight_dtype) if need_dw else None
        db_N = dy_MN.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if need_db else None
        return dx_MK, dw_NK, db_N, None, None, None, None, None


def _check_shapes(numerics: GemmNumerics, context: GemmContext, x_shape, weight_shape, need_wgrad: bool) -> None:
    n, k = weight_shape
    m = 1
    for d in x_shape[:-1]:
        m *= d
    if x_shape[-1] != k:
        raise ValueError(f"{context.name}: input {list(x_shape)} does not match weight [out={n}, in={k}]")
    block = numerics.block_size
    where = f"input {list(x_shape)} (M={m} tokens), weight [N={n}, K={k}]"
    if k % block or n % block:
        raise unavailable(context, numerics, f"{where}: in_features K and out_features N must be multiples of "
                                             f"{block} (blocks run along the fprop and dgrad reduction dims)")
    if need_wgrad and m % block:
        raise unavailable(context, numerics, f"{where}: the dense wgrad dW = dY^T X blocks dY and X along the "
                                             f"token dim, so M must be a multiple of {block} when the weight "
                                             "needs a gradient (pad the batch, or run under no_grad)")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    recipe: Recipe,
    quantizers: Mapping[Role, Quantizer] | None = None,
    weight_cache: WeightCache | None = None,
    is_first_microbatch: bool | None = None,
    name: str | None = None,
    main_grad: MainGradWrite | None = None,
) -> torch.Tensor:
    """``y = x @ weight.T + bias`` with fprop, dgrad and wgrad in ``recipe``'s format.

    Args:
        x: ``[..., K]`` activation ([T, K] or [B, S, K]); y has x's dtype.
        weight: ``[N, K]`` high-precision tensor or ``QuantizedWeightTensor``; dW has its
            (logical) dtype: bf16 for a bf16 parameter, fp32 for an fp32 one.
        bias: ``[N]`` or None, kept in high precision.
        recipe: the 8-bit recipe (captured here; backward uses it even outside autocast).
        quantizers: role -> quantizer override (default: ``recipe.quantizers()``).
        weight_cache, is_first_microbatch: a high-precision weight is quantized on every call
            unless ``is_first_microbatch`` (TE's flag) is given: ``True`` quantizes into
            ``weight_cache``, ``False`` reuses what it holds (``te_npu.functional.weight_cache``).
        name: the module FQN, used in error messages and in the ``te_npu.events.OperandEvent`` s
            of every operand quantized for this call.
        main_grad: TE's ``fuse_wgrad_accumulation``: the wgrad GEMM's FP32 product goes into
            ``weight.main_grad`` this way (``te_npu.functional.main_grad``), not into a gradient.
    Returns:
        ``[..., N]`` in ``x.dtype``; ``torch.autocast`` does not reach the emulated GEMMs.
    Raises:
        LowPrecisionUnavailableError: the shape breaks the format's rule (see module doc),
            the weight is quantized in another format, or the backend cannot run the GEMM.
    """
    numerics = GemmNumerics.from_recipe(recipe, quantizers)
    n, k = weight.shape
    context = GemmContext(name or f"linear(weight [{n}, {k}])")
    need_wgrad = torch.is_grad_enabled() and weight.requires_grad
    _check_shapes(numerics, context, tuple(x.shape), (n, k), need_wgrad)
    if main_grad is not None and need_wgrad:
        require_main_grad(weight, context.name)
    if x.numel() == 0:  # no token rows: an empty output, zero wgrad, no GEMM
        return no_tokens(x.reshape(0, k), weight, bias, main_grad).reshape(*x.shape[:-1], n)
    with torch_autocast_off(x.device.type):
        w_ops = weight_operands(weight, numerics, weight_cache, context, is_first_microbatch)
        y_MN = _LinearFunction.apply(x.reshape(-1, k), weight, bias, w_ops, numerics, context,
                                     torch.is_grad_enabled(), main_grad)
    if x.dim() == 2:
        return y_MN
    # Like F.linear / matmul: y_MN is a fresh tensor nobody else holds, so hand out its
    # [..., N] shape as a new tensor rather than a view (a view output makes FSDP2 warn that
    # an in-place op on it would drop its pre-backward hook).
    return torch.ops.aten._unsafe_view(y_MN, [*x.shape[:-1], n])
