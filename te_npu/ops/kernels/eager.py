"""The ``eager`` variant: ``te_npu.numerics`` run as eager torch -- the reference and the default.

The only state here is each device's copy of the HiF8 code tables (``hif8.encode_tables`` /
``hif8.decode_table``), made once per device so no table crosses to an accelerator per call.
The ``compiled`` and ``native`` variants build on this class: they replace the calls they speed
up and inherit the rest, so whatever a variant does not cover runs this exact code.
"""
from __future__ import annotations

import torch

from te_npu.numerics import hif8, mxfp8
from te_npu.numerics.constants import MX_BLOCK_SIZE, MX_DEFAULT_SCALE_ALG
from te_npu.ops.group_sizes import host_group_sizes

__all__ = ["EagerKernels"]


class EagerKernels:
    """``te_npu.numerics`` behind :class:`te_npu.ops.kernels.QuantKernels`."""

    name = "eager"
    devices: frozenset[str] | None = None

    def __init__(self) -> None:
        self._encode_tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        self._decode_tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    def availability(self) -> tuple[bool, str | None]:
        return True, None

    # ---- device tables -----------------------------------------------------------------------
    def encode_tables(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """HiF8 rounding tables on ``device`` (made once per device)."""
        if device not in self._encode_tables:
            self._encode_tables[device] = hif8.encode_tables(device)
        return self._encode_tables[device]

    def decode_table(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """HiF8 value table as ``dtype`` on ``device`` (made once per pair)."""
        key = (device, dtype)
        if key not in self._decode_tables:
            self._decode_tables[key] = hif8.decode_table(device, dtype)
        return self._decode_tables[key]

    # ---- quantization --------------------------------------------------------------------------
    def mxfp8_quantize(self, x, axis=-1, block_size=MX_BLOCK_SIZE, scale_alg=MX_DEFAULT_SCALE_ALG):
        return mxfp8.quantize(x, axis, block_size, scale_alg)

    def mxfp8_quantize_dual(self, w, block_size=MX_BLOCK_SIZE, scale_alg=MX_DEFAULT_SCALE_ALG):
        return mxfp8.quantize_dual(w, block_size, scale_alg)

    def mxfp8_quantize_grouped(self, x, group_sizes, block_size=MX_BLOCK_SIZE, scale_alg=MX_DEFAULT_SCALE_ALG):
        return mxfp8.quantize_grouped(x, group_sizes, block_size, scale_alg, host_sizes=host_group_sizes(group_sizes))

    def hif8_quantize(self, x, format_max, per_group=False):
        return hif8.quantize_current(x, format_max, per_group=per_group, tables=self.encode_tables(x.device))

    def hif8_quantize_with_scale(self, x, scale):
        return hif8.quantize(x, scale, tables=self.encode_tables(x.device))

    # ---- decode --------------------------------------------------------------------------------
    def mxfp8_decode(self, data, scale, axis=-1, dtype=torch.float32, scale_shift=0):
        return mxfp8.dequantize(data, scale, axis, MX_BLOCK_SIZE, dtype=dtype, scale_shift=scale_shift)

    def mxfp8_decode_grouped(self, data, scale, group_sizes, dtype=torch.float32, scale_shift=0):
        return mxfp8.dequantize_grouped(data, scale, group_sizes, MX_BLOCK_SIZE, host_sizes=host_group_sizes(group_sizes),
                                        dtype=dtype, scale_shift=scale_shift)

    def hif8_decode(self, codes, dtype=torch.float32):
        return hif8.decode(codes, dtype, table=self.decode_table(codes.device, dtype))
