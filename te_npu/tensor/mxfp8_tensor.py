"""``MXFP8Tensor``: a weight stored as MXFP8 row and col copies.

Shape legend: ``N`` = out features (rows), ``K`` = in features, ``E`` = experts, ``B`` = 32.

    row_data  float8_e4m3fn [..., N, K]        blocked along K (fprop "NT" reads it)
    row_scale uint8 E8M0    [..., N, K // B]
    col_data  float8_e4m3fn [..., N, K]        blocked along N (dgrad "NN" reads it)
    col_scale uint8 E8M0    [..., N // B, K]

Both copies are quantized from the high-precision master (never col from row): requantizing
an already-rounded copy along the other axis would add a second rounding.

Dim-0 slicing (FSDP2 shards dim 0): for a 3D weight every inner tensor has ``E`` first, so
experts split cleanly. For a 2D weight ``col_scale`` has one row per 32 weight rows, so a
dim-0 view is legal only at a multiple of 32 (``_slice_dim0``).

FSDP2 shards ask more (``shard_alignment``): a multiple of 64 rows of the flattened
``[-1, K]`` weight (dense ``N_local``, grouped ``E_local * N``), one pair of 32-row scale
blocks, the unit of the Ascend kernels' scale layout (``te_npu.ops.layouts``). Each rank
refreshes its shard with the NPU quantization kernels, which return col scales in 64-row pairs
(``[..., N/64, K, 2]``); for a dense shard on pair boundaries those pairs are exactly the full
weight's, no half pair is padded and stripped, and ``copy_canonical_scale_`` writes them in one
copy. The stored canonical layout alone would allow any 32-row boundary (numerically the
same weight); 64 is the kernels' granularity.

A 2D weight may instead be sharded along K (FSDP2 ``Shard(1)``, for ``N`` that no world size
divides into pairs, e.g. ``kv_a_proj_with_mqa [3136, 2048]``): every inner tensor is then cut
along its last dim (``row_scale`` at ``K_local / 32`` codes), the local ``K_local`` a multiple of
64 -- whole pairs of the row scale's kernel layout ``[N, K/64, 2]`` -- so each rank refreshes
exactly the full weight's blocks of its columns.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from te_npu.formats import Format, Orientation
from te_npu.quantizers.mxfp8 import MXFP8Quantizer
from te_npu.numerics import mxfp8
from te_npu.ops.layouts import PAIR, copy_canonical_scale_, to_canonical
from te_npu.ops.operand import QuantizedOperand
from te_npu.tensor.weight import QuantizedWeightTensor, ShardAlignment

__all__ = ["MXFP8Tensor"]

_E4M3 = torch.float8_e4m3fn
_E8M0_CODES = torch.uint8


class MXFP8Tensor(QuantizedWeightTensor):
    """Persistent MXFP8 weight ``[N, K]`` or ``[E, N, K]``: E4M3 row/col data + E8M0 scales."""

    _inner_fields: ClassVar[tuple[str, ...]] = ("row_data", "row_scale", "col_data", "col_scale")
    _handlers: ClassVar[dict] = {}  # format-specific aten handlers (none yet); base table applies
    quantizer_type: ClassVar[type] = MXFP8Quantizer
    format: ClassVar[Format] = Format.MXFP8_E4M3
    shard_alignment: ClassVar[ShardAlignment] = ShardAlignment(
        rows=PAIR, reason="whole pairs of 32-row scale blocks, the NPU kernels' scale layout",
        cols=PAIR, cols_reason="whole pairs of 32-column row-scale blocks, the NPU kernels' [N, K/64, 2] layout",
    )

    row_data: torch.Tensor
    row_scale: torch.Tensor
    col_data: torch.Tensor
    col_scale: torch.Tensor

    @classmethod
    def from_high_precision(
        cls,
        w: torch.Tensor,
        quantizer: MXFP8Quantizer | None = None,
        *,
        requires_grad: bool = False,
    ) -> "MXFP8Tensor":
        """Quantize ``w: [N, K]`` or ``[E, N, K]`` (N and K multiples of 32) into row and col copies."""
        quantizer = quantizer or MXFP8Quantizer()
        if w.dim() not in (2, 3):
            raise ValueError(f"MXFP8Tensor: expected a 2D [N, K] or 3D [E, N, K] weight, got shape {list(w.shape)}")
        # the stored scales are canonical (FSDP2 shards them on 32-row blocks); an NPU kernel's
        # pair layout is converted here, once per weight, not per GEMM input
        row, col = (to_canonical(op) for op in quantizer.quantize_dual(w.detach()))
        inner = {"row_data": row.data, "row_scale": row.scale, "col_data": col.data, "col_scale": col.scale}
        return cls._make(inner, shape=w.shape, logical_dtype=w.dtype, quantizer=quantizer, requires_grad=requires_grad)

    @classmethod
    def _inner_layout(cls, shape: tuple[int, ...], quantizer: MXFP8Quantizer) -> dict:
        """Row / col data ``[..., N, K]`` E4M3 and E8M0 codes ``[..., N, K/32]`` / ``[..., N/32, K]``."""
        shape, block = list(shape), quantizer.block_size
        if len(shape) not in (2, 3) or shape[-1] % block or shape[-2] % block:
            raise ValueError(f"MXFP8Tensor: weight shape {shape} must be [..., N, K] with N, K multiples of {block}")
        return {
            "row_data": (tuple(shape), _E4M3),
            "row_scale": (tuple(shape[:-1] + [shape[-1] // block]), _E8M0_CODES),
            "col_data": (tuple(shape), _E4M3),
            "col_scale": (tuple(shape[:-2] + [shape[-2] // block, shape[-1]]), _E8M0_CODES),
        }

    def _check_inner(self) -> None:
        for name, (want_shape, want_dtype) in self._inner_layout(tuple(self.weight_shape), self._quantizer).items():
            want_shape = list(want_shape)
            t = getattr(self, name)
            if list(t.shape) != want_shape or t.dtype != want_dtype:
                raise ValueError(
                    f"MXFP8Tensor.{name}: expected {want_dtype}{want_shape}, got {t.dtype}{list(t.shape)}"
                )

    def select(self, orientation: Orientation) -> QuantizedOperand:  # type: ignore[override]
        """The stored ``row`` (blocked along K) or ``col`` (blocked along N) copy, no copy made."""
        self._require_weight_shape("select")
        if orientation in ("row", "col"):
            data, scale = getattr(self, f"{orientation}_data"), getattr(self, f"{orientation}_scale")
            if data.numel() and data.untyped_storage().nbytes() == 0:
                # An FSDP2 forward all-gather with reshard_after_forward=True brings only the
                # row copy; the col copy is a storage-free placeholder until the backward gather.
                raise RuntimeError(
                    f"MXFP8Tensor.select({orientation!r}): the {orientation} copy of this {list(self.shape)} "
                    "weight is not materialized (an FSDP2 forward-only all-gather does not bring it)"
                )
            return QuantizedOperand(data, scale, self.dtype, self.format, orientation)
        raise ValueError(
            f"MXFP8Tensor.select: orientation must be 'row' or 'col', got {orientation!r} "
            "(torch.Tensor.select(dim, index) is not available on quantized weights)"
        )

    def _dequantize_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Value of the row copy (the forward operand), in ``dtype`` (default: the logical dtype)."""
        value = mxfp8.dequantize(self.row_data, self.row_scale, axis=-1, block_size=self._quantizer.block_size)
        return value.to(dtype or self.dtype)

    def refresh_from_master(self, master_shard: torch.Tensor, *, amax: torch.Tensor | None = None) -> None:
        """Re-quantize both copies from ``master_shard`` (same shape) into the existing storage.

        No ``amax``: every MX scale covers one 32-element block inside this shard, so no scale
        depends on another shard (``shared_scale_amax`` is None).
        """
        self._require_weight_shape("refresh_from_master")
        if amax is not None:
            raise ValueError("refresh_from_master: an MXFP8 weight has no scale shared across shards; amax must be None")
        if list(master_shard.shape) != list(self.shape):
            raise ValueError(f"refresh_from_master: master shape {list(master_shard.shape)} != weight {list(self.shape)}")
        self._requantize_(master_shard)

    def _requantize_(self, high_precision: torch.Tensor) -> None:
        row, col = self._quantizer.quantize_dual(high_precision.detach())
        with torch.no_grad():  # scales written canonical straight from the kernel's layout, one copy each
            self.row_data.copy_(row.data)
            copy_canonical_scale_(self.row_scale, row)
            self.col_data.copy_(col.data)
            copy_canonical_scale_(self.col_scale, col)

    def _slice_dim0(self, start: int, stop: int) -> "MXFP8Tensor":
        shape = list(self.shape)
        if self.dim() == 3:  # experts: every inner tensor has E first
            return self._rewrap({n: t[start:stop] for n, t in self._inner().items()}, [stop - start] + shape[1:])
        block = self._quantizer.block_size
        for boundary in (start, stop):
            if boundary % block:
                raise ValueError(
                    f"MXFP8Tensor {shape}: dim-0 boundary {boundary} is not a multiple of {block}; "
                    "col_scale holds one row per 32 weight rows, so shards must start and end on 32-row blocks"
                )
        inner = {
            "row_data": self.row_data[start:stop],
            "row_scale": self.row_scale[start:stop],
            "col_data": self.col_data[start:stop],
            "col_scale": self.col_scale[start // block : stop // block],
        }
        return self._rewrap(inner, [stop - start] + shape[1:])

    def _slice_last(self, start: int, stop: int) -> "MXFP8Tensor":
        block = self._quantizer.block_size
        for boundary in (start, stop):
            if boundary % block:
                raise ValueError(
                    f"MXFP8Tensor {list(self.shape)}: dim-1 boundary {boundary} is not a multiple of {block}; "
                    "row_scale holds one code per 32 columns, so K shards must start and end on 32-column blocks"
                )
        inner = {
            "row_data": self.row_data[:, start:stop],
            "row_scale": self.row_scale[:, start // block : stop // block],
            "col_data": self.col_data[:, start:stop],
            "col_scale": self.col_scale[:, start:stop],
        }
        return self._rewrap(inner, [self.shape[0], stop - start])

    def _fill_zero_(self) -> None:
        # quantizing zeros: E4M3 code 0 everywhere, and a zero block's E8M0 code is 0
        with torch.no_grad():
            for name in self._inner_fields:
                getattr(self, name).zero_()
