"""A GEMM call with no token rows (a micro-batch, or an expert block, with 0 tokens).

The output ``[0, N]`` is empty and so is dX; dW (and dBias) are sums over no row: zeros. Nothing
is quantized and no GEMM is launched, on every backend (the vendor kernels' handling of empty
operands is not part of their contracts). The checks of the call (shape rules, weight format,
capability gate) run before it, as for any call; ``main_grad`` gets its zero wgrad by the
ordinary rule (``+= 0``, or ``= 0`` when it is overwritten).
"""
from __future__ import annotations

import torch

from te_npu.functional.main_grad import MainGradWrite, write_main_grad

__all__ = ["no_tokens"]


class _NoTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int,
                main_grad: MainGradWrite | None) -> torch.Tensor:
        ctx.weight, ctx.bias_meta, ctx.main_grad = weight, None if bias is None else (bias.shape, bias.dtype), main_grad
        return x.new_empty((0, n))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        weight = ctx.weight
        dx = dy.new_empty((0, weight.shape[-1])) if need_dx else None
        dw = None
        if need_dw:
            zeros = torch.zeros(weight.shape, dtype=torch.float32 if ctx.main_grad else weight.dtype, device=dy.device)
            dw = write_main_grad(weight, zeros, ctx.main_grad) if ctx.main_grad else zeros
        db = torch.zeros(ctx.bias_meta[0], dtype=ctx.bias_meta[1], device=dy.device) if need_db else None
        return dx, dw, db, None, None


def no_tokens(x_MK: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              main_grad: MainGradWrite | None = None) -> torch.Tensor:
    """x: ``[0, K]``; weight ``[N, K]`` or ``[G, N, K]``; bias ``[N]`` / ``[G, N]`` -> ``[0, N]`` in x's dtype."""
    return _NoTokens.apply(x_MK, weight, bias, weight.shape[-2], main_grad)
