"""Independent reference for the 8-bit GEMMs, built only from ``te_npu.numerics``:
quantize each operand the way the GEMM contract says (blocked along the reduction dim),
decode it exactly, and multiply in FP32. It never calls te_npu.ops, quantizers or functional.

Tolerances: the library and this reference decode the same codes exactly; they differ only in
FP32 summation order and, for HiF8, in where the FP32 scale is applied (to the product there,
to the operands here). Results in FP32 agree to ``rtol=1e-5`` with ``atol = 1e-5 * max|ref|``
(``FP32_TOL``); BF16 results to one BF16 rounding (``rtol=2**-7``, ``BF16_TOL``).
"""
from __future__ import annotations

import pytest
import torch

from te_npu import HiF8CurrentScalingRecipe, MXFP8BlockRecipe
from te_npu.formats import Format
from te_npu.numerics import hif8, mxfp8
from te_npu.numerics.constants import HIF8_GRAD_MAX, HIF8_INPUT_MAX

RECIPES = [pytest.param(MXFP8BlockRecipe(), id="mxfp8"), pytest.param(HiF8CurrentScalingRecipe(), id="hif8")]


def fp32_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol = 1e-5 * max(float(expected.abs().max()), 1e-30)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-5, atol=atol)


def bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol = 2**-7 * max(float(expected.abs().max()), 1e-30) * 2**-4
    torch.testing.assert_close(actual.float(), expected.to(actual.dtype).float(), rtol=2**-7, atol=atol)


def dequant(t: torch.Tensor, fmt: Format, axis: int, *, grad: bool = False,
            group_sizes: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 value the GEMM sees for ``t`` blocked along ``axis`` (-1 row, -2 col).

    MXFP8: E4M3 + E8M0 per 32 along ``axis`` (ragged along dim 0 with ``group_sizes``).
    HiF8: one current scale (``[E]`` for a 3D weight), max 224 for gradients, else 15.
    """
    if fmt == Format.MXFP8_E4M3:
        if group_sizes is not None:
            data, scale = mxfp8.quantize_grouped(t, group_sizes)
            return mxfp8.dequantize_grouped(data, scale, group_sizes)
        data, scale = mxfp8.quantize(t, axis=axis)
        return mxfp8.dequantize(data, scale, axis=axis)
    amax = t.detach().abs().float().amax(dim=(1, 2)) if t.dim() == 3 else t.detach().abs().float().amax()
    scale = hif8.current_scale(amax, HIF8_GRAD_MAX if grad else HIF8_INPUT_MAX)
    return hif8.dequantize(hif8.quantize(t, scale), scale)


def dense_reference(x_MK, w_NK, dy_MN, fmt: Format):
    """(Y, dX, dW) in FP32 of fprop NT, dgrad NN, wgrad TN."""
    y = dequant(x_MK, fmt, -1) @ dequant(w_NK, fmt, -1).T
    dx = dequant(dy_MN, fmt, -1, grad=True) @ dequant(w_NK, fmt, -2)
    dw = dequant(dy_MN, fmt, -2, grad=True).T @ dequant(x_MK, fmt, -2)
    return y, dx, dw


def grouped_reference(x_TK, w_GNK, dy_TN, m_splits, fmt: Format):
    """(Y, dX, dW) in FP32 of the grouped fprop / dgrad / wgrad (ragged col blocks per group)."""
    sizes = torch.as_tensor(m_splits, dtype=torch.int64)
    xq_row, dyq_row = dequant(x_TK, fmt, -1), dequant(dy_TN, fmt, -1, grad=True)
    xq_col = dequant(x_TK, fmt, -2, group_sizes=sizes)
    dyq_col = dequant(dy_TN, fmt, -2, grad=True, group_sizes=sizes)
    w_row, w_col = dequant(w_GNK, fmt, -1), dequant(w_GNK, fmt, -2)
    ys, dxs, dws = [], [], []
    bounds = torch.cumsum(sizes, 0).tolist()
    for g, (end, size) in enumerate(zip(bounds, sizes.tolist())):
        rows = slice(end - size, end)
        ys.append(xq_row[rows] @ w_row[g].T)
        dxs.append(dyq_row[rows] @ w_col[g])
        dws.append(dyq_col[rows].T @ xq_col[rows])
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws)


def sqnr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |actual - ref|^2)."""
    noise = (actual.double() - reference.double()).pow(2).sum()
    return float(10 * torch.log10(reference.double().pow(2).sum() / noise.clamp_min(1e-300)))
