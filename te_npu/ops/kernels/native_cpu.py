"""The ``native`` variant: hand-written CPU kernels for MXFP8 quantization (both orientations in
one pass), HiF8 current scaling (amax, scale and codes) and the table decode of both formats to
FP32, bit-identical to :mod:`te_npu.numerics.mxfp8` / :mod:`te_npu.numerics.hif8`, which stay
the reference.

What the kernels cover -- CPU tensors, 32-element blocks along one of the last two dims (MXFP8
row / col / dual, the col blocks of the ragged grouped quantization), HiF8 current scaling of
non-empty tensors, FP32 decodes of operands with >= 2 dims -- :class:`NativeCpuKernels` runs
natively; anything else (a leading axis, another block size, HiF8 with a given scale, a BF16
decode) runs the eager code it inherits, the same bits.

The kernels (``native/{mxfp8_cpu,hif8_cpu,decode_cpu,bindings}.cpp``) are C++ built on first use with
``torch.utils.cpp_extension.load`` (needs a C++ compiler and ninja, as ``torch.compile`` on CPU
needs a compiler) and cached by torch under ``~/.cache/torch_extensions``; the first build takes
about a minute on 2 cores. Builders take turns under an OS file lock (``flock``, released by the
kernel when a process dies), so a build killed mid-way cannot leave torch's own ``lock`` file
behind to hang every later build: a ``lock`` found while holding the turn is stale and removed,
with one line saying so. The compile itself runs in a child process of its own process group
(``python -m te_npu.ops.kernels.native_cpu``, started by ``te_npu.process_tree.start_owned``), so
ninja and the compilers die with the process that asked for the build, even when that one is
killed with ``kill -9`` (they used to live on, adopted by pid 1, while the next build started);
the module is then loaded in-process from the build. Build flags follow the CPU capability PyTorch detected (AVX2 / AVX-512 /
portable), and the capability is part of the extension name so caches never mix them.

Nothing here falls back silently: if the kernel cannot be built, :func:`quantize_dual` and
friends raise :class:`NativeKernelUnavailable` with the compiler's reason;
:func:`is_available` answers without raising.

Shape legend as in :mod:`te_npu.numerics.mxfp8`: ``x: [..., N, K]``; blocks of 32.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import torch

from te_npu import compat, process_tree
from te_npu.numerics import hif8, mxfp8
from te_npu.numerics.constants import MX_BLOCK_SIZE, MX_DEFAULT_SCALE_ALG
from te_npu.ops.group_sizes import host_group_sizes
from te_npu.ops.kernels.eager import EagerKernels

__all__ = [
    "NativeCpuKernels",
    "NativeKernelUnavailable",
    "dequantize",
    "hif8_current_quantize",
    "hif8_decode",
    "is_available",
    "quantize",
    "quantize_dual",
]

_NATIVE_DIR = Path(__file__).with_name("native")
_SOURCES = [_NATIVE_DIR / name for name in ("mxfp8_cpu.cpp", "hif8_cpu.cpp", "decode_cpu.cpp", "bindings.cpp")]
_HEADERS = [_NATIVE_DIR / "huge_pages.h"]
_ARCH_FLAGS = {  # torch.backends.cpu.get_cpu_capability() -> compiler flags
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
# at::parallel_for is an OpenMP region compiled into the extension itself: without -fopenmp the
# kernel would run on one thread. (GCC/Linux; elsewhere the kernel builds single-threaded.)
_OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []
_EMPTY = torch.empty(0, dtype=torch.uint8)
_EMPTY_F32 = torch.empty(0, dtype=torch.float32)
_EMPTY_I64 = torch.empty(0, dtype=torch.int64)


class NativeKernelUnavailable(RuntimeError):
    """The C++ kernel could not be built or loaded on this machine (message says why)."""


@contextlib.contextmanager
def build_turn(build_dir: Path):
    """Hold this process's turn to build into ``build_dir`` (an exclusive ``flock`` on
    ``build_dir/te_npu_build.flock``; other builders wait, a dead holder's turn ends with it).

    torch's ``FileBaton`` marks a build with ``build_dir/lock`` (created, then removed when the
    build ends); a killed build leaves it, and torch then waits for it forever. Every te_npu
    build holds the turn while torch's baton exists, so one found on entry is stale: it is removed,
    with one line on stderr naming it."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "te_npu_build.flock", "a+b") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                stale.unlink()
                print(f"te_npu native kernels: removed {stale}, left by a build that was killed mid-way",
                      file=sys.stderr, flush=True)
            yield
        finally:
            fcntl.flock(turn, fcntl.LOCK_UN)


