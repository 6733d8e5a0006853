"""Quantizers: one per format, built by recipes per role."""
from te_npu.quantizers.base import Quantizer
from te_npu.quantizers.hif8 import HiF8Quantizer
from te_npu.quantizers.mxfp8 import MXFP8Quantizer

__all__ = ["Quantizer", "MXFP8Quantizer", "HiF8Quantizer"]
