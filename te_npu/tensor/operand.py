"""``te_npu.tensor.operand.QuantizedOperand``: an alias of :class:`te_npu.ops.operand.QuantizedOperand`,
the GEMM input type (it moved to the ops level; this name stays for existing imports)."""
from te_npu.ops.operand import QuantizedOperand

__all__ = ["QuantizedOperand"]
