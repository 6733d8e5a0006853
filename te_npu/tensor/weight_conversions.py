"""TE ``QuantizedTensor``'s conversions of a quantized weight to high precision, as a mixin of
``QuantizedWeightTensor`` (``transformer_engine/pytorch/quantized_tensor.py``: ``float()``,
``bfloat16()``, ``half()``, ``cpu()``, ``dequantize()``).

Each conversion returns a plain tensor of the logical values, also when the asked dtype is the
logical dtype (where ``torch.Tensor.to`` would return the weight itself), and is differentiable:
the gradient reaches the weight in its logical dtype. A device move alone (``to(device)``,
``module.to(device)``) is not a conversion: it keeps the 8-bit payload and the class (the
``_to_copy`` handler of ``te_npu.tensor.weight``). The values come from the weight's
``_values(dtype)`` (its format's decode).
"""
from __future__ import annotations

from typing import Any

import torch

from te_npu.compat import parse_to_args

__all__ = ["HighPrecisionConversions"]


class _Dequantize(torch.autograd.Function):
    """``w.dequantize(dtype)`` under autograd: the identity on the logical values."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        ctx.logical_dtype = weight.dtype
        return weight._values(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.logical_dtype), None


class HighPrecisionConversions:
    """``dequantize`` / ``float`` / ``bfloat16`` / ``half`` / ``double`` / ``cpu`` / ``numpy`` /
    ``to(dtype)`` of a quantized weight: plain high-precision tensors (module doc)."""

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:  # type: ignore[override]
        """High-precision value of the weight, a plain tensor of ``shape`` (logical dtype unless
        ``dtype`` is given); on the flat view (``view(-1)``: FSDP2, ``parameters_to_vector``) the
        weight's values flattened. Differentiable, as TE's: the gradient reaches the weight in its
        logical dtype."""
        if self.requires_grad and torch.is_grad_enabled():
            return _Dequantize.apply(self, dtype)
        return self._values(dtype)

    def float(self) -> torch.Tensor:  # type: ignore[override]
        """``dequantize(torch.float32)`` (also on an FP32-logical weight, as in TE)."""
        return self.dequantize(torch.float32)

    def bfloat16(self) -> torch.Tensor:  # type: ignore[override]
        """``dequantize(torch.bfloat16)``."""
        return self.dequantize(torch.bfloat16)

    def half(self) -> torch.Tensor:  # type: ignore[override]
        """``dequantize(torch.float16)``."""
        return self.dequantize(torch.float16)

    def double(self) -> torch.Tensor:  # type: ignore[override]
        """``dequantize(torch.float64)``."""
        return self.dequantize(torch.float64)

    def cpu(self, memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:  # type: ignore[override]
        """The dequantized weight on the CPU (a plain tensor: ``w.cpu().numpy()`` works); to move
        the 8-bit payload itself, ``w.to("cpu")``."""
        return self.dequantize().cpu(memory_format=memory_format)

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        """The dequantized weight as a NumPy array (logical dtype)."""
        return self.dequantize().numpy(force=force)

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        """``to(dtype)`` / ``to(device, dtype)`` / ``to(other)``: the dequantized weight in that
        dtype (a plain tensor, also when it is the logical dtype); a device move alone
        (``to(device)``, ``module.to(device)``) keeps the quantized payload and class."""
        device, dtype, non_blocking, _ = parse_to_args(*args, **dict(kwargs))
        if dtype is None:
            return super().to(*args, **kwargs)
        memory_format = kwargs.get("memory_format", torch.preserve_format)
        return self.dequantize(dtype).to(device=device, non_blocking=non_blocking, memory_format=memory_format)
