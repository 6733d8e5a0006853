"""TE modules: thin holders of parameters and quantizer metadata."""
from te_npu.modules.base import TEModule, assign_fqns
from te_npu.modules.grouped_linear import TEGroupedLinear, TEGroupedSwiGLUExperts
from te_npu.modules.linear import TELinear

__all__ = ["TEModule", "TELinear", "TEGroupedLinear", "TEGroupedSwiGLUExperts", "assign_fqns"]