def _extension() -> tuple[str, Path]:
    """The extension's name (capability and a hash of the sources' folder and contents in it) and
    torch's build folder for it."""
    capability = torch.backends.cpu.get_cpu_capability()
    # the content hash keys torch's build cache on headers too (it hashes only the sources); the
    # folder keys it per copy of te_npu: ninja's build file names the sources by absolute path, so
    # two checkouts (or a checkout and an installed wheel) sharing one build folder rebuilt it in turn
    digest = hashlib.sha256(os.fsencode(_NATIVE_DIR.resolve()) + b"\0"
                            + b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)).hexdigest()[:10]
    name = f"te_npu_native_cpu_{capability.lower()}_{digest}"
    return name, Path(compat.extension_build_directory(name))  # torch's own place for it


def _build_and_import(name: str, build_dir: Path):
    """``torch.utils.cpp_extension.load``: build what is out of date (ninja), import the module."""
    from torch.utils.cpp_extension import load

    flags = _ARCH_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    return load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=["-O3", *flags, *_OPENMP],
                extra_ldflags=_OPENMP, build_directory=str(build_dir), verbose=False)


def _build_in_owned_child(build_dir: Path) -> str | None:
    """Compile in ``python -m te_npu.ops.kernels.native_cpu`` (its process group dies with this
    process: ``process_tree``); None when it built, else the reason (its last line)."""
    package_root = str(Path(__file__).resolve().parents[3])  # this te_npu, whatever sys.path found it through
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    proc = process_tree.start_owned([sys.executable, "-m", "te_npu.ops.kernels.native_cpu", str(build_dir)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate()
    except BaseException:
        process_tree.end_owned(proc)
        raise
    process_tree.end_owned(proc, grace_s=0)
    if proc.returncode == 0:
        return None
    lines = output.strip().splitlines()
    return lines[-1] if lines else f"the build process exited {proc.returncode}"


@lru_cache(maxsize=None)
def _load():
    """Build (first call on a machine) and import the extension; ``(module, None)`` or ``(None, reason)``."""
    try:
        name, build_dir = _extension()
        with build_turn(build_dir):
            if not (build_dir / f"{name}.so").exists():
                reason = _build_in_owned_child(build_dir)
                if reason is not None:
                    return None, reason
            module = _build_and_import(name, build_dir)  # built: ninja finds nothing to do
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


def quantize_dual(x: torch.Tensor, block_size: int = MX_BLOCK_SIZE, scale_alg: str = MX_DEFAULT_SCALE_ALG, *, out=None):
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
    mxfp8.check_blocked(x, -1, block_size, scale_alg)
    mxfp8.check_blocked(x, -2, block_size, scale_alg)
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


def quantize(x: torch.Tensor, axis: int = -1, block_size: int = MX_BLOCK_SIZE, scale_alg: str = MX_DEFAULT_SCALE_ALG):
    """Native :func:`mxfp8.quantize` for ``axis`` -1 (row) or -2 (col) of ``x: [..., N, K]``; bitwise equal."""
    if block_size != MX_BLOCK_SIZE:
        raise ValueError(f"native MXFP8 kernel supports block_size={MX_BLOCK_SIZE} only, got {block_size}")
    axis = mxfp8.check_blocked(x, axis, block_size, scale_alg)
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
        ``amax * (1.0f / format_max)`` in FP32 (as the vendor kernel, see ``hif8.current_scale``),
        or 1.0 where amax is zero or not finite.
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


# ----------------------------------------------------------------------------- decode
_NO_SCALE, _ROW_BLOCKS, _COL_BLOCKS = 0, 1, 2


@lru_cache(maxsize=None)
def _e4m3_table() -> torch.Tensor:
    """fp32 [256]: every E4M3 code's exact value (torch's widening cast; NaN for 0x7F / 0xFF)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def _codes_2d(codes: torch.Tensor, name: str) -> torch.Tensor:
    if codes.device.type != "cpu" or codes.dim() < 2:
        raise ValueError(f"native decode: {name} must be a CPU tensor with >= 2 dims, got {tuple(codes.shape)} "
                         f"on {codes.device}")
    return codes.contiguous().view(torch.uint8).reshape(-1, codes.shape[-1])


def _block_scale_shape(shape, axis: int) -> tuple[int, ...]:
    shape = list(shape)
    shape[axis] = -(-shape[axis] // MX_BLOCK_SIZE)
    return tuple(shape)


def dequantize(data: torch.Tensor, scale: torch.Tensor, axis: int = -1, *, scale_shift: int = 0,
               row_to_block: torch.Tensor | None = None) -> torch.Tensor:
    """Native MXFP8 decode to fp32: ``decode_e4m3(data) * (2**(code - 127) * 2**scale_shift)`` per
    block, the scale raised first (as ``te_npu.ops.emulation.decode``); with ``scale_shift=0``
    bitwise equal to ``mxfp8.dequantize`` / ``mxfp8.dequantize_grouped``.

    Args:
        data: ``float8_e4m3fn`` (or uint8) ``[..., N, K]``.
        scale: uint8 E8M0 codes: ``[..., N, K/32]`` (axis -1), ``[..., N/32, K]`` (axis -2), or
            ``[B, K]`` for a ragged 2D col operand with ``row_to_block`` int64 ``[N]`` (each
            row's block, as ``mxfp8.group_block_index`` returns).
        scale_shift: raise every block scale by ``2**scale_shift`` (exact).
    """
    axis = axis % data.dim()
    codes = _codes_2d(data, "data")
    block_scale = (mxfp8.e8m0_to_float(scale) * float(2**scale_shift)).contiguous()
    out = torch.empty(codes.shape, dtype=torch.float32)
    if row_to_block is not None:
        if axis != data.dim() - 2 or data.dim() != 2 or row_to_block.shape != (data.shape[0],):
            raise ValueError(f"native decode: a ragged col operand is 2D [T, K] with row_to_block [T], got data "
                             f"{tuple(data.shape)}, axis {axis}, row_to_block {tuple(row_to_block.shape)}")
        mode, rows_map, block_scale = _COL_BLOCKS, row_to_block.to(torch.int64).contiguous(), block_scale.reshape(-1, codes.shape[1])
    elif data.shape[axis] % MX_BLOCK_SIZE:
        raise ValueError(f"native decode: dim {axis} of {tuple(data.shape)} is not a multiple of {MX_BLOCK_SIZE}")
    elif tuple(scale.shape) != _block_scale_shape(data.shape, axis):
        raise ValueError(f"native decode: data {tuple(data.shape)} blocked along dim {axis} needs a scale of shape "
                         f"{_block_scale_shape(data.shape, axis)}, got {tuple(scale.shape)}")
    elif axis == data.dim() - 1:
        mode, rows_map, block_scale = _ROW_BLOCKS, _EMPTY_I64, block_scale.reshape(codes.shape[0], -1)
    elif axis == data.dim() - 2:  # N % 32 == 0 per matrix, so no block spans two leading indices
        mode, rows_map, block_scale = _COL_BLOCKS, _EMPTY_I64, block_scale.reshape(-1, codes.shape[1])
    else:
        raise ValueError(f"native decode blocks along the last two dims only, got axis {axis} of {tuple(data.shape)}")
    _module().lut_decode_into(codes, _e4m3_table(), block_scale, mode, MX_BLOCK_SIZE, rows_map, out)
    return out.reshape(data.shape)


def hif8_decode(codes: torch.Tensor) -> torch.Tensor:
    """Native ``hif8.decode(codes)`` for uint8 codes with >= 2 dims (fp32, same shape), bitwise equal."""
    flat = _codes_2d(codes, "codes")
    out = torch.empty(flat.shape, dtype=torch.float32)
    _module().lut_decode_into(flat, hif8.DECODE_TABLE, _EMPTY_F32, _NO_SCALE, 1, _EMPTY_I64, out)
    return out.reshape(codes.shape)


# ----------------------------------------------------------------------------- the variant
def _cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


class NativeCpuKernels(EagerKernels):
    """The C++ CPU kernels above where they apply, the inherited eager code elsewhere."""

    name = "native"
    devices = frozenset({"cpu"})

    def availability(self) -> tuple[bool, str | None]:
        return is_available(return_reason=True)

    def mxfp8_quantize(self, x, axis=-1, block_size=MX_BLOCK_SIZE, scale_alg=MX_DEFAULT_SCALE_ALG):
        if _cpu(x) and block_size == MX_BLOCK_SIZE and x.dim() >= 2 and axis % x.dim() >= x.dim() - 2:
            return quantize(x, axis=axis, block_size=block_size, scale_alg=scale_alg)
        return super().mxfp8_quantize(x, axis, block_size, scale_alg)

    def mxfp8_quantize_dual(self, w, block_size=MX_BLOCK_SIZE, scale_alg=MX_DEFAULT_SCALE_ALG):
        if _cpu(w) and block_size == MX_BLOCK_SIZE:
            return quantize_dual(w, block_size, scale_alg)
        return super().mxfp8_quantize_dual(w, block_size, scale_alg)

    def mxfp8_quantize_grouped(self, x, group_sizes, block_size=MX_BLOCK_SIZE, scale_alg=MX_DEFAULT_SCALE_ALG):
        if not (_cpu(x) and block_size == MX_BLOCK_SIZE):
            return super().mxfp8_quantize_grouped(x, group_sizes, block_size, scale_alg)
        if x.dim() != 2:
            raise ValueError(f"quantize_grouped needs a [T, K] tensor, got shape {tuple(x.shape)}")
        mxfp8.check_blocked(x, -1, 1, scale_alg)
        _, padded_row, num_blocks = mxfp8.ragged_layout(group_sizes, host_group_sizes(group_sizes), x.shape[0],
                                                        block_size)
        # pad and gather as eager (index math), the col blocks natively
        padded = mxfp8.pad_ragged(x, padded_row, num_blocks * block_size)
        data_padded, scale = quantize(padded, axis=-2, block_size=block_size, scale_alg=scale_alg)
        return mxfp8.gather_ragged(data_padded, padded_row), scale

    def hif8_quantize(self, x, format_max, per_group=False):
        if _cpu(x) and x.numel() > 0:
            return hif8_current_quantize(x, format_max, per_group=per_group)
        return super().hif8_quantize(x, format_max, per_group)

    def mxfp8_decode(self, data, scale, axis=-1, dtype=torch.float32, scale_shift=0):
        if (_cpu(data) and dtype == torch.float32 and data.dim() >= 2
                and data.shape[axis] % MX_BLOCK_SIZE == 0 and axis % data.dim() >= data.dim() - 2):
            return dequantize(data, scale, axis, scale_shift=scale_shift)
        return super().mxfp8_decode(data, scale, axis, dtype, scale_shift)

    def mxfp8_decode_grouped(self, data, scale, group_sizes, dtype=torch.float32, scale_shift=0):
        if not (_cpu(data) and dtype == torch.float32):
            return super().mxfp8_decode_grouped(data, scale, group_sizes, dtype, scale_shift)
        row_to_block, _ = mxfp8.group_block_index(group_sizes, MX_BLOCK_SIZE, host_sizes=host_group_sizes(group_sizes))
        return dequantize(data, scale, -2, scale_shift=scale_shift, row_to_block=row_to_block)

    def hif8_decode(self, codes, dtype=torch.float32):
        if _cpu(codes) and dtype == torch.float32 and codes.dim() >= 2:
            return hif8_decode(codes)
        return super().hif8_decode(codes, dtype)


if __name__ == "__main__":  # the owned build child (_build_in_owned_child); its parent holds the build turn
    process_tree.watch_owner()
    try:
        _build_and_import(_extension()[0], Path(sys.argv[1]))
    except Exception as exc:  # noqa: BLE001 - the parent reports the last line
        lines = str(exc).strip().splitlines()
        print(f"{type(exc).__name__}: {lines[-1] if lines else repr(exc)}", flush=True)
        sys.exit(1)
