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

from te_npu.errors import LowPrecisionUnavailableError
from te_npu.ops.checks import OUTPUT_DTYPES as LOW_PRECISION_OUTPUT_DTYPES

__all__ = ["activation_dtype", "torch_autocast_off"]


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type torch.autocast does not know (e.g. meta)
        return False


def activation_dtype(x: torch.Tensor, name: str | None = None, *, low_precision: bool = False) -> torch.dtype:
    """``torch.autocast``'s dtype for ``x``'s device when it is on, else ``x.dtype``.

    Checked for the module ``name``: an input that is not floating point raises ``TypeError``
    (casting it would silently truncate the weight to integers); ``low_precision``: an 8-bit
    GEMM returns float32, bfloat16 or float16 only, so a float64 activation there raises
    ``LowPrecisionUnavailableError`` (the plain path computes in float64).
    """
    where = name or "TE module"
    if not x.dtype.is_floating_point:
        raise TypeError(f"{where}: input dtype {x.dtype} (shape {list(x.shape)}) is not a floating-point type; "
                        "TE modules take float32, bfloat16 or float16 activations")
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if _autocast_enabled(device_type) else x.dtype
    if low_precision and dtype not in LOW_PRECISION_OUTPUT_DTYPES:
        raise LowPrecisionUnavailableError(
            f"{where}: an 8-bit GEMM returns {', '.join(str(d) for d in LOW_PRECISION_OUTPUT_DTYPES)}, not the "
            f"activation dtype {dtype} of the input {list(x.shape)}; cast the input, or run outside te_npu.autocast")
    return dtype


def torch_autocast_off(device_type: str):
    """A context with ``torch.autocast`` disabled for ``device_type`` (a no-op when it is off)."""
    if _autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
