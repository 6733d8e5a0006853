"""TEGroupedLinear (one GEMM per group of rows) and TEGroupedSwiGLUExperts (MoE experts).

Inside ``te_npu.autocast(recipe=...)`` every GEMM (fprop, dgrad, wgrad) runs in the recipe's
format through ``te_npu.functional.grouped_linear`` / ``grouped_swiglu``; outside, the plain
path below (``_grouped_linear_reference``) computes in high precision (the BF16 baseline),
with quantized weights entering as ``weight.dequantize()``. Both paths compute in TE's
activation dtype (``te_npu.functional.dtypes``) and check ``m_splits`` the same way
(``G`` sizes, non-negative, summing to the rows of ``x``).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from te_npu import functional as te_functional
from te_npu.compat import grouped_mm, grouped_mm_available
from te_npu.functional.dtypes import activation_dtype
from te_npu.functional.operands import group_list_tensor
from te_npu.modules.base import TEModule
from te_npu.ops.group_sizes import host_group_sizes

__all__ = ["TEGroupedLinear", "TEGroupedSwiGLUExperts"]


def _checked_group_sizes(m_splits: Sequence[int] | torch.Tensor, num_groups: int, x: torch.Tensor) -> torch.Tensor:
    """int64 ``[G]`` row counts with their host mirror, checked exactly as the 8-bit path checks them."""
    return group_list_tensor(m_splits, num_groups, x.shape[0], x.device)


def _grouped_linear_reference(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """x: ``[T, K]`` sorted by group; weight: ``[G, N, K]`` (x's dtype); checked sizes ``[G]`` -> ``[T, N]``."""
    if grouped_mm_available() and x.device.type in ("cuda", "cpu"):
        offsets = torch.cumsum(group_sizes, 0).to(torch.int32)
        return grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    chunks = torch.split(x, list(host_group_sizes(group_sizes)))
    # unbind, not weight[g]: the backward of G selects would materialise G zero-filled [G, N, K]
    # gradients (64 experts at 16B shapes: ~100 GB of memset per step); unbind's is one stack.
    return torch.cat([F.linear(chunk, w_g) for chunk, w_g in zip(chunks, weight.unbind(0))])


class TEGroupedLinear(TEModule):
    """``num_gemms`` linear maps over consecutive row groups. weight: ``[num_gemms, out, in]``."""

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        params_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        init_method: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        super().__init__()
        if bias:
            raise ValueError("TEGroupedLinear: bias=True is not supported (MoE experts carry no bias)")
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self._init_parameters({"weight": (num_gemms, out_features, in_features)},
                              params_dtype=params_dtype, device=device, init_method=init_method)

    def _default_init(self, weight: torch.Tensor) -> None:
        """Per-expert Kaiming-uniform: U(-1/sqrt(in), 1/sqrt(in))."""
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor,
                is_first_microbatch: bool | None = None) -> torch.Tensor:
        """x: ``[T, in]`` rows sorted by group, ``m_splits`` ``[G]`` summing to T -> ``[T, out]``.

        ``is_first_microbatch``: TE's weight-caching flag (see ``TELinear.forward``).
        """
        recipe = self.forward_recipe()
        dtype = activation_dtype(x)
        x = x if x.dtype == dtype else x.to(dtype)
        if recipe is None:
            out = _grouped_linear_reference(x, self._plain_weight("weight", dtype),
                                            _checked_group_sizes(m_splits, self.num_gemms, x))
        else:
            out = te_functional.grouped_linear(x, self.weight, m_splits,
                                               **self._gemm_kwargs(recipe, "weight", is_first_microbatch))
        self._forward_done(out, recipe)
        return out

    def extra_repr(self) -> str:
        return f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}"


class TEGroupedSwiGLUExperts(TEModule):
    """MoE routed experts: ``down(silu(gate(x)) * up(x))`` per expert, Hugging Face layout.

    Its two GEMMs are named ``<fqn>.gate_up_proj`` and ``<fqn>.down_proj`` (errors, events).

    gate_up_proj: ``[E, 2F, H]`` (gate rows first, then up rows); down_proj: ``[E, H, F]``.
    """

    _weight_names = ("gate_up_proj", "down_proj")

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        params_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        init_method: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self._init_parameters(
            {"gate_up_proj": (num_experts, 2 * intermediate_size, hidden_size),
             "down_proj": (num_experts, hidden_size, intermediate_size)},
            params_dtype=params_dtype, device=device, init_method=init_method,
        )

    def _default_init(self, weight: torch.Tensor) -> None:
        """normal(0, 0.02), for both stacks."""
        nn.init.normal_(weight, std=0.02)

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor,
                is_first_microbatch: bool | None = None) -> torch.Tensor:
        """x: ``[T, H]`` rows sorted by expert, ``m_splits`` ``[E]`` -> ``[T, H]``.

        ``is_first_microbatch``: TE's weight-caching flag (see ``TELinear.forward``).
        """
        recipe = self.forward_recipe()
        dtype = activation_dtype(x)
        x = x if x.dtype == dtype else x.to(dtype)
        if recipe is None:
            group_sizes = _checked_group_sizes(m_splits, self.num_experts, x)  # read once for both GEMMs
            gate, up = _grouped_linear_reference(x, self._plain_weight("gate_up_proj", dtype),
                                                 group_sizes).chunk(2, dim=-1)
            out = _grouped_linear_reference(F.silu(gate) * up, self._plain_weight("down_proj", dtype), group_sizes)
        else:
            kwargs = self._gemm_kwargs(recipe, "gate_up_proj", is_first_microbatch)
            kwargs["weight_caches"] = (kwargs.pop("weight_cache"), self._weight_caches["down_proj"])
            out = te_functional.grouped_swiglu(x, self.gate_up_proj, self.down_proj, m_splits, **kwargs)
        self._forward_done(out, recipe)
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}")
