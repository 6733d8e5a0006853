"""MXFP8 scale layouts: te_npu's canonical ``[..., K/32]`` and the Ascend kernels' block pairs.

The NPU backend keeps every scale a torch_npu quantization kernel returns in the kernel's own
layout and hands it to the GEMM kernel unchanged; the conversions below exist for inspection,
tests, and the few canonical operands that reach an NPU GEMM (a persistent ``MXFP8Tensor``
weight stores the canonical layout, which FSDP2 shards on 32-row blocks and DCP reads).

Kernel layouts (uint8 E8M0 codes; "pair" = two consecutive 32-blocks of the blocked axis):

- row (blocked along the last dim K): ``[..., M, ceil(K/64), 2]``, ``[..., m, p, j]`` = block
  ``2p + j``; an odd block count is padded with code 0 (ops-nn ``aclnnDynamicMxQuantV3`` docs:
  "mxscaleOut ... even pad, pad value 0"). For an even count this is a view of the canonical.
- col (blocked along dim -2, M): ``[..., ceil(M/64), N, 2]``, ``[..., p, n, j]`` = block ``2p + j``
  of column n ("for a non-last axis the two rows of each pair are interleaved", same docs).
- ragged col (``npu_grouped_dynamic_mx_quant``, blocks restart at each group of rows):
  ``[T // 64 + G, K, 2]``; group g (rows ``[start_g, start_g + T_g)``) occupies pair rows from
  ``start_g // 64 + g`` on, ``ceil(T_g / 64)`` of them; the rows between groups are never
  written (op-plugin allocates the output uninitialised). Sources: ops-nn
  ``quant/grouped_dynamic_mx_quant/op_kernel/arch35/grouped_dynamic_mx_quant_combine.h``
  (``scaleOffset = (groupStart / 64 + groupIdx + blockColIdx) * rowSize_ * 2 + ...``) and that
  op's ``tests/assets/golden.py`` (``next_group_start = (element // 64 + idx + 1) * 2``); the
  grouped GEMM reads group g at the same pair row ``cumK_g / 64 + g`` (ops-transformer
  ``kernel_qgmm_mx.h`` ``UpdateOffset``: split-K ``x1Scale (k/64+g, m, 2)``).

Shape legend: T rows of a ragged operand, G groups, K columns, P pairs.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from te_npu.numerics.constants import MX_BLOCK_SIZE
from te_npu.ops.group_sizes import host_group_sizes
from te_npu.ops.operand import QuantizedOperand

__all__ = [
    "PAIR",
    "npu_row_scale",
    "canonical_row_scale",
    "npu_col_scale",
    "canonical_col_scale",
    "grouped_pair_starts",
    "grouped_num_pairs",
    "npu_grouped_scale",
    "canonical_grouped_scale",
    "to_npu",
    "to_canonical",
    "copy_canonical_scale_",
]

PAIR = 2 * MX_BLOCK_SIZE  # elements covered by one pair of block scales


def _pad_even(scale: torch.Tensor, dim: int) -> torch.Tensor:
    if scale.shape[dim] % 2 == 0:
        return scale
    pad_shape = list(scale.shape)
    pad_shape[dim] = 1
    return torch.cat([scale, scale.new_zeros(pad_shape)], dim=dim)


def npu_row_scale(scale: torch.Tensor) -> torch.Tensor:
    """Canonical row ``[..., M, nb]`` -> kernel ``[..., M, ceil(nb/2), 2]`` (a view when nb is even)."""
    padded = _pad_even(scale, -1)
    return padded.unflatten(-1, (padded.shape[-1] // 2, 2))


def canonical_row_scale(npu_scale: torch.Tensor, length: int) -> torch.Tensor:
    """Kernel row scale -> canonical ``[..., M, ceil(length/32)]`` for a blocked axis of ``length``
    elements (a view)."""
    return npu_scale.flatten(-2).narrow(-1, 0, math.ceil(length / MX_BLOCK_SIZE))


def npu_col_scale(scale: torch.Tensor) -> torch.Tensor:
    """Canonical col ``[..., nb, N]`` -> kernel ``[..., ceil(nb/2), N, 2]``, ``out[..., p, n, j] =
    in[..., 2p + j, n]`` (contiguous: one copy)."""
    padded = _pad_even(scale, -2)
    pairs = padded.unflatten(-2, (padded.shape[-2] // 2, 2))  # [..., P, 2, N]
    return pairs.transpose(-1, -2).contiguous()


def canonical_col_scale(npu_scale: torch.Tensor, length: int) -> torch.Tensor:
    """Kernel col scale -> canonical ``[..., ceil(length/32), N]`` (contiguous: one copy)."""
    blocks = npu_scale.transpose(-1, -2).flatten(-3, -2)  # [..., 2P, N]
    return blocks.narrow(-2, 0, math.ceil(length / MX_BLOCK_SIZE)).contiguous()


def grouped_pair_starts(group_sizes: torch.Tensor) -> list[int]:
    """First pair row of each group in the kernel's ragged layout: ``start_g // 64 + g``."""
    starts, start = [], 0
    for g, size in enumerate(host_group_sizes(group_sizes)):
        starts.append(start // PAIR + g)
        start += size
    return starts


def grouped_num_pairs(group_sizes: torch.Tensor) -> int:
    """Pair rows of the kernel's ragged layout: ``T // 64 + G``."""
    sizes = host_group_sizes(group_sizes)
    return sum(sizes) // PAIR + len(sizes)


def _block_slots(group_sizes: torch.Tensor) -> tuple[list[int], list[int]]:
    """For each canonical ragged block (in order): its (pair row, slot 0/1) in the kernel layout."""
    pairs, slots = [], []
    for first, size in zip(grouped_pair_starts(group_sizes), host_group_sizes(group_sizes)):
        for b in range(math.ceil(size / MX_BLOCK_SIZE)):
            pairs.append(first + b // 2)
            slots.append(b % 2)
    return pairs, slots


def npu_grouped_scale(scale: torch.Tensor, group_sizes: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """Canonical ragged ``[num_blocks, K]`` -> kernel ``[T // 64 + G, K, 2]``; every entry no
    group owns (gaps between groups, a group's unused second slot) is ``fill``."""
    pairs, slots = _block_slots(group_sizes)
    out = scale.new_full((grouped_num_pairs(group_sizes), 2, scale.shape[1]), fill)  # [P, 2, K]
    if pairs:
        index = torch.tensor([2 * p + s for p, s in zip(pairs, slots)], dtype=torch.int64, device=scale.device)
        out.view(-1, scale.shape[1]).index_copy_(0, index, scale)
    return out.transpose(1, 2).contiguous()


def canonical_grouped_scale(npu_scale: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Kernel ragged ``[T // 64 + G, K, 2]`` -> canonical ``[num_blocks, K]`` (reads only the
    entries the groups own: whatever the gaps hold never shows)."""
    pairs, slots = _block_slots(group_sizes)
    if npu_scale.shape[0] != grouped_num_pairs(group_sizes):
        raise ValueError(f"grouped MX scale has {npu_scale.shape[0]} pair rows; group sizes "
                         f"{list(host_group_sizes(group_sizes))} need T // 64 + G = {grouped_num_pairs(group_sizes)}")
    device = npu_scale.device
    pair_index = torch.tensor(pairs, dtype=torch.int64, device=device)
    slot_index = torch.tensor(slots, dtype=torch.int64, device=device)
    return npu_scale[pair_index, :, slot_index]


# ---------------------------------------------------------------- operands
def to_npu(op: QuantizedOperand) -> QuantizedOperand:
    """``op`` with its scale in the kernel layout (itself when already there, or not blocked)."""
    if op.scale_layout == "npu" or not op.spec.blocked:
        return op
    if op.group_sizes is not None:
        scale = npu_grouped_scale(op.scale, op.group_sizes)
    elif op.orientation == "row":
        scale = npu_row_scale(op.scale)
    else:
        scale = npu_col_scale(op.scale)
    return dataclasses.replace(op, scale=scale, scale_layout="npu")


def to_canonical(op: QuantizedOperand) -> QuantizedOperand:
    """``op`` with its scale in te_npu's canonical layout (itself when already there)."""
    if op.scale_layout == "canonical":
        return op
    if op.group_sizes is not None:
        scale = canonical_grouped_scale(op.scale, op.group_sizes)
    elif op.orientation == "row":
        scale = canonical_row_scale(op.scale, op.data.shape[-1]).contiguous()
    else:
        scale = canonical_col_scale(op.scale, op.data.shape[-2])
    return dataclasses.replace(op, scale=scale, scale_layout="canonical")


def copy_canonical_scale_(dst: torch.Tensor, op: QuantizedOperand) -> torch.Tensor:
    """Write ``op``'s scale into ``dst`` (a canonical dense scale of the same logical operand) in
    one copy, straight from the kernel layout when ``op`` has it (no intermediate tensor)."""
    if op.scale_layout == "canonical" or not op.spec.blocked:
        return dst.copy_(op.scale)
    if op.group_sizes is not None:
        raise ValueError("copy_canonical_scale_: ragged operands are never stored")
    if op.orientation == "row":
        return dst.copy_(canonical_row_scale(op.scale, op.data.shape[-1]))
    blocks = dst.shape[-2]
    source = op.scale.transpose(-1, -2)  # [..., P, 2, N] view of the kernel pairs
    if blocks % 2 == 0 and dst.is_contiguous():
        dst.view(*dst.shape[:-2], blocks // 2, 2, dst.shape[-1]).copy_(source)
        return dst
    return dst.copy_(canonical_col_scale(op.scale, op.data.shape[-2]))
