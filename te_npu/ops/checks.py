"""Argument checks shared by every backend: formats, dtypes, orientations, shapes, group lists.

They run before dispatch, so the emulation and the NPU wrappers reject the same inputs with
the same messages (each names the shapes or values at fault).
"""
from __future__ import annotations

import math

import torch

from te_npu.formats import Format
from te_npu.numerics import mxfp8
from te_npu.numerics.constants import MX_BLOCK_SIZE
from te_npu.ops.group_sizes import host_group_sizes
from te_npu.ops import layouts
from te_npu.ops.operand import QuantizedOperand

__all__ = ["check_gemm", "check_grouped_gemm", "expected_scale_shape", "mxfp8_num_blocks"]

LAYOUTS = ("NN", "NT", "TN")
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# MXFP8 operands must be blocked along the GEMM reduction dim (orientation of left, right).
# NT fprop Y=X.W^T: both reduce over their last dim K -> row, row.
# NN dgrad dX=dY.W: dY reduces over its last dim N (row); W[N,K] over its dim -2 (col).
# TN wgrad dW=dY^T.X: both reduce over their first dim M -> col, col.
REQUIRED_ORIENTATION = {"NT": ("row", "row"), "NN": ("row", "col"), "TN": ("col", "col")}


def mxfp8_num_blocks(group_sizes: torch.Tensor, block_size: int = MX_BLOCK_SIZE) -> int:
    """Blocks of a ragged ``col`` operand: each group's rows in ``ceil(T_g / 32)`` blocks."""
    return mxfp8.ragged_block_count(host_group_sizes(group_sizes), block_size)


def _shape(op: QuantizedOperand) -> tuple[int, ...]:
    return tuple(op.data.shape)


def expected_scale_shape(op: QuantizedOperand) -> tuple[int, ...]:
    """The scale shape ``op``'s data shape, orientation, groups and scale layout call for."""
    fmt, shape = op.spec, _shape(op)
    num_blocks = None if op.group_sizes is None else mxfp8_num_blocks(op.group_sizes, fmt.block_size)
    canonical = fmt.canonical_scale_shape(shape, op.orientation, num_blocks)
    if op.scale_layout == "canonical" or not fmt.blocked:
        return canonical
    if op.group_sizes is not None:  # kernel ragged layout: T // 64 + G pair rows
        return (layouts.grouped_num_pairs(op.group_sizes), shape[1], 2)
    if op.orientation == "row":  # [..., M, ceil(nb / 2), 2]
        return canonical[:-1] + (math.ceil(canonical[-1] / 2), 2)
    return canonical[:-2] + (math.ceil(canonical[-2] / 2), canonical[-1], 2)  # [..., P, N, 2]


def _check_operand(op: QuantizedOperand, name: str) -> None:
    fmt = op.spec
    what = f"{name} operand ({fmt.format.value})"
    if op.data.dtype != fmt.data_dtype:
        raise ValueError(f"{what} data must be {fmt.data_dtype}, got {op.data.dtype}")
    if op.scale.dtype != fmt.scale_dtype:
        raise ValueError(f"{what} scale must be {fmt.scale_dtype}, got {op.scale.dtype}")
    if op.orientation not in ("row", "col"):
        raise ValueError(f"{name} operand orientation must be 'row' or 'col', got {op.orientation!r}")
    if op.scale_layout not in ("canonical", "npu"):
        raise ValueError(f"{name} operand scale_layout must be 'canonical' or 'npu', got {op.scale_layout!r}")
    shape = _shape(op)
    if op.group_sizes is not None and (not fmt.blocked or op.orientation != "col" or len(shape) != 2):
        raise ValueError(f"{what}: group_sizes (ragged blocks) need a 2D col operand of a block format, "
                         f"got {op.orientation} {shape}")
    if fmt.blocked and op.orientation == "col" and len(shape) < 2:
        raise ValueError(f"{name} col operand needs at least 2 dims, got {shape}")
    expected = expected_scale_shape(op)
    if tuple(op.scale.shape) != expected:
        if not fmt.blocked:
            want = f"[{shape[0]}] (one per leading group)" if expected else "[] (one per tensor)"
            raise ValueError(f"{name} HiF8 operand of shape {shape} needs an FP32 scale {want}, "
                             f"got {tuple(op.scale.shape)}")
        raise ValueError(
            f"{what} {op.orientation} operand of shape {shape} needs a {op.scale_layout} E8M0 scale of shape "
            f"{expected}, got {tuple(op.scale.shape)}"
        )


