"""TEGroupedLinear (one GEMM per group of rows) and TEGroupedSwiGLUExperts (MoE experts)."""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TEGroupedLinear", "TEGroupedSwiGLUExperts"]


def _split_sizes(m_splits: Sequence[int] | torch.Tensor) -> list[int]:
    return m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)


def _grouped_linear_reference(x: torch.Tensor, weight: torch.Tensor, m_splits) -> torch.Tensor:
    """x: ``[T, K]`` sorted by group; weight: ``[G, N, K]`` -> ``[T, N]``."""
    if hasattr(torch, "_grouped_mm") and x.is_cuda:
        offsets = torch.cumsum(torch.as_tensor(_split_sizes(m_splits), device=x.device), 0).to(torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    chunks = torch.split(x, _split_sizes(m_splits))
    return torch.cat([F.linear(chunk, weight[g]) for g, chunk in enumerate(chunks)])


class TEGroupedLinear(nn.Module):
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
        return _grouped_linear_reference(x, self.weight, m_splits)


class TEGroupedSwiGLUExperts(nn.Module):
    """MoE routed experts: ``down(silu(gate(x)) * up(x))`` per expert, Hugging Face layout.

    gate_up_proj: ``[E, 2F, H]`` (gate rows first, then up rows); down_proj: ``[E, H, F]``.
    """

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
        gate, up = _grouped_linear_reference(x, self.gate_up_proj, m_splits).chunk(2, dim=-1)
        return _grouped_linear_reference(F.silu(gate) * up, self.down_proj, m_splits)
