"""``HiF8Tensor``: a weight stored as HiFloat8 codes with an FP32 current scale.

Shape legend: ``N`` = out features, ``K`` = in features, ``E`` = experts.

    qdata  uint8 HiF8 codes [N, K] or [E, N, K]
    scale  float32          []     or [E]        (value = decode(qdata) * scale)

The codes are called ``qdata`` (as in torchao's MXTensor), not ``data``: ``torch.Tensor.data``
is the detached-alias property every tensor has, and shadowing it would break
``nn.Module`` / optimizer code that reads ``param.data``.

The scale is per tensor (per expert for 3D), independent of row/col blocking, so there is
one copy of the data: ``select("row")`` and ``select("col")`` return the same tensors and
differ only in the operand's orientation (the GEMM reads it transposed or not).

Dim-0 slicing (FSDP2 shards dim 0): 2D qdata splits by rows and every chunk *shares* the one
scalar scale tensor (a view, like the data); the FSDP2 extension gathers it replicated and
checks that ranks agree. 3D qdata and ``scale[E]`` split together along experts.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from te_npu.formats import Format, Orientation, spec
from te_npu.numerics import hif8
from te_npu.numerics.constants import HIF8_INPUT_MAX
from te_npu.quantizers.hif8 import HiF8Quantizer, hif8_amax
from te_npu.ops.operand import QuantizedOperand
from te_npu.tensor.weight import QuantizedWeightTensor, ShardAlignment

__all__ = ["HiF8Tensor"]


class HiF8Tensor(QuantizedWeightTensor):
    """Persistent HiF8 weight ``[N, K]`` (scalar scale) or ``[E, N, K]`` (per-expert scale)."""

    _inner_fields: ClassVar[tuple[str, ...]] = ("qdata", "scale")
    _handlers: ClassVar[dict] = {}  # format-specific aten handlers (none yet); base table applies
    quantizer_type: ClassVar[type] = HiF8Quantizer
    format: ClassVar[Format] = Format.HIF8
    shard_alignment: ClassVar[ShardAlignment] = ShardAlignment(
        rows=1, reason="any row: one scale per tensor (agreed across shards) or per whole expert",
        cols=1, cols_reason="any column of a 2D weight: its one scalar scale is shared by every shard",
    )

    qdata: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def from_high_precision(
        cls,
        w: torch.Tensor,
        quantizer: HiF8Quantizer | None = None,
        *,
        scale: torch.Tensor | None = None,
        requires_grad: bool = False,
    ) -> "HiF8Tensor":
        """Quantize ``w: [N, K]`` or ``[E, N, K]``; current scaling unless ``scale`` ([] / [E]) is given.

        The default quantizer targets ``HIF8_INPUT_MAX`` (15.0), the weight role's maximum.
        """
        quantizer = quantizer or HiF8Quantizer(HIF8_INPUT_MAX)
        if w.dim() not in (2, 3):
            raise ValueError(f"HiF8Tensor: expected a 2D [N, K] or 3D [E, N, K] weight, got shape {list(w.shape)}")
        operand = _quantize(quantizer, w.detach(), scale)
        inner = {"qdata": operand.data, "scale": operand.scale.to(torch.float32).clone()}
        return cls._make(inner, shape=w.shape, logical_dtype=w.dtype, quantizer=quantizer, requires_grad=requires_grad)

    @classmethod
    def _inner_layout(cls, shape: tuple[int, ...], quantizer: HiF8Quantizer) -> dict:
        """Codes ``uint8`` of the weight's shape and an FP32 scale ``[]`` (2D) or ``[E]`` (3D)."""
        if len(shape) not in (2, 3):
            raise ValueError(f"HiF8Tensor: expected a 2D [N, K] or 3D [E, N, K] weight, got shape {list(shape)}")
        return {"qdata": (tuple(shape), torch.uint8), "scale": (tuple(shape[:1]) if len(shape) == 3 else (), torch.float32)}

    def _check_inner(self) -> None:
        shape = list(self.weight_shape)
        want_scale = shape[:1] if len(shape) == 3 else []
        if len(shape) not in (2, 3) or self.qdata.dtype != torch.uint8:
            raise ValueError(f"HiF8Tensor.qdata: expected uint8 [N, K] or [E, N, K], got {self.qdata.dtype}{shape}")
        if list(self.scale.shape) != want_scale or self.scale.dtype != torch.float32:
            raise ValueError(
                f"HiF8Tensor.scale: expected float32{want_scale} for weight {shape}, "
                f"got {self.scale.dtype}{list(self.scale.shape)}"
            )

    def select(self, orientation: Orientation) -> QuantizedOperand:  # type: ignore[override]
        """The one stored payload, labelled ``row`` or ``col`` (same data and scale tensors)."""
        self._require_weight_shape("select")
        if orientation not in ("row", "col"):
            raise ValueError(
                f"HiF8Tensor.select: orientation must be 'row' or 'col', got {orientation!r} "
                "(torch.Tensor.select(dim, index) is not available on quantized weights)"
            )
        return QuantizedOperand(self.qdata, self.scale, self.dtype, self.format, orientation)

    def _dequantize_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``decode(qdata) * scale`` in ``dtype`` (default: the logical dtype)."""
        return hif8.dequantize(self.qdata, self.scale).to(dtype or self.dtype)

    def shared_scale_amax(self, master_shard: torch.Tensor) -> torch.Tensor | None:
        """Dense ``[N, K]``: the shard's FP32 amax (``[]``), toward the weight's one scalar scale;
        grouped ``[E, N, K]``: None (each whole expert in the shard has its own scale)."""
        if spec(self.format).scale_groups(self.dim()):
            return None
        return hif8_amax(master_shard.detach())

    def refresh_from_master(self, master_shard: torch.Tensor, *, amax: torch.Tensor | None = None) -> None:
        """Re-quantize from ``master_shard`` (same shape) into the existing data and scale.

        Dense ``[N, K]`` (one scalar scale for the whole weight): ``amax`` (the FSDP-group MAX of
        the shards' ``shared_scale_amax``; None: this shard's own) gives the scale
        ``amax * (1 / format_max)`` every shard quantizes with, so the gathered weight equals
        quantizing the full weight; that amax is reported to quantization observers. Grouped
        ``[E, N, K]``: each whole expert in the shard has its own current scale; an ``amax`` is
        refused.
        """
        self._require_weight_shape("refresh_from_master")
        if list(master_shard.shape) != list(self.shape):
            raise ValueError(f"refresh_from_master: master shape {list(master_shard.shape)} != weight {list(self.shape)}")
        master_shard = master_shard.detach()
        if spec(self.format).scale_groups(self.dim()):  # per-expert scales: local to the shard
            if amax is not None:
                raise ValueError("refresh_from_master: HiF8 experts have per-expert scales, none shared across "
                                 "shards; amax must be None")
            self._store(_quantize(self._quantizer, master_shard, None))
            return
        if amax is None:
            amax = hif8_amax(master_shard)
        scale = hif8.current_scale(amax, self._quantizer.format_max)
        self._store(_quantize(self._quantizer, master_shard, scale, amax))

    def _requantize_(self, high_precision: torch.Tensor) -> None:
        self._store(_quantize(self._quantizer, high_precision.detach(), None))

    def _store(self, operand: QuantizedOperand) -> None:
        with torch.no_grad():
            self.qdata.copy_(operand.data)
            self.scale.copy_(operand.scale)

    def _slice_dim0(self, start: int, stop: int) -> "HiF8Tensor":
        scale = self.scale[start:stop] if self.dim() == 3 else self.scale  # 2D: shared scalar
        shape = [stop - start] + list(self.shape[1:])
        return self._rewrap({"qdata": self.qdata[start:stop], "scale": scale}, shape)

    def _slice_last(self, start: int, stop: int) -> "HiF8Tensor":
        # 2D only: the columns of the codes, sharing the one scalar scale (a view, like the data)
        return self._rewrap({"qdata": self.qdata[:, start:stop], "scale": self.scale}, [self.shape[0], stop - start])

    def _fill_zero_(self) -> None:
        # Equal to quantizing zeros: code 0x00 and the current scale of an all-zero tensor (1.0).
        with torch.no_grad():
            self.qdata.zero_()
            self.scale.fill_(1.0)


def _quantize(quantizer: HiF8Quantizer, w: torch.Tensor, scale: torch.Tensor | None,
              amax: torch.Tensor | None = None) -> QuantizedOperand:
    if scale is None:
        return quantizer.quantize(w, orientation="row")
    return quantizer.quantize_with_scale(w, scale.to(device=w.device, dtype=torch.float32), amax)
