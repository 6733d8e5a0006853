"""Public low-precision GEMMs: validate, pick the backend, emit a ``te_npu.events.GemmEvent``.

Dense, 2D operands (``QuantizedOperand`` keeps its source's logical shape):
- "NT" fprop  Y[M,N]  = X[M,K] (row) . W[N,K]^T (row)
- "NN" dgrad  dX[M,K] = dY[M,N] (row) . W[N,K] (col)
- "TN" wgrad  dW[N,K] = dY[M,N]^T (col) . X[M,K] (col)
Grouped, ``group_list`` = int64 [G] row counts (not cumsum) of the 2D token operand:
- "NT" Y[T,N]: Y_g = X_g . W[g]^T;  "NN" dX[T,K]: dX_g = dY_g . W[g];
- "TN" dW[G,N,K]: dW[g] = dY_g^T . X_g (ragged col operands; empty group -> zeros).
MXFP8 operands must be blocked along the reduction dim. HiF8: out = (decode(left) @ decode(right))
* left.scale * right.scale (right.scale [G] per group for grouped weights). A GEMM that cannot
run raises; there is never a high-precision fallback. Each GEMM runs inside a profiler range
``te_npu::gemm <kind> <gemm> <format>`` (``te_npu.ops.profiling``).
"""
from __future__ import annotations

import torch

from te_npu import events
from te_npu.formats import Format
from te_npu.ops.checks import check_gemm, check_grouped_gemm
from te_npu.ops.profiling import GEMM_RANGE, op_range
from te_npu.ops.registry import backend_for
from te_npu.ops.operand import QuantizedOperand

__all__ = ["low_precision_matmul", "low_precision_grouped_matmul", "GEMM_OF_LAYOUT"]

GEMM_OF_LAYOUT = {"NT": "fprop", "NN": "dgrad", "TN": "wgrad"}
"""Which training GEMM each layout is (see the table above)."""


def _emit(kind, left, right, layout, fmt: Format, output_dtype, backend, num_groups=None) -> None:
    if events.has_subscribers(events.GemmEvent):
        events.emit(
            events.GemmEvent(
                kind=kind,
                layout=layout,
                gemm=GEMM_OF_LAYOUT[layout],
                format=fmt.value,
                left_shape=tuple(left.data.shape),
                right_shape=tuple(right.data.shape),
                left_scale_dtype=left.scale.dtype,
                right_scale_dtype=right.scale.dtype,
                output_dtype=output_dtype,
                backend=backend.NAME,
                num_groups=num_groups,
            )
        )


def low_precision_matmul(
    left: QuantizedOperand,
    right: QuantizedOperand,
    *,
    layout: str,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """Dense 8-bit GEMM; see the module docstring for the layouts."""
    fmt = check_gemm(left, right, layout, output_dtype)
    backend = backend_for(left.data.device)
    _emit("dense", left, right, layout, fmt, output_dtype, backend)
    with op_range(f"{GEMM_RANGE} dense {GEMM_OF_LAYOUT[layout]} {fmt.value}"):
        return backend.matmul(left, right, layout, output_dtype)


def low_precision_grouped_matmul(
    left: QuantizedOperand,
    right: QuantizedOperand,
    group_list: torch.Tensor,
    *,
    layout: str,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """Grouped 8-bit GEMM; ``group_list``: int64 [G] row counts. See the module docstring."""
    fmt = check_grouped_gemm(left, right, group_list, layout, output_dtype)
    backend = backend_for(left.data.device)
    _emit("grouped", left, right, layout, fmt, output_dtype, backend, group_list.numel())
    with op_range(f"{GEMM_RANGE} grouped {GEMM_OF_LAYOUT[layout]} {fmt.value}"):
        return backend.grouped_matmul(left, right, group_list, layout, output_dtype)
