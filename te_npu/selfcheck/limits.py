"""The "Limits" lines about kernels (docs/numerics-and-limits.md) that the self-check gives an
input of its own.

Each id names one documented difference between a vendor kernel and te_npu's emulation (or a
detail the sources leave open). A case tagged with an id may differ from the emulation exactly
there (its ``allowed`` mask): the report calls that a "known difference (Limits: <id>)" instead of
a failure; a difference anywhere else still fails.
"""
from __future__ import annotations

__all__ = ["LIMITS"]

LIMITS: dict[str, str] = {
    "mx-tiny-amax": "npu_dynamic_mx_quant / npu_grouped_dynamic_mx_quant: blocks with amax < 2**-118 quantize "
                    "to zero; the dual-axis kernel and the emulation give x * 2**127 (BF16 single-axis, grouped "
                    "and every FP32 route differ there)",
    "mx-nonfinite-block": "MX quantization: a block holding NaN / Inf gets element codes 0x00 from the kernels "
                          "and 0x7F from the emulation (scale 0xFF on both)",
    "hif8-dynamic-nonfinite": "npu_dynamic_quant (HiF8 pertensor): a tensor with NaN / Inf keeps the kernel's "
                              "scale and codes (the emulation reports scale 1.0; both non-finite)",
    "hif8-quantize-sat-inf": "npu_quantize (HiF8, FP32): the SAT cast clamps +-Inf to +-32768 where the "
                             "emulation keeps Inf",
    "mx-gemm-range": "npu_quant_matmul / npu_grouped_matmul: MX operands beyond the FP32 range "
                     "(448 x 2**127) may not overflow on the device as they do in the emulation",
}
