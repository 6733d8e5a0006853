"""Bit-exact MXFP8 / HiF8 numerics: pure tensor -> tensor functions, no state."""
from te_npu.numerics import constants, hif8, mxfp8

__all__ = ["constants", "hif8", "mxfp8"]
