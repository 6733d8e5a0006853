"""Model-agnostic MoE token dispatch for grouped GEMMs: ``permute`` / ``unpermute``."""
from te_npu.moe.dispatch import permute, unpermute

__all__ = ["permute", "unpermute"]
