"""Hand-written CPU kernels for MXFP8 quantization (both orientations in one pass) and HiF8
current scaling (amax, scale and codes), bit-identical to :mod:`te_npu.numerics.mxfp8` /
:mod:`te_npu.numerics.hif8`, which stay the reference and the default everywhere.

The kernels (``native/{mxfp8_cpu,hif8_cpu,bindings}.cpp``) are C++ built on first use with
``torch.utils.cpp_extension.load`` (needs a C++ compiler and ninja, as ``torch.compile`` on CPU
needs a compiler) and cached by torch under ``~/.cache/torch_extensions``; the first build takes
about a minute on 2 cores. Build flags follow the CPU capability PyTorch detected (AVX2 / AVX-512 /
portable), and the capability is part of the extension name so caches never mix them.

Nothing here falls back silently: if the kernel cannot be built, :func:`quantize_dual` and
friends raise :class:`NativeKernelUnavailable` with the compiler's reason;
:func:`is_available` answers without raising.

Shape legend as in :mod:`te_npu.numerics.mxfp8`: ``x: [..., N, K]``; blocks of 32.
"""
from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import torch

from te_npu.numerics import mxfp8
from te_npu.numerics.constants import MX_BLOCK_SIZE

__all__ = ["NativeKernelUnavailable", "hif8_current_quantize", "is_available", "quantize", "quantize_dual"]

