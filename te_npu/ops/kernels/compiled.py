"""The ``compiled`` variant: the ``te_npu.numerics`` functions themselves under ``torch.compile``.

Nothing is re-implemented here: each kernel is ``torch.compile(fn, fullgraph=True,
dynamic=False)`` of the numerics function the ``eager`` variant calls (inductor emits C++ on CPU
and Triton on CUDA; each new shape / dtype / static argument compiles once), so the compiled
kernels equal eager bit for bit by construction, and
``tests/unit/ops/kernels/test_compiled_equivalence.py`` checks it. What stays outside the graphs:
argument checks (so errors read as in eager) and host-side ragged bookkeeping. Two choices keep
the graphs fast and few:

- dual-axis MXFP8 runs as two graphs, ``mxfp8.dual_block_scales`` then
  ``mxfp8.quantize_with_dual_scales``, as the numerics function is written: fused into one,
  inductor recomputes the column scale inside the elementwise loop;
- ragged (grouped) col quantization and decode run at a static block bound, ``T // 32 + G``
  blocks (each group adds at most one partial block), so a routing change does not recompile; the
  scale is cut to the real block count, a host int from the group sizes' mirror.

The compiled callables (this variant's compile cache) live on the instance in
``te_npu.ops.kernels.KERNELS``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from te_npu import compat
from te_npu.numerics import hif8, mxfp8
from te_npu.numerics.constants import MX_BLOCK_SIZE, MX_DEFAULT_SCALE_ALG
from te_npu.ops.group_sizes import host_group_sizes
from te_npu.ops.kernels.eager import EagerKernels

__all__ = ["CompiledKernels", "max_ragged_blocks"]

RECOMPILE_LIMIT = 256
"""Graphs per compiled function: each (shape, dtype, option) is its own (``dynamic=False``), and
dynamo's default limit of 8 per function is a hard error under ``fullgraph``."""


def allow_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    """Raise dynamo's recompile limits to ``limit`` graphs per function, once, process-wide (never
    lowering a limit the user set higher; the private config lives in ``te_npu.compat``)."""
    compat.raise_dynamo_recompile_limits(limit, 4 * limit)


def max_ragged_blocks(num_rows: int, num_groups: int, block_size: int = MX_BLOCK_SIZE) -> int:
    """An upper bound of ``sum(ceil(T_g / bs))`` that depends on T and G only (static shapes):
    each group adds at most one partial block to ``T // bs``."""
    return num_rows // block_size + num_groups


class CompiledKernels(EagerKernels):
    """``torch.compile`` of the eager numerics (CPU via C++, CUDA via Triton)."""

    name = "compiled"
    devices = frozenset({"cpu", "cuda"})

    def __init__(self) -> None:
        super().__init__()
        self._graphs: dict[Callable, Callable] = {}

    def availability(self) -> tuple[bool, str | None]:
        # inductor needs a C++ compiler (CPU) or Triton (CUDA); a missing one raises at the
        # first compile with torch's own message, never silently running eager
        return True, None

    def compiled(self, fn: Callable) -> Callable:
        """``torch.compile(fn, fullgraph=True, dynamic=False)`` of a ``te_npu.numerics`` function,
        made once per function."""
        if fn not in self._graphs:
            allow_recompiles()
            self._graphs[fn] = torch.compile(fn, fullgraph=True, dynamic=False)
        return self._graphs[fn]

    # ---- quantization --------------------------------------------------------------------------
    def mxfp8_quantize(self, x, axis=-1, block_size=MX_BLOCK_SIZE, scale_alg=MX_DEFAULT_SCALE_ALG):
        axis = mxfp8.check_blocked(x, axis, block_size, scale_alg)
        return self.compiled(mxfp8.quantize)(x, axis, block_size, scale_alg)

    def mxfp8_quantize_dual(self, w, block_size=MX_BLOCK_SIZE, scale_alg=MX_DEFAULT_SCALE_ALG):
        if w.dim() < 2:
            raise ValueError(f"quantize_dual needs a [..., N, K] tensor, got shape {tuple(w.shape)}")
        mxfp8.check_blocked(w, -1, block_size, scale_alg)
        mxfp8.check_blocked(w, -2, block_size, scale_alg)
        row_scale, row_inverse, col_scale, col_inverse = self.compiled(mxfp8.dual_block_scales)(w, block_size, scale_alg)
        row_data, col_data = self.compiled(mxfp8.quantize_with_dual_scales)(w, row_inverse, col_inverse, block_size)
        return row_data, row_scale, col_data, col_scale

    def mxfp8_quantize_grouped(self, x, group_sizes, block_size=MX_BLOCK_SIZE, scale_alg=MX_DEFAULT_SCALE_ALG):
        if x.dim() != 2:
            raise ValueError(f"quantize_grouped needs a [T, K] tensor, got shape {tuple(x.shape)}")
        mxfp8.check_blocked(x, -1, 1, scale_alg)
        sizes = host_group_sizes(group_sizes)
        _, padded_row, num_blocks = mxfp8.ragged_layout(group_sizes, sizes, x.shape[0], block_size)
        bound = max_ragged_blocks(x.shape[0], len(sizes), block_size)
        data, scale = self.compiled(mxfp8.quantize_ragged)(x, padded_row, bound * block_size, block_size, scale_alg)
        return data, scale[:num_blocks]

    def hif8_quantize(self, x, format_max, per_group=False):
        if x.numel() == 0:  # no amax: raise exactly as eager does
            return super().hif8_quantize(x, format_max, per_group)
        return self.compiled(hif8.quantize_current)(x, float(format_max), per_group=per_group,
                                                    tables=self.encode_tables(x.device))

    def hif8_quantize_with_scale(self, x, scale):
        scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        return self.compiled(hif8.quantize)(x, scale, tables=self.encode_tables(x.device))

    # ---- decode --------------------------------------------------------------------------------
    def mxfp8_decode(self, data, scale, axis=-1, dtype=torch.float32, scale_shift=0):
        axis = axis % data.dim()
        if scale.shape[axis] * MX_BLOCK_SIZE != data.shape[axis]:  # a short last block: eager's general path
            return super().mxfp8_decode(data, scale, axis, dtype, scale_shift)
        return self.compiled(mxfp8.dequantize)(data.view(torch.uint8), scale, axis, MX_BLOCK_SIZE, dtype=dtype,
                                               scale_shift=scale_shift)

    def mxfp8_decode_grouped(self, data, scale, group_sizes, dtype=torch.float32, scale_shift=0):
        sizes = host_group_sizes(group_sizes)
        row_to_block, num_blocks = mxfp8.group_block_index(group_sizes, MX_BLOCK_SIZE, host_sizes=sizes)
        if scale.shape[0] != num_blocks or data.shape[0] != row_to_block.numel():
            raise ValueError(f"grouped MXFP8: data {tuple(data.shape)} / scale {tuple(scale.shape)} do not "
                             f"match group_sizes with {num_blocks} blocks")
        bound = max_ragged_blocks(data.shape[0], len(sizes), MX_BLOCK_SIZE)
        padded_scale = torch.nn.functional.pad(scale, (0, 0, 0, bound - num_blocks))  # rows never read
        return self.compiled(mxfp8.dequantize_ragged)(data.view(torch.uint8), padded_scale, row_to_block, dtype=dtype,
                                                      scale_shift=scale_shift)

    def hif8_decode(self, codes, dtype=torch.float32):
        return self.compiled(hif8.decode)(codes, dtype, table=self.decode_table(codes.device, dtype))
