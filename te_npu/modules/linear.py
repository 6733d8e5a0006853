"""TELinear: ``y = x @ weight.T + bias``; 8-bit inside ``te_npu.autocast``, else parameter dtype."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TELinear"]


class TELinear(nn.Module):
    """Dense linear layer. weight: ``[out_features, in_features]``; bias: ``[out_features]``.

    Outside autocast it is ``F.linear`` in ``params_dtype`` (the BF16 baseline).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        params_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        init_method: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.init_method = init_method
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=params_dtype, device=device)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise with ``init_method`` (default: ``nn.Linear``'s Kaiming-uniform); bias to zero."""
        if self.weight.is_meta:
            return
        if self.init_method is not None:
            self.init_method(self.weight)
        else:
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[..., in_features]`` -> ``[..., out_features]``."""
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