_SOURCES = [Path(__file__).with_name("native") / name for name in ("mxfp8_cpu.cpp", "hif8_cpu.cpp", "bindings.cpp")]
_ARCH_FLAGS = {  # torch.backends.cpu.get_cpu_capability() -> compiler flags
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
# at::parallel_for is an OpenMP region compiled into the extension itself: without -fopenmp the
# kernel would run on one thread. (GCC/Linux; elsewhere the kernel builds single-threaded.)
_OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []
_EMPTY = torch.empty(0, dtype=torch.uint8)


class NativeKernelUnavailable(RuntimeError):
    """The C++ kernel could not be built or loaded on this machine (message says why)."""


@lru_cache(maxsize=None)
def _load():
    """Build (first call on a machine) and import the extension; ``(module, None)`` or ``(None, reason)``."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = _ARCH_FLAGS.get(capability, [])
    try:
        from torch.utils.cpp_extension import load

        module = load(
            name=f"te_npu_native_cpu_{capability.lower()}",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=["-O3", *flags, *_OPENMP],
            extra_ldflags=_OPENMP,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - compiler / ninja / loader errors all mean "unavailable"
        lines = str(exc).strip().splitlines()
        return None, f"{type(exc).__name__}: {lines[-1] if lines else repr(exc)}"
    return module, None


def is_available(return_reason: bool = False):
    """Whether the kernel builds and loads here; with ``return_reason``, ``(ok, reason or None)``."""
    module, reason = _load()
    return (module is not None, reason) if return_reason else module is not None


def _module():
    module, reason = _load()
    if module is None:
        raise NativeKernelUnavailable(f"te_npu native CPU kernels unavailable: {reason}")
    return module


def _as_kernel_input(x: torch.Tensor) -> torch.Tensor:
    """bf16 / fp32 stay as they are (made contiguous); other floats widen to fp32, as eager does."""
    if x.device.type != "cpu":
        raise ValueError(f"native kernels run on CPU tensors, got device {x.device}")
    if not x.is_floating_point():
        raise TypeError(f"native kernels quantize float tensors, got {x.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.to(torch.float32)
    return x.contiguous()


def _u8(shape) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.uint8)


def quantize_dual(x: torch.Tensor, block_size: int = MX_BLOCK_SIZE, scale_alg: str = "floor", *, out=None):
    """Native :func:`mxfp8.quantize_dual`: ``(row_data, row_scale, col_data, col_scale)``, bitwise equal.

    Args:
        x: ``[..., N, K]`` float CPU tensor, ``N`` and ``K`` multiples of 32.
        out: optional ``(row_data, row_scale, col_data, col_scale)`` to write into: data
            ``float8_e4m3fn`` (or uint8) ``[..., N, K]``, scales uint8 ``[..., N, K/32]`` and
            ``[..., N/32, K]``, all contiguous (e.g. an ``MXFP8Tensor``'s own storage).
    Returns:
        The four tensors (``out`` itself when given); data as ``float8_e4m3fn``.
    """
    if x.dim() < 2:
        raise ValueError(f"quantize_dual needs a [..., N, K] tensor, got shape {tuple(x.shape)}")
    if block_size != MX_BLOCK_SIZE:
        raise ValueError(f"native MXFP8 kernel supports block_size={MX_BLOCK_SIZE} only, got {block_size}")
    mxfp8._check(x, -1, block_size, scale_alg)
    mxfp8._check(x, -2, block_size, scale_alg)
    *lead, n, k = x.shape
    flat = _as_kernel_input(x).reshape(-1, k)  # [B*N, K]: N % 32 == 0, so no col block spans two matrices
    if out is None:
        out = (_u8(x.shape), _u8((*lead, n, k // block_size)), _u8(x.shape), _u8((*lead, n // block_size, k)))
    row_data, row_scale, col_data, col_scale = out
    _module().quantize_into(
        flat, scale_alg == "ceil",
        _flat_view(row_data, flat.shape, "row_data"), _flat_view(row_scale, (flat.shape[0], k // block_size), "row_scale"),
        _flat_view(col_data, flat.shape, "col_data"), _flat_view(col_scale, (flat.shape[0] // block_size, k), "col_scale"),
    )
    return (row_data.view(torch.float8_e4m3fn), row_scale, col_data.view(torch.float8_e4m3fn), col_scale)


def quantize(x: torch.Tensor, axis: int = -1, block_size: int = MX_BLOCK_SIZE, scale_alg: str = "floor"):
    """Native :func:`mxfp8.quantize` for ``axis`` -1 (row) or -2 (col) of ``x: [..., N, K]``; bitwise equal."""
    if block_size != MX_BLOCK_SIZE:
        raise ValueError(f"native MXFP8 kernel supports block_size={MX_BLOCK_SIZE} only, got {block_size}")
    axis = mxfp8._check(x, axis, block_size, scale_alg)
    k = x.shape[-1]
    flat = _as_kernel_input(x).reshape(-1, k)
    ceil = scale_alg == "ceil"
    if axis == x.dim() - 1:
        data, scale = _u8(flat.shape), _u8((flat.shape[0], k // block_size))
        _module().quantize_into(flat, ceil, data, scale, _EMPTY, _EMPTY)
        return data.view(torch.float8_e4m3fn).reshape(x.shape), scale.reshape(*x.shape[:-1], k // block_size)
    if axis == x.dim() - 2:
        data, scale = _u8(flat.shape), _u8((flat.shape[0] // block_size, k))
        _module().quantize_into(flat, ceil, _EMPTY, _EMPTY, data, scale)
        return data.view(torch.float8_e4m3fn).reshape(x.shape), scale.reshape(*x.shape[:-2], x.shape[-2] // block_size, k)
    raise ValueError(f"native MXFP8 kernel blocks along the last two dims only, got axis {axis} of shape {tuple(x.shape)}")


def _flat_view(t: torch.Tensor, shape, name: str) -> torch.Tensor:
    """uint8 2D view of an output tensor (no copy: the kernel must write into its storage)."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != shape[0] * shape[1]:
        raise ValueError(f"native MXFP8 out {name}: needs a contiguous CPU tensor with {shape[0] * shape[1]} "
                         f"elements, got shape {tuple(t.shape)} on {t.device}")
    if t.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"native MXFP8 out {name}: dtype must be uint8 or float8_e4m3fn, got {t.dtype}")
    return t.view(torch.uint8).view(shape)


def hif8_current_quantize(x: torch.Tensor, format_max: float, *, per_group: bool = False, saturate: bool = False):
    """Native HiF8 current scaling, bitwise equal to ``amax -> hif8.current_scale -> hif8.quantize``.

    Args:
        x: float CPU tensor; with ``per_group`` a 3D ``[E, ...]`` weight gets one scale per expert.
        format_max: the scaled amax target (15.0 inputs/weights, 224.0 gradients).
    Returns:
        ``(codes uint8 like x, scale fp32 [] or [E], amax fp32 [] or [E])``; scale is
        ``amax / format_max``, or 1.0 where amax is zero or not finite.
    """
    groups = x.shape[0] if per_group else 1
    if per_group and x.dim() != 3:
        raise ValueError(f"per-group HiF8 scales need a 3D [E, N, K] tensor, got shape {tuple(x.shape)}")
    flat = _as_kernel_input(x)
    codes = torch.empty(x.shape, dtype=torch.uint8)
    amax = torch.empty(groups, dtype=torch.float32)
    scale = torch.empty(groups, dtype=torch.float32)
    if x.numel() == 0:
        raise ValueError(f"HiF8 current scaling of an empty tensor {tuple(x.shape)}: no amax")
    _module().hif8_quantize_into(flat, groups, float(format_max), bool(saturate), codes, amax, scale)
    if not per_group:
        amax, scale = amax.reshape(()), scale.reshape(())
    return codes, scale, amax
