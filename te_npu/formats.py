"""Names shared by every layer: the 8-bit formats, the quantization roles and orientations.

Kept apart from ``recipe.py`` so that quantizers and tensors can name a format without
importing the recipes that build them (layering goes recipe -> quantizer -> tensor).
"""
from enum import Enum
from typing import Literal

Orientation = Literal["row", "col"]
"""Which axis an operand is blocked along, relative to its own layout.

``row``: along the last dim (``[M, K]`` blocked along K; ``[E, N, K]`` along K).
``col``: along the second-to-last dim (``[M, K]`` along M; ``[E, N, K]`` along N).
MXFP8 stores a different physical copy per orientation; HiF8 data is the same for both.
"""

Layout = Literal["NN", "NT", "TN"]
"""GEMM layout of ``left @ right``: first letter for left, second for right; T = transposed."""


class Format(str, Enum):
    """An 8-bit training format."""

    MXFP8_E4M3 = "mxfp8_e4m3"
    HIF8 = "hif8"


class QuantizationRole(str, Enum):
    """What a quantized operand is in the GEMM that consumes it (spec section 7.1)."""

    INPUT_FWD = "input_fwd"
    WEIGHT_FWD = "weight_fwd"
    GRAD_OUTPUT = "grad_output"
    INPUT_BWD = "input_bwd"
    WEIGHT_BWD = "weight_bwd"
