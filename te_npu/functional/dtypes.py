"""The compute dtype of a TE GEMM, and keeping ``torch.autocast`` out of the 8-bit emulation.

Transformer Engine's rule (``set_activation_dtype`` in its ``module/base.py``): inside
``torch.autocast`` a TE module computes in the autocast dtype (its input and weight are cast
to it, and it returns that dtype); otherwise in the input's dtype. te_npu follows it on both
paths, and outside ``torch.autocast`` also casts a high-precision weight of another dtype to
the input's dtype (TE raises a ``TypeError`` there): the 8-bit path has always accepted any
activation dtype (the weight is quantized whatever its storage dtype), so the plain path
now agrees with it instead of failing inside ``F.linear``.

The 8-bit emulation multiplies decoded operands with FP32 accumulation; ``torch.autocast``
would silently run those matmuls in bf16, so ``te_npu.functional`` turns it off around its
forward and backward (``torch_autocast_off``).
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["activation_dtype", "torch_autocast_off"]


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type torch.autocast does not know (e.g. meta)
        return False


def activation_dtype(x: torch.Tensor) -> torch.dtype:
    """``torch.autocast``'s dtype for ``x``'s device when it is on, else ``x.dtype``."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if _autocast_enabled(device_type) else x.dtype


def torch_autocast_off(device_type: str):
    """A context with ``torch.autocast`` disabled for ``device_type`` (a no-op when it is off)."""
    if _autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
