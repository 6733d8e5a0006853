"""Quantized tensors: short-lived GEMM operands and persistent 8-bit weights."""
from te_npu.ops.operand import QuantizedOperand
from te_npu.tensor.weight import QuantizedWeightTensor
from te_npu.tensor.mxfp8_tensor import MXFP8Tensor
from te_npu.tensor.hif8_tensor import HiF8Tensor
from te_npu.tensor.factory import WEIGHT_TENSOR_BY_FORMAT, quantize_weight

__all__ = [
    "QuantizedOperand",
    "QuantizedWeightTensor",
    "MXFP8Tensor",
    "HiF8Tensor",
    "WEIGHT_TENSOR_BY_FORMAT",
    "quantize_weight",
]
