"""TELinear: ``y = x @ weight.T + bias``; 8-bit inside ``te_npu.autocast``, else high precision."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from te_npu import functional as te_functional
from te_npu.functional.dtypes import activation_dtype
from te_npu.modules.base import TEModule

__all__ = ["TELinear"]


class TELinear(TEModule):
    """Dense linear layer. weight: ``[out_features, in_features]``; bias: ``[out_features]``.

    Inside ``te_npu.autocast(recipe=...)`` fprop, dgrad and wgrad run in the recipe's format
    (``te_npu.functional.linear``); the bias stays high precision. Outside autocast it is
    ``F.linear`` in high precision (the BF16 baseline); a quantized weight
    (``quantized_model_init`` / ``quantize_weights_``) then enters as ``weight.dequantize()``.
    Both paths compute in TE's activation dtype (``torch.autocast``'s when it is on, else the
    input's; ``te_npu.functional.dtypes``) and return it.

    ``return_bias=True`` (TE's option, what Megatron's ``skip_bias_add`` uses): the bias is not
    added; forward returns ``(out, bias)`` with the bias in the activation dtype (``None`` when
    the layer has no bias). ``state_dict`` keys: exactly ``weight`` (and ``bias``).
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
        return_bias: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.return_bias = return_bias
        self._init_parameters({"weight": (out_features, in_features), "bias": (out_features,) if bias else None},
                              params_dtype=params_dtype, device=device, init_method=init_method)

    def _default_init(self, weight: torch.Tensor) -> None:
        """``nn.Linear``'s Kaiming-uniform (the bias, if any, starts at zero)."""
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None):
        """x: ``[..., in_features]`` -> ``[..., out_features]`` (``(out, bias)`` with ``return_bias``).

        ``is_first_microbatch`` (TE's flag) only matters for a high-precision weight inside
        autocast: None quantizes it now, True quantizes and keeps it, False reuses the kept copy
        (``te_npu.functional.weight_cache``).
        """
        recipe = self.forward_recipe()
        dtype = activation_dtype(x)
        x = x if x.dtype == dtype else x.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        gemm_bias = None if self.return_bias else bias
        if recipe is None:
            out = F.linear(x, self._plain_weight("weight", dtype), gemm_bias)
        else:
            out = te_functional.linear(x, self.weight, gemm_bias,
                                       **self._gemm_kwargs(recipe, "weight", is_first_microbatch))
        self._forward_done(out, recipe)
        return (out, bias) if self.return_bias else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                + (", return_bias=True" if self.return_bias else ""))
