"""TEGroupedLinear (one GEMM per group of rows) and TEGroupedSwiGLUExperts (MoE experts).

Inside ``te_npu.autocast(recipe=...)`` every GEMM (fprop, dgrad, wgrad) runs in the recipe's
format through ``te_npu.functional.grouped_linear`` / ``grouped_swiglu``; outside, the plain
path below (``_grouped_linear_reference``) computes in the parameter dtype (the BF16
baseline), with quantized weights entering as ``weight.dequantize()``.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from te_npu import functional as te_functional
from te_npu.modules.base import TEModule
from te_npu.numerics.groups import group_sizes_tensor, host_group_sizes

__all__ = ["TEGroupedLinear", "TEGroupedSwiGLUExperts"]


def _split_sizes(m_splits: Sequence[int] | torch.Tensor) -> list[int]:
    """Host ints of ``m_splits`` (a tensor's mirror, or one read of its values)."""
    return list(host_group_sizes(m_splits)) if isinstance(m_splits, torch.Tensor) else list(m_splits)


def _grouped_linear_reference(x: torch.Tensor, weight: torch.Tensor, m_splits) -> torch.Tensor:
    """x: ``[T, K]`` sorted by group; weight: ``[G, N, K]`` -> ``[T, N]``."""
    if hasattr(torch, "_grouped_mm") and x.device.type in ("cuda", "cpu") and x.dtype == weight.dtype:
        offsets = torch.cumsum(group_sizes_tensor(_split_sizes(m_splits), x.device), 0).to(torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    chunks = torch.split(x, _split_sizes(m_splits))
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
        self.init_method = init_method
        self.weight = nn.Parameter(torch.empty(num_gemms, out_features, in_features, dtype=params_dtype, device=device))
        self.reset_parameters()
        self._finish_init()

    def reset_parameters(self) -> None:
        """Initialise with ``init_method`` or per-expert Kaiming-uniform."""
        if self.weight.is_meta:
            return
        if self.init_method is not None:
            self.init_method(self.weight)
        else:
            bound = 1.0 / math.sqrt(self.in_features)
            nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """x: ``[T, in]`` rows sorted by group, ``m_splits`` ``[G]`` summing to T -> ``[T, out]``."""
        recipe = self.forward_recipe()
        if recipe is None:
            return _grouped_linear_reference(x, te_functional.high_precision_weight(self.weight), m_splits)
        return te_functional.grouped_linear(x, self.weight, m_splits, **self._gemm_kwargs(recipe))

    def extra_repr(self) -> str:
        return f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}"


class TEGroupedSwiGLUExperts(TEModule):
    """MoE routed experts: ``down(silu(gate(x)) * up(x))`` per expert, Hugging Face layout.

    ``quant_stats`` holds one role -> stats dict per GEMM: ``{"gate_up": {...}, "down": {...}}``.

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
        self.init_method = init_method
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=params_dtype, device=device)
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=params_dtype, device=device)
        )
        self.reset_parameters()
        self._finish_init()

    def reset_parameters(self) -> None:
        """Initialise both stacks with ``init_method`` (default normal(0, 0.02))."""
        if self.gate_up_proj.is_meta:
            return
        for weight in (self.gate_up_proj, self.down_proj):
            if self.init_method is not None:
                self.init_method(weight)
            else:
                nn.init.normal_(weight, std=0.02)

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """x: ``[T, H]`` rows sorted by expert, ``m_splits`` ``[E]`` -> ``[T, H]``."""
        recipe = self.forward_recipe()
        if recipe is None:
            m_splits = _split_sizes(m_splits)  # read once for both GEMMs
            gate_up = te_functional.high_precision_weight(self.gate_up_proj)
            gate, up = _grouped_linear_reference(x, gate_up, m_splits).chunk(2, dim=-1)
            return _grouped_linear_reference(F.silu(gate) * up, te_functional.high_precision_weight(self.down_proj),
                                             m_splits)
        kwargs = self._gemm_kwargs(recipe, "gate_up_proj")
        kwargs["weight_caches"] = (kwargs.pop("weight_cache"), self._weight_caches["down_proj"])
        return te_functional.grouped_swiglu(x, self.gate_up_proj, self.down_proj, m_splits, **kwargs)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}")
