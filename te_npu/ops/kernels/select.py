"""The table of kernel variants, the one active for the emulation, and ``auto``'s rule.

``KERNELS`` maps each name to its variant; ``use_quant_kernel(name)`` makes one active for a
block (nestable, the innermost wins; outside every block: ``eager``, the reference). Like
``force_backend`` it is process state, scoped by ``with``; keep ``loss.backward()`` inside the
block so backward quantizes and decodes with the same variant (the results are bitwise equal
either way, only speed differs). Entering a variant that cannot run here raises with the reason;
nothing silently runs another one. Nothing reads the environment: a run chooses once, from its
config (``training.quant_kernel``, resolved by :func:`choose_quant_kernel`, entered by the
Trainer); scripts take ``--quant-kernel``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from te_npu.ops.kernels.compiled import CompiledKernels
from te_npu.ops.kernels.eager import EagerKernels
from te_npu.ops.kernels.interface import QuantKernels
from te_npu.ops.kernels.native_cpu import NativeCpuKernels

__all__ = [
    "KERNELS",
    "QUANT_KERNEL_CHOICES",
    "KernelChoice",
    "QuantKernelUnavailable",
    "active_quant_kernels",
    "choose_quant_kernel",
    "quant_kernel_device_problem",
    "quant_kernels",
    "use_quant_kernel",
]

KERNELS: Mapping[str, QuantKernels] = MappingProxyType(
    {k.name: k for k in (EagerKernels(), CompiledKernels(), NativeCpuKernels())}
)
"""Name -> variant: ``eager`` (the numerics reference), ``compiled`` (torch.compile of it),
``native`` (C++ CPU kernels)."""

QUANT_KERNEL_CHOICES = ("auto", *KERNELS)
"""What a run may ask for: a variant, or ``auto`` (see :func:`choose_quant_kernel`)."""

_ACTIVE: list[QuantKernels] = []


class QuantKernelUnavailable(RuntimeError):
    """A requested kernel variant cannot run here (the message says why)."""


def quant_kernels(name: str) -> QuantKernels:
    """The variant called ``name``; ``ValueError`` naming the known ones otherwise."""
    if name not in KERNELS:
        raise ValueError(f"unknown quantization kernel {name!r}; known: {list(KERNELS)}")
    return KERNELS[name]


def _require(kernels: QuantKernels) -> QuantKernels:
    ok, reason = kernels.availability()
    if not ok:
        raise QuantKernelUnavailable(f"{kernels.name!r} kernels cannot run here: {reason}")
    return kernels


@contextlib.contextmanager
def use_quant_kernel(name: str) -> Iterator[QuantKernels]:
    """Quantize and decode with variant ``name`` inside the block (builds it first if needed;
    raises :class:`QuantKernelUnavailable` if it cannot run here).

        with te_npu.ops.use_quant_kernel("native"):
            loss = model(x).loss
            loss.backward()
    """
    kernels = _require(quant_kernels(name))
    _ACTIVE.append(kernels)
    try:
        yield kernels
    finally:
        _ACTIVE.pop()


def active_quant_kernels() -> QuantKernels:
    """The variant the emulation calls now: the innermost ``use_quant_kernel`` block's, else eager."""
    return _ACTIVE[-1] if _ACTIVE else KERNELS["eager"]


def quant_kernel_device_problem(name: str, device_type: str) -> str | None:
    """Why ``name`` (a variant or ``auto``) makes no sense for a run on ``device_type``, or None.
    (``npu`` runs quantize with torch_npu, never with these kernels.)"""
    if name == "auto" or name not in KERNELS:
        return None
    devices = KERNELS[name].devices
    if device_type == "npu" and name != "eager":
        return (f"{name!r} selects the emulation's kernels, which never run for npu tensors (torch_npu "
                "quantizes there); use 'auto' or 'eager'")
    if devices is not None and device_type not in devices:
        return f"{name!r} kernels run on {' / '.join(sorted(devices))} tensors only, not on {device_type!r}"
    return None


@dataclass(frozen=True)
class KernelChoice:
    """The variant a run uses and why (the line rank 0 logs)."""

    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def choose_quant_kernel(requested: str, device_type: str, *, quantizes: bool = True) -> KernelChoice:
    """Resolve a run's ``quant_kernel`` once.

    A named variant is checked to run here (:class:`QuantKernelUnavailable` otherwise, with the
    reason). ``auto``: ``native`` for a CPU run that quantizes, when the C++ kernels build here
    (about a minute once, then cached by torch), else ``eager`` with the reason (no
    low-precision recipe, another device, or why the build failed). Any choice gives the same bits.
    """
    if requested != "auto":
        problem = quant_kernel_device_problem(requested, device_type)
        if problem:
            raise QuantKernelUnavailable(problem)
        _require(quant_kernels(requested))
        return KernelChoice(requested, "as configured")
    if not quantizes:
        return KernelChoice("eager", "auto: no low-precision recipe, nothing is quantized")
    if device_type != "cpu":
        return KernelChoice("eager", f"auto: the native kernels are CPU-only, this run is on {device_type}")
    ok, reason = KERNELS["native"].availability()
    if ok:
        return KernelChoice("native", "auto: CPU run, the native C++ kernels built here")
    return KernelChoice("eager", f"auto: native CPU kernels unavailable ({reason}); same bits, slower")
