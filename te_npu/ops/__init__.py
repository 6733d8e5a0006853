"""Low-precision operators: GEMMs and quantization dispatched per device.

``npu`` tensors run torch_npu kernels (``te_npu.ops.npu``, imported lazily); everything else
runs the exact emulation (``te_npu.ops.emulation``). Device and version gates live only here.
"""
from te_npu.ops.capability import is_hif8_available, is_mxfp8_available, require_low_precision
from te_npu.ops.gemm import low_precision_grouped_matmul, low_precision_matmul
from te_npu.ops.observe import GemmEvent, QuantEvent, observe
from te_npu.ops.quantize import (
    hif8_quantize,
    hif8_quantize_with_scale,
    mxfp8_quantize,
    mxfp8_quantize_dual,
    mxfp8_quantize_grouped,
)
from te_npu.ops.registry import backend_for

__all__ = [
    "low_precision_matmul",
    "low_precision_grouped_matmul",
    "mxfp8_quantize",
    "mxfp8_quantize_dual",
    "mxfp8_quantize_grouped",
    "hif8_quantize",
    "hif8_quantize_with_scale",
    "observe",
    "GemmEvent",
    "QuantEvent",
    "backend_for",
    "is_mxfp8_available",
    "is_hif8_available",
    "require_low_precision",
]
