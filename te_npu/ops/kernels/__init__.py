"""Quantization / decode kernels of the emulation backend: one interface, three variants, one table.

    interface.py   QuantKernels: the functions every variant provides (quantize row / col / dual /
                   grouped, HiF8 current and given-scale, the decodes that feed the emulated GEMMs)
    eager.py       eager: te_npu.numerics as eager torch (the reference, the default)
    compiled.py    compiled: torch.compile of those same numerics functions (C++ / Triton)
    native_cpu.py  native: hand-written C++ CPU kernels (sources in native/), built on first use
    select.py      KERNELS (name -> variant), use_quant_kernel(name), auto's rule

Every variant is bitwise equal to eager (tests/unit/ops/kernels). They live in ``te_npu.ops``
because they hold state (compile caches, the native build, per-device code tables) and device /
platform branches, which ``te_npu.numerics`` (pure functions) may not. Dependencies point down:
``ops.emulation`` -> ``ops.kernels`` -> ``numerics``.
"""
from te_npu.ops.kernels.interface import QUANT_KERNEL_METHODS, QuantKernels
from te_npu.ops.kernels.native_cpu import NativeKernelUnavailable
from te_npu.ops.kernels.select import (
    KERNELS,
    QUANT_KERNEL_CHOICES,
    KernelChoice,
    QuantKernelUnavailable,
    active_quant_kernels,
    choose_quant_kernel,
    quant_kernel_device_problem,
    quant_kernels,
    use_quant_kernel,
)

__all__ = [
    "KERNELS",
    "QUANT_KERNEL_CHOICES",
    "QUANT_KERNEL_METHODS",
    "KernelChoice",
    "NativeKernelUnavailable",
    "QuantKernelUnavailable",
    "QuantKernels",
    "active_quant_kernels",
    "choose_quant_kernel",
    "quant_kernel_device_problem",
    "quant_kernels",
    "use_quant_kernel",
]
