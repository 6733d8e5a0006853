"""TELinear: ``y = x @ weight.T + bias``; 8-bit inside ``te_npu.autocast``, else parameter dtype."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from te_npu import functional as te_functional
from te_npu.modules.base import TEModule

__all__ = ["TELinear"]


class TELinear(TEModule):
    """Dense linear layer. weight: ``[out_features, in_features]``; bias: ``[out_features]``.

    Inside ``te_npu.autocast(recipe=...)`` fprop, dgrad and wgrad run in the recipe's format
    (``te_npu.functional.linear``); the bias stays high precision. Outside autocast it is
    ``F.linear`` in ``params_dtype`` (the BF16 baseline); a quantized weight
    (``quantized_model_init`` / ``quantize_weights_``) then enters as ``weight.dequantize()``.
    ``state_dict`` keys: exactly ``weight`` (and ``bias``).
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
        self._finish_init()

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
        recipe = self.forward_recipe()
        if recipe is None:
            return F.linear(x, te_functional.high_precision_weight(self.weight), self.bias)
        return te_functional.linear(x, self.weight, self.bias, **self._gemm_kwargs(recipe))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
