"""Low-precision operators: GEMMs and quantization dispatched per device.

``npu`` tensors run torch_npu kernels (``te_npu.ops.npu``, imported lazily); everything else
runs the exact emulation (``te_npu.ops.emulation``); ``force_backend("npu")`` routes every call
through the NPU wrappers whatever the device (tests). Device and version gates live only here.
The emulation's quantization / decode kernels are one interface with three bit-identical
variants (``te_npu.ops.kernels``), chosen once per run: ``use_quant_kernel("native")``.
``QuantizedOperand`` (the GEMM input type) lives here too; layering is one-way: quantizers and
tensors import ops, never the reverse.
"""
from te_npu.ops.capability import is_hif8_available, is_mxfp8_available, require_low_precision
from te_npu.ops.gemm import low_precision_grouped_matmul, low_precision_matmul
from te_npu.ops.kernels import KERNELS, active_quant_kernels, use_quant_kernel
from te_npu.ops.operand import QuantizedOperand
from te_npu.ops.quantize import (
    hif8_quantize,
    hif8_quantize_with_scale,
    mxfp8_quantize,
    mxfp8_quantize_dual,
    mxfp8_quantize_grouped,
    quantize_hif8,
    quantize_hif8_with_scale,
    quantize_mxfp8,
    quantize_mxfp8_dual,
)
from te_npu.ops.registry import backend_for, force_backend
from te_npu.ops.te_availability import (
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_nvfp4_available,
)

__all__ = [
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_nvfp4_available",
    "is_bf16_available",
    "QuantizedOperand",
    "low_precision_matmul",
    "low_precision_grouped_matmul",
    "mxfp8_quantize",
    "mxfp8_quantize_dual",
    "mxfp8_quantize_grouped",
    "hif8_quantize",
    "hif8_quantize_with_scale",
    "quantize_mxfp8",
    "quantize_mxfp8_dual",
    "quantize_hif8",
    "quantize_hif8_with_scale",
    "force_backend",
    "use_quant_kernel",
    "active_quant_kernels",
    "KERNELS",
    "backend_for",
    "is_mxfp8_available",
    "is_hif8_available",
    "require_low_precision",
]