def _check_common(left: QuantizedOperand, right: QuantizedOperand, layout: str, output_dtype: torch.dtype) -> Format:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if output_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"output_dtype must be one of {OUTPUT_DTYPES}, got {output_dtype}")
    if Format(left.format) != Format(right.format):
        raise ValueError(f"operand formats differ: left {Format(left.format).value}, right {Format(right.format).value}")
    if left.data.device != right.data.device:
        raise ValueError(f"operands on different devices: left {left.data.device}, right {right.data.device}")
    _check_operand(left, "left")
    _check_operand(right, "right")
    fmt = Format(left.format)
    if left.spec.blocked:  # block scales live inside the reduction: blocked along it, both sides
        want = REQUIRED_ORIENTATION[layout]
        if (left.orientation, right.orientation) != want:
            raise ValueError(
                f"{layout} MXFP8 GEMM needs operands blocked along the reduction dim: (left, right) orientation "
                f"must be {want}, got ({left.orientation}, {right.orientation})"
            )
    return fmt


def _mismatch(layout: str, left: QuantizedOperand, right: QuantizedOperand, rule: str) -> ValueError:
    return ValueError(f"{layout} GEMM: left {_shape(left)} and right {_shape(right)} are incompatible ({rule})")


def check_gemm(left: QuantizedOperand, right: QuantizedOperand, layout: str, output_dtype: torch.dtype) -> Format:
    """Validate a dense GEMM; returns the common format."""
    fmt = _check_common(left, right, layout, output_dtype)
    ls, rs = _shape(left), _shape(right)
    if len(ls) != 2 or len(rs) != 2:
        raise ValueError(f"dense {layout} GEMM needs 2D operands, got left {ls} and right {rs}")
    if layout == "NT" and ls[1] != rs[1]:
        raise _mismatch(layout, left, right, "X[M,K] . W[N,K]^T needs equal K")
    if layout == "NN" and ls[1] != rs[0]:
        raise _mismatch(layout, left, right, "dY[M,N] . W[N,K] needs equal N")
    if layout == "TN" and ls[0] != rs[0]:
        raise _mismatch(layout, left, right, "dY[M,N]^T . X[M,K] needs equal M")
    return fmt


def _check_group_list(group_list: torch.Tensor, rows: int, num_groups: int | None) -> None:
    if not isinstance(group_list, torch.Tensor) or group_list.dim() != 1:
        raise ValueError(f"group_list must be a 1D tensor of row counts, got {getattr(group_list, 'shape', group_list)}")
    if group_list.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"group_list must be int64 row counts, got {group_list.dtype}")
    if num_groups is not None and group_list.numel() != num_groups:
        raise ValueError(f"group_list has {group_list.numel()} groups but the weight has {num_groups}")
    sizes = host_group_sizes(group_list)  # the host mirror, if any: no sync
    if any(s < 0 for s in sizes):
        raise ValueError(f"group_list counts must be >= 0, got {list(sizes)}")
    total = sum(sizes)
    if total != rows:
        raise ValueError(f"group_list sums to {total} but the token operand has {rows} rows")


def check_grouped_gemm(
    left: QuantizedOperand,
    right: QuantizedOperand,
    group_list: torch.Tensor,
    layout: str,
    output_dtype: torch.dtype,
) -> Format:
    """Validate a grouped GEMM (see ``te_npu.ops.gemm.low_precision_grouped_matmul``)."""
    fmt = _check_common(left, right, layout, output_dtype)
    ls, rs = _shape(left), _shape(right)
    if layout == "TN":
        if len(ls) != 2 or len(rs) != 2:
            raise ValueError(f"grouped TN GEMM needs 2D dY[T,N] and X[T,K], got left {ls} and right {rs}")
        if ls[0] != rs[0]:
            raise _mismatch(layout, left, right, "dY[T,N]^T . X[T,K] needs equal T")
        _check_group_list(group_list, ls[0], None)
        if left.spec.blocked:
            for name, op in (("left", left), ("right", right)):
                if op.group_sizes is None:
                    raise ValueError(f"grouped TN MXFP8 {name} operand must be ragged col (group_sizes set), got none")
                if host_group_sizes(op.group_sizes) != host_group_sizes(group_list):
                    raise ValueError(
                        f"grouped TN {name} operand was quantized with group_sizes {list(host_group_sizes(op.group_sizes))} "
                        f"but group_list is {list(host_group_sizes(group_list))}"
                    )
        return fmt
    if len(ls) != 2 or len(rs) != 3:
        raise ValueError(f"grouped {layout} GEMM needs a 2D token operand and a 3D [G,N,K] weight, got left {ls} and right {rs}")
    if layout == "NT" and ls[1] != rs[2]:
        raise _mismatch(layout, left, right, "X[T,K] . W[g][N,K]^T needs equal K")
    if layout == "NN" and ls[1] != rs[1]:
        raise _mismatch(layout, left, right, "dY[T,N] . W[g][N,K] needs equal N")
    _check_group_list(group_list, ls[0], rs[0])
    return fmt
