"""Transformer Engine 2.x's ``is_*_available`` probes, answered for the Ascend A5.

TE (``transformer_engine/pytorch/quantization.py``, ``utils.py``) exports, at the top of
``transformer_engine.pytorch``, one probe per low-precision family, each
``is_X_available(return_reason=False)``: a bool, or ``(bool, reason)`` with ``return_reason=True``.
The answers here come from te_npu's capability gate (``te_npu.ops.capability``) for the formats
te_npu implements and are a fixed False, with the reason, for the families it does not:

======================================  ==================================================
TE probe                                te_npu's answer
======================================  ==================================================
``is_mxfp8_available``                  the MXFP8 NPU kernels run here (``capability``)
``is_fp8_available``                    TE's gate for every FP8 recipe: 8-bit GEMMs run here
                                        (MXFP8 or HiF8 kernels); te_npu has no per-tensor
                                        E4M3 recipe (``DelayedScaling`` / ``Float8CurrentScaling``
                                        are refused), its FP8 recipes are MXFP8 and HiF8
``is_fp8_block_scaling_available``      False: no 1x128 / 128x128 FP8 blocks (``Float8BlockScaling``)
``is_nvfp4_available``                  False: no FP4 (``NVFP4BlockScaling``)
``is_bf16_available``                   True: BF16 runs on the CPU and on the NPU
``is_hif8_available`` (te_npu's own)    the HiF8 NPU kernels run here (``capability``)
======================================  ==================================================

Like TE's, these never raise; ``enabled=False`` paths do not call them.
"""
from __future__ import annotations

from te_npu.ops.capability import is_hif8_available, is_mxfp8_available

__all__ = [
    "is_fp8_available",
    "is_mxfp8_available",
    "is_hif8_available",
    "is_fp8_block_scaling_available",
    "is_nvfp4_available",
    "is_bf16_available",
]

NOT_IMPLEMENTED = {
    "fp8_block_scaling": "te_npu implements no FP8 block scaling (Float8BlockScaling's 1x128 / 128x128 blocks); "
                         "its block-scaled recipe is MXFP8BlockScaling (is_mxfp8_available)",
    "nvfp4": "te_npu implements no FP4 format (NVFP4BlockScaling); its 8-bit recipes are MXFP8 and HiF8",
}
"""Why each TE family te_npu does not implement is unavailable."""


def _answer(ok: bool, reason: str, return_reason: bool):
    return (ok, reason) if return_reason else ok


def is_fp8_available(return_reason: bool = False):
    """Whether te_npu's 8-bit recipes (MXFP8 or HiF8) can run on the NPU here (TE: any FP8
    recipe needs this); ``(bool, reason)`` with ``return_reason``."""
    mx_ok, mx_reason = is_mxfp8_available(return_reason=True)
    hi_ok, hi_reason = is_hif8_available(return_reason=True)
    if mx_ok or hi_ok:
        return _answer(True, "; ".join(r for ok, r in ((mx_ok, mx_reason), (hi_ok, hi_reason)) if ok), return_reason)
    reason = mx_reason if mx_reason == hi_reason else f"MXFP8: {mx_reason}; HiF8: {hi_reason}"
    return _answer(False, reason, return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False):
    """Always False (not implemented here); ``(False, reason)`` with ``return_reason``."""
    return _answer(False, NOT_IMPLEMENTED["fp8_block_scaling"], return_reason)


def is_nvfp4_available(return_reason: bool = False):
    """Always False (not implemented here); ``(False, reason)`` with ``return_reason``."""
    return _answer(False, NOT_IMPLEMENTED["nvfp4"], return_reason)


def is_bf16_available(return_reason: bool = False):
    """Always True: BF16 computes on the CPU and on the A5; ``(True, "")`` with ``return_reason``."""
    return _answer(True, "", return_reason)
