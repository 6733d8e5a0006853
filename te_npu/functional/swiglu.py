"""Grouped SwiGLU experts: ``down(silu(gate(x)) * up(x))`` per expert, GEMMs in 8 bits.

Legend: ``T`` rows (tokens x top-k, sorted by expert), ``E`` experts, ``H`` hidden size,
``F`` expert intermediate size. gate_up weight ``[E, 2F, H]`` (gate rows first, then up
rows, the Hugging Face stacked layout); down weight ``[E, H, F]``.

Order of the work:
forward:  gate_up fprop (GMM) -> SwiGLU (high precision) -> down fprop (GMM)
backward: down dgrad, down wgrad -> SwiGLU backward (high precision) -> gate_up dgrad, gate_up wgrad

The activation runs in the input's dtype with FP32 internals; it saves only the gate_up
output ``h [T, 2F]`` and recomputes ``sigmoid(gate)`` in backward.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from te_npu.formats import QuantizationRole
from te_npu.ops.group_sizes import host_group_sizes
from te_npu.functional.grouped_linear import grouped_linear
from te_npu.functional.weight_cache import WeightCache
from te_npu.quantizers import Quantizer
from te_npu.recipe import Recipe

__all__ = ["grouped_swiglu", "swiglu"]


class _SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up`` for ``h = [gate | up]`` along the last dim."""

    @staticmethod
    def forward(ctx, h_TF2: torch.Tensor) -> torch.Tensor:
        gate, up = h_TF2.float().chunk(2, dim=-1)
        ctx.save_for_backward(h_TF2)
        return (torch.nn.functional.silu(gate) * up).to(h_TF2.dtype)

    @staticmethod
    def backward(ctx, da_TF: torch.Tensor) -> torch.Tensor:
        (h_TF2,) = ctx.saved_tensors
        gate, up = h_TF2.float().chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        da = da_TF.float()
        d_up = da * gate * sig
        d_gate = da * up * sig * (1 + gate * (1 - sig))
        return torch.cat([d_gate, d_up], dim=-1).to(h_TF2.dtype)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``h: [..., 2F]`` -> ``silu(h[..., :F]) * h[..., F:]``, ``[..., F]``."""
    return _SwiGLUFunction.apply(h)


def grouped_swiglu(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    m_splits: Sequence[int] | torch.Tensor,
    *,
    recipe: Recipe,
    quantizers: Mapping[QuantizationRole, Quantizer] | None = None,
    weight_caches: tuple[WeightCache | None, WeightCache | None] = (None, None),
    is_first_microbatch: bool | None = None,
    name: str | None = None,
) -> torch.Tensor:
    """Routed SwiGLU experts with every GEMM in ``recipe``'s format.

    Args:
        x: ``[T, H]`` rows sorted by expert; m_splits: ``[E]`` rows per expert.
        gate_up_weight: ``[E, 2F, H]``; down_weight: ``[E, H, F]`` (high precision or quantized).
        weight_caches, is_first_microbatch: (gate_up, down) caches for high-precision weights
            and TE's caching flag, as in :func:`te_npu.functional.linear`.
        name: the module FQN; the two GEMMs are named ``<name>.gate_up_proj`` / ``<name>.down_proj``
            (error messages, ``te_npu.events.OperandEvent``).
    Returns:
        ``[T, H]`` in x's dtype.
    """
    name = name or "grouped_swiglu"
    if isinstance(m_splits, torch.Tensor):  # read once (one host sync at most) for both GMMs
        m_splits = host_group_sizes(m_splits)
    h_TF2 = grouped_linear(x, gate_up_weight, m_splits, recipe=recipe, quantizers=quantizers,
                           weight_cache=weight_caches[0], is_first_microbatch=is_first_microbatch,
                           name=f"{name}.gate_up_proj")
    a_TF = swiglu(h_TF2)
    return grouped_linear(a_TF, down_weight, m_splits, recipe=recipe, quantizers=quantizers,
                          weight_cache=weight_caches[1], is_first_microbatch=is_first_microbatch,
                          name=f"{name}.down_proj")
