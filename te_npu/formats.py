"""Names shared by every layer: the 8-bit formats, the quantization roles and orientations, and
each format's rules (:class:`FormatSpec`, looked up with :func:`spec`).

Kept apart from ``recipe.py`` so that quantizers and tensors can name a format without
importing the recipes that build them (layering goes recipe -> quantizer -> tensor).
"""
import math
from dataclasses import dataclass
from enum import Enum
from typing import Literal

import torch

from te_npu.numerics import hif8
from te_npu.numerics.constants import E4M3_MAX, HIF8_MAX

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
    """What a quantized operand is in the GEMM that consumes it."""

    INPUT_FWD = "input_fwd"
    WEIGHT_FWD = "weight_fwd"
    GRAD_OUTPUT = "grad_output"
    INPUT_BWD = "input_bwd"
    WEIGHT_BWD = "weight_bwd"


# ---------------------------------------------------------------- per-format spec
# Declared once per format, looked up with ``spec(format)``: what an operand's scale covers, how
# its tensors are typed, and the torch_npu arguments that name it. Code that needs a format's
# rule reads it here instead of re-deriving it from a tensor's rank or branching on the format.

ScaleLayout = Literal["canonical", "npu"]
"""Layout of an operand's scale tensor.

``canonical``: te_npu's own, blocked axis divided by the block size (MXFP8 row
``[..., M, K/32]``, col ``[..., M/32, N]``, ragged col ``[num_blocks, K]``), read by the emulation
and for inspection. ``npu``: the Ascend kernels' own (block pairs in a trailing dim of 2, see
``te_npu.ops.layouts``), produced by the torch_npu quantization kernels and fed to the GEMMs as is.
Per-tensor formats have one layout (``canonical``).
"""


@dataclass(frozen=True)
class NpuFormatArgs:
    """How torch_npu names a format: attribute names on the ``torch_npu`` module (None: not sent).

    data_dtype: the ``x1_dtype``/``x2_dtype`` (dense) and ``x_dtype``/``weight_dtype`` (grouped)
    of GEMMs whose payload is a uint8 bit container (HiF8: ``hifloat8``); None when the torch
    dtype says it (E4M3). scale_dtype: the ``scale_dtype``/``pertoken_scale_dtype`` of GEMMs whose
    scales are uint8 containers (MXFP8: ``float8_e8m0fnu``); None for FP32 scales.
    group_sizes: ``npu_quant_matmul(group_sizes=...)`` ``[group_m, group_n, group_k]`` of a block
    format (MX: ``[1, 1, 32]``), None otherwise.
    """

    data_dtype: str | None
    scale_dtype: str | None
    group_sizes: tuple[int, int, int] | None


@dataclass(frozen=True)
class FormatSpec:
    """The rules of one 8-bit format.

    data_dtype / scale_dtype: operand payload and scale dtypes (MXFP8: ``float8_e4m3fn`` data,
    uint8 E8M0 codes; HiF8: uint8 codes, FP32 scale). block_size: elements per scale along the
    GEMM reduction dim (32), or None for a per-tensor scale. A block format's scales live inside
    the reduction (folded into each operand), so every operand must be blocked along its GEMM's
    reduction dim and needs a copy per orientation; a per-tensor format's scale multiplies the
    GEMM product, and one copy serves both orientations. per_expert_scale: a 3D ``[E, N, K]``
    tensor of a per-tensor format carries one scale per expert (leading index). element_max: the
    largest finite magnitude of one 8-bit element before its scale (a source value above
    ``element_max * scale`` is clipped: saturated, or Inf for HiF8 past its overflow threshold).
    """

    format: Format
    data_dtype: torch.dtype
    scale_dtype: torch.dtype
    block_size: int | None
    per_expert_scale: bool
    npu: NpuFormatArgs
    element_max: float

    @property
    def blocked(self) -> bool:
        """Whether scales cover blocks along the reduction dim (else one scale per tensor)."""
        return self.block_size is not None

    @property
    def one_copy_for_both_orientations(self) -> bool:
        """Whether one quantization serves row and col uses (per-tensor scale: the codes do not
        depend on the blocking direction)."""
        return not self.blocked

    def scale_groups(self, ndim: int) -> int:
        """How many leading dims index separate scales of a per-tensor format: 1 for a 3D
        ``[E, N, K]`` tensor with ``per_expert_scale``, else 0 (one scale for the tensor)."""
        return 1 if self.per_expert_scale and ndim == 3 else 0

    def amax(self, tensor: torch.Tensor) -> torch.Tensor:
        """FP32 amax of each scale group of a per-tensor format: ``[]`` for a 1D/2D tensor,
        ``[E]`` for a per-expert 3D ``[E, N, K]`` one (all dims but the experts). Detached;
        a NaN anywhere in a group makes its amax NaN (and so its current scale 1.0)."""
        return hif8.amax(tensor, per_group=self.scale_groups(tensor.dim()) == 1)

    def canonical_scale_shape(self, shape, orientation: str, num_blocks: int | None = None) -> tuple[int, ...]:
        """Canonical scale shape of an operand with data ``shape``.

        Block formats: ``row`` ``shape[:-1] + (ceil(K/bs),)``; ``col`` ``shape[:-2] + (ceil(M/bs), N)``;
        a ragged col operand (``num_blocks`` given) ``(num_blocks, K)``. Per-tensor formats:
        ``(E,)`` for a per-expert 3D tensor, else ``()``.
        """
        shape = tuple(shape)
        if not self.blocked:
            return shape[: self.scale_groups(len(shape))]
        if num_blocks is not None:
            return (num_blocks, shape[-1])
        if orientation == "row":
            return shape[:-1] + (math.ceil(shape[-1] / self.block_size),)
        return shape[:-2] + (math.ceil(shape[-2] / self.block_size), shape[-1])


_SPECS = {
    Format.MXFP8_E4M3: FormatSpec(
        format=Format.MXFP8_E4M3,
        data_dtype=torch.float8_e4m3fn,
        scale_dtype=torch.uint8,
        block_size=32,  # OCP MX v1.0 (te_npu.numerics.constants.MX_BLOCK_SIZE)
        per_expert_scale=False,  # blocks: a 3D weight is blocked per expert matrix anyway
        npu=NpuFormatArgs(data_dtype=None, scale_dtype="float8_e8m0fnu", group_sizes=(1, 1, 32)),
        element_max=E4M3_MAX,
    ),
    Format.HIF8: FormatSpec(
        format=Format.HIF8,
        data_dtype=torch.uint8,
        scale_dtype=torch.float32,
        block_size=None,
        per_expert_scale=True,
        npu=NpuFormatArgs(data_dtype="hifloat8", scale_dtype=None, group_sizes=None),
        element_max=HIF8_MAX,
    ),
}


def spec(fmt: "Format | str") -> FormatSpec:
    """The :class:`FormatSpec` of ``fmt`` (a ``Format`` or its value string)."""
    return _SPECS[Format(fmt)]
