"""Megatron's ``weight.main_grad`` convention: TE's ``fuse_wgrad_accumulation=True``.

Megatron-core's DDP gives every parameter a ``main_grad`` buffer (FP32 unless
``grad_reduce_in_fp32`` is off) and builds TE modules with ``fuse_wgrad_accumulation=True``:
the wgrad GEMM then writes its product straight into ``weight.main_grad`` in that buffer's
dtype instead of returning a gradient (TE's ``_linear_backward``: ``out=main_grad``,
``out_dtype=main_grad.dtype``, ``accumulate=...``). Here the wgrad GEMM returns its FP32
product and :func:`write_main_grad` adds it in FP32 and rounds once into the buffer, which is
what a GEMM accumulating into its output computes (``D = A.B + C``, one rounding).

=========================================================  =======================================
when                                                       ``main_grad``
=========================================================  =======================================
``is_first_microbatch=True``, or ``weight.overwrite_main_grad``   ``= dW`` (overwritten)
otherwise (``None``, ``False``)                            ``+= dW``
=========================================================  =======================================

What autograd receives for the weight (TE's rule): when the weight carries Megatron's
``grad_added_to_main_grad`` flag, it is set True and a zero gradient of the weight's shape is
returned (TE returns an uninitialised dummy there; Megatron's hooks ignore it unless
``zero_out_wgrad``, for which TE returns zeros too); otherwise None, so ``weight.grad`` stays
untouched.

``plain_gemm_into_main_grad`` gives the high-precision (plain) paths the same behaviour: the
input and bias gradients come from the plain GEMM's own autograd, bit for bit as without the
option, and the wgrad is an FP32 product of the high-precision values written into ``main_grad``.
Legend: ``M`` rows, ``K`` in features, ``N`` out features, ``G`` groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from te_npu.ops.group_sizes import host_group_sizes

__all__ = ["MainGradWrite", "require_main_grad", "write_main_grad", "plain_gemm_into_main_grad"]


@dataclass(frozen=True)
class MainGradWrite:
    """How one forward's wgrad reaches ``weight.main_grad``: ``accumulate`` (``+=``) or overwrite."""

    accumulate: bool

    @classmethod
    def for_call(cls, is_first_microbatch: bool | None) -> "MainGradWrite":
        """TE's rule: the first micro-batch (``True``) overwrites, every other call accumulates."""
        return cls(accumulate=is_first_microbatch is not True)


def require_main_grad(weight: torch.Tensor, name: str) -> None:
    """Raise, at the forward, when ``weight`` has no ``main_grad`` of its shape to write into."""
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor) or list(main_grad.shape) != list(weight.shape):
        got = "none" if main_grad is None else f"{type(main_grad).__name__} {list(getattr(main_grad, 'shape', []))}"
        raise RuntimeError(
            f"{name}: fuse_wgrad_accumulation=True writes the weight gradient into weight.main_grad, which must be a "
            f"tensor of the weight's shape {list(weight.shape)} (got {got}); allocate it before the forward, as "
            "Megatron's DistributedDataParallel does, or build the module with fuse_wgrad_accumulation=False"
        )


def write_main_grad(weight: torch.Tensor, dw_fp32: torch.Tensor, write: MainGradWrite) -> torch.Tensor | None:
    """Put the FP32 wgrad ``dw_fp32`` into ``weight.main_grad`` (table above); returns the gradient
    autograd should give ``weight``."""
    main_grad = weight.main_grad
    accumulate = write.accumulate and not getattr(weight, "overwrite_main_grad", False)
    with torch.no_grad():
        if not accumulate:
            main_grad.copy_(dw_fp32)
        elif main_grad.dtype == torch.float32:
            main_grad.add_(dw_fp32)
        else:  # one rounding of the FP32 sum into the buffer's dtype
            main_grad.copy_(dw_fp32.add_(main_grad.float()))
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    return None


class _PlainGemmIntoMainGrad(torch.autograd.Function):
    """A plain GEMM ``gemm(x, bias)`` whose weight autograd does not see: its own autograd (run as a
    nested graph) gives dX and dBias, and backward writes the FP32 wgrad into ``weight.main_grad``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor, gemm: Callable,
                group_sizes: torch.Tensor | None, write: MainGradWrite) -> torch.Tensor:
        with torch.enable_grad():
            x_ = x.detach().requires_grad_(x.requires_grad)
            bias_ = None if bias is None else bias.detach().requires_grad_(bias.requires_grad)
            y_ = gemm(x_, bias_)
        ctx.graph = (x_, bias_, y_)
        ctx.weight, ctx.group_sizes, ctx.write = weight, group_sizes, write
        return y_.detach()

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_, bias_, y_ = ctx.graph
        ctx.graph = None
        wanted = [t for t in (x_, bias_) if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(y_, wanted, dy) if wanted and y_.requires_grad else ())
        dx = next(grads) if x_.requires_grad else None
        dbias = next(grads) if bias_ is not None and bias_.requires_grad else None
        dy_MN = dy.reshape(-1, dy.shape[-1]).float()
        x_MK = x_.detach().reshape(-1, x_.shape[-1]).float()
        if ctx.group_sizes is None:
            dw = dy_MN.T @ x_MK
        else:  # dW[g] = dY_g^T . X_g per group (zeros for an empty group)
            sizes = list(host_group_sizes(ctx.group_sizes))
            dw = torch.stack([d.T @ s for d, s in zip(dy_MN.split(sizes), x_MK.split(sizes))])
        return dx, dbias, write_main_grad(ctx.weight, dw, ctx.write), None, None, None


def plain_gemm_into_main_grad(gemm: Callable, x: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor,
                              write: MainGradWrite, group_sizes: torch.Tensor | None = None) -> torch.Tensor:
    """``gemm(x, bias)``, a high-precision GEMM with ``weight``'s values baked in (detached), whose
    backward gives dX and dBias exactly as ``gemm``'s own autograd and writes the FP32 wgrad of
    ``weight`` (``[N, K]``, or ``[G, N, K]`` with ``group_sizes`` ``[G]``) into ``weight.main_grad``.
    x: ``[..., K]``; returns ``[..., N]``."""
    return _PlainGemmIntoMainGrad.apply(x, bias, weight, gemm, group_sizes, write)
