"""Autograd functions of the 8-bit GEMM families: dense ``linear``, ``grouped_linear`` and
``grouped_swiglu`` (MoE experts). Each runs fprop, dgrad and wgrad in the recipe's format."""
from te_npu.functional.grouped_linear import grouped_linear
from te_npu.functional.linear import linear
from te_npu.functional.operands import GemmNumerics
from te_npu.functional.swiglu import grouped_swiglu, swiglu
from te_npu.functional.weight_cache import WeightCache, high_precision_weight

__all__ = [
    "linear",
    "grouped_linear",
    "grouped_swiglu",
    "swiglu",
    "GemmNumerics",
    "WeightCache",
    "high_precision_weight",
]
