"""Quantized tensors: short-lived GEMM operands and persistent 8-bit weights."""
from te_npu.ops.operand import QuantizedOperand
from te_npu.tensor.weight import QuantizedWeightTensor, ShardAlignment, attach_high_precision_init_val
from te_npu.tensor.weight_ops import QuantizedWeightUpdateWarning  # registers the PyTorch-interop handlers
from te_npu.tensor.mxfp8_tensor import MXFP8Tensor
from te_npu.tensor.hif8_tensor import HiF8Tensor
from te_npu.tensor.factory import WEIGHT_TENSOR_BY_FORMAT, empty_quantized_weight, quantize_weight, weight_class
from te_npu.tensor.plain_state_dict import from_plain_state_dict, to_plain_state_dict

__all__ = [
    "QuantizedOperand",
    "QuantizedWeightTensor",
    "ShardAlignment",
    "QuantizedWeightUpdateWarning",
    "attach_high_precision_init_val",
    "MXFP8Tensor",
    "HiF8Tensor",
    "WEIGHT_TENSOR_BY_FORMAT",
    "quantize_weight",
    "empty_quantized_weight",
    "weight_class",
    "to_plain_state_dict",
    "from_plain_state_dict",
]
